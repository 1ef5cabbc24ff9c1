"""The selftest's figures set against what the hardware can do at most, and its pass/fail checks.

``summarize`` (the selftest job's hook, run once on the launching machine) takes the ranks'
reports: their figures, each node's NVML inventory, where each rank landed, the recorder's sync
count and the straggler phase, plus the stragglers the launcher flagged live. Each figure gets
its limit (``launcher.hardware``: the datasheet's peak for the GPU model, the PCIe link's or the
NVLinks' speed that NVML reports for that GPU) and the fraction of it reached; one below
``EXPECTED`` is flagged "LOW". Pure: tests feed it recorded NVML answers and figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from launcher.hardware import gpu_peaks, nvlink_limit_gbs, pcie_limit_gbs
from launcher.runtime.nvml import GpuReading, NvmlInventory, health_problems, visible_gpus
from launcher.workloads.stats import num

# The fraction of its limit a figure of a healthy node reaches (public measurements: 70-80% of the
# dense bf16 peak for large square products on H100 SXM, 85-90% of PCIe for pinned copies, 70-80%
# of NVLink for NCCL's all-reduce bus bandwidth where NVLink joins every pair). Below it the figure
# is flagged "LOW". An all-reduce over GPUs that NVLink does not join all to all is shown against
# its link, not judged: the host's path (PCIe switches, the CPUs' link) sets its pace.
EXPECTED: dict[str, float] = {
    "matmul_bf16": 0.70,
    "matmul_fp32": 0.60,
    "h2d_pinned": 0.75,
    "d2h_pinned": 0.75,
    "peer_copy": 0.60,
    "allreduce_node": 0.60,
}

LABELS: dict[str, str] = {
    "matmul_bf16": "matmul bf16",
    "matmul_fp32": "matmul fp32",
    "h2d_pageable": "host->GPU pageable",
    "h2d_pinned": "host->GPU pinned",
    "d2h_pageable": "GPU->host pageable",
    "d2h_pinned": "GPU->host pinned",
    "host_memcpy": "host memcpy",
    "peer_copy": "GPU0->GPU1 peer",
    "allreduce_node": "all-reduce (node)",
    "allreduce_all": "all-reduce (all)",
}


@dataclass(frozen=True)
class Limit:
    value: float
    source: str  # what the limit is, short: "H100 SXM", "PCIe5 x16", "NVLink4 x18"
    reference: str  # where it comes from: "NVIDIA H100 datasheet (SXM5)", "PCIe gen5: 32 GT/s per lane, 128b/130b"


@dataclass(frozen=True)
class Row:
    """One figure against its limit (the table's row; ``result.json``'s ``summary.rows``)."""

    host: str
    rank: int
    device: str
    check: str
    value: float
    unit: str
    limit: float | None
    limit_source: str | None
    limit_reference: str | None
    fraction: float | None
    verdict: str  # "ok", "LOW", or "-" (nothing to judge it by)
    detail: str


@dataclass(frozen=True)
class Check:
    """A yes/no promise: placement, GPU health, host syncs, the straggler flag."""

    check: str
    host: str
    passed: bool
    detail: str


def summarize(stages: list[dict[str, Any]], params: Mapping[str, Any]) -> dict[str, Any]:
    ranks = [r for s in stages for r in s["ranks"] if r.get("status") == "ok" and r.get("result")]
    nodes = {r["host"]: r["result"]["node"] for r in ranks if r["result"].get("node")}
    inventories = {h: NvmlInventory.from_dict(n["inventory"]) for h, n in nodes.items() if n.get("inventory")}
    rows = sorted((figure_row(f, ranks, inventories) for r in ranks for f in r["result"]["figures"]), key=_row_order)
    checks = placement_checks(ranks, inventories) + health_checks(ranks, inventories)
    checks += sync_checks(ranks) + straggler_checks(stages, ranks)
    not_run = [n for r in ranks for n in r["result"].get("not_run", ())]
    passed = all(c.passed for c in checks) and all(r.verdict != "LOW" for r in rows) and len(ranks) > 0
    return {
        "title": f"selftest ({params.get('level', 'default')}): each figure vs its limit",
        "columns": table_columns(rows),
        "rows": [_table_row(r) for r in rows],
        "figures": [asdict(r) for r in rows],
        "checks": [asdict(c) for c in checks],
        "not_run": _distinct(not_run),
        "nodes": nodes,
        "passed": passed,
        "conclusions": conclusions(rows, checks, not_run, passed),
    }


def plot(result: Mapping[str, Any], run_dir: Path) -> list[Path]:
    """No plot: the table is the selftest's report (the recorder's loss curve would say nothing)."""
    return []


# --- figures and their limits ---------------------------------------------------------------------


def figure_row(figure: Mapping[str, Any], ranks: list[dict[str, Any]], inventories: Mapping[str, NvmlInventory]) -> Row:
    check, host, device = figure["check"], figure["host"], figure["device"]
    # a node's figure (peer copy, all-reduce) is judged by the GPU of the rank that measured it
    measured_on = next((r for r in ranks if r["rank"] == figure["rank"]), None)
    on = measured_on["result"]["placement"]["device"] if measured_on else device
    gpu = granted_gpu(measured_on["host"] if measured_on else host, on, ranks, inventories) if check != "allreduce_all" else None
    partner = granted_gpu(measured_on["host"], "cuda:1", ranks, inventories) if check == "peer_copy" and measured_on else None
    limit = limit_for(check, gpu, inventories.get(host), partner) if gpu is not None else None
    fraction = figure["value"] / limit.value if limit else None
    expected = EXPECTED.get(check)
    if check == "allreduce_node" and not _nvlinked_all_to_all(inventories.get(host)):
        expected = None
    verdict = "-" if fraction is None or expected is None else ("ok" if fraction >= expected else "LOW")
    return Row(host or "all", figure["rank"], device or "-", check, figure["value"], figure["unit"], limit.value if limit else None,
               limit.source if limit else None, limit.reference if limit else None, fraction, verdict, figure["detail"])


def granted_gpu(host: str, device: str, ranks: list[dict[str, Any]], inventories: Mapping[str, NvmlInventory]) -> GpuReading | None:
    """The NVML reading of the GPU a figure was measured on: the one its rank was granted."""
    inventory = inventories.get(host)
    if inventory is None or not device.startswith("cuda:"):
        return None
    index = int(device.split(":")[1].split("-")[0])
    rank = next((r for r in ranks if r["host"] == host and r["result"]["placement"].get("index") == index), None)
    visible = visible_gpus(inventory, rank["result"]["placement"].get("visible") if rank else None)
    return visible[index] if index < len(visible) else None


def limit_for(check: str, gpu: GpuReading | None, inventory: NvmlInventory | None, partner: GpuReading | None = None) -> Limit | None:
    """The limit of a figure measured on ``gpu`` (``partner``: the peer copy's other GPU)."""
    if gpu is None:
        return None
    if check in ("matmul_bf16", "matmul_fp32"):
        peaks = gpu_peaks(gpu.name)
        peak = peaks and (peaks.bf16_tflops if check == "matmul_bf16" else peaks.fp32_tflops)
        return Limit(peak, peaks.model, peaks.source) if peaks and peak else None
    if check.startswith(("h2d", "d2h")):
        return _pcie(gpu)
    if check == "peer_copy" and partner is not None and inventory is not None:
        links = _nvlinks_between(inventory, gpu.index, partner.index)
        return _nvlink(gpu, links) if links else _pcie(gpu)
    if check == "allreduce_node":
        return _nvlink(gpu, gpu.nvlink_active) if gpu.nvlink_active else _pcie(gpu)
    return None


def _pcie(gpu: GpuReading) -> Limit | None:
    gen, width = gpu.pcie_max_gen or gpu.pcie_gen, gpu.pcie_max_width or gpu.pcie_width
    value = pcie_limit_gbs(gen, width)
    return Limit(value, f"PCIe{gen} x{width}", f"PCIe gen{gen} x{width}, per direction (NVML's max link)") if value else None


def _nvlink(gpu: GpuReading, links: int) -> Limit | None:
    value = nvlink_limit_gbs(gpu.nvlink_version, links)
    return Limit(value, f"NVLink{gpu.nvlink_version} x{links}", f"{links} NVLink{gpu.nvlink_version} links, per direction") if value else None


def _nvlinked_all_to_all(inventory: NvmlInventory | None) -> bool:
    """Does NVLink join every pair of the node's GPUs (NVSwitch, or a full mesh)?"""
    if inventory is None or len(inventory.gpus) < 2:
        return False
    count = len(inventory.gpus)
    return all(_nvlinks_between(inventory, a, b) for a in range(count) for b in range(count) if a != b)


def _nvlinks_between(inventory: NvmlInventory, a: int, b: int) -> int:
    """NVLinks between two GPUs, from the topology matrix ("NV18" -> 18; anything else: 0)."""
    try:
        cell = inventory.topology[a][b]
    except IndexError:
        return 0
    return int(cell[2:]) if cell.startswith("NV") and cell[2:].isdigit() else 0


# --- the yes/no checks ------------------------------------------------------------------------------


def placement_checks(ranks: list[dict[str, Any]], inventories: Mapping[str, NvmlInventory]) -> list[Check]:
    """Each rank on ``cuda:<local_rank>`` (or the CPU), on the GPU its grant names, none shared."""
    checks = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        p = r["result"]["placement"]
        where = f"rank {r['rank']} ({p['device']})"
        if p["tensor_device"] != p["device"] or p["device"] != p["expected"]:
            checks.append(Check("placement", r["host"], False, f"{where}: tensors on {p['tensor_device']}, expected {p['expected']}"))
            continue
        if "uuid" not in p:  # on the CPU: where its tensors are is all there is to check
            checks.append(Check("placement", r["host"], True, f"{where}: tensors on {p['tensor_device']}, as planned"))
            continue
        gpu = granted_gpu(r["host"], p["device"], ranks, inventories)
        if gpu is None:
            checks.append(Check("placement", r["host"], r["host"] not in inventories,
                                f"{where}: no NVML GPU matches its grant (CUDA_VISIBLE_DEVICES={p.get('visible')!r})"))
        elif gpu.uuid != p["uuid"]:
            checks.append(Check("placement", r["host"], False,
                                f"{where} is {p['uuid']}, but its grant is {gpu.uuid} (GPU {gpu.index}): set CUDA_DEVICE_ORDER=PCI_BUS_ID"))
        else:
            checks.append(Check("placement", r["host"], True, f"{where} is {gpu.uuid} (NVML GPU {gpu.index}), as granted"))
    by_host: dict[str, list[str]] = {}
    for r in ranks:
        if uuid := r["result"]["placement"].get("uuid"):
            by_host.setdefault(r["host"], []).append(uuid)
    for host, uuids in by_host.items():
        if len(set(uuids)) < len(uuids):
            checks.append(Check("placement", host, False, f"{len(uuids)} ranks share {len(set(uuids))} GPU(s)"))
    return checks


def health_checks(ranks: list[dict[str, Any]], inventories: Mapping[str, NvmlInventory]) -> list[Check]:
    """Each GPU a rank used: NVML's ECC, retired pages, row remapping, clocks, compute mode."""
    checks = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        gpu = granted_gpu(r["host"], r["result"]["placement"]["device"], ranks, inventories)
        if gpu is None:
            continue
        problems = health_problems(gpu)
        detail = "; ".join(problems) or f"{gpu.name}: no ECC errors, no pending retirements or remaps, clocks free"
        checks.append(Check("gpu_health", r["host"], not problems, f"GPU {gpu.index} {gpu.uuid}: {detail}"))
    return checks


def sync_checks(ranks: list[dict[str, Any]]) -> list[Check]:
    checks = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        s = r["result"]["sync_check"]
        said = f"rank {r['rank']}: {s['host_reads']} host read(s) in {s['steps']} logged steps"
        if s["cuda"]:
            said += ", no device sync" if s["device_sync"] is None else f", a device sync: {s['device_sync']}"
            if s["baseline_sync"]:
                said += f" (the loop without the recorder syncs too: {s['baseline_sync']})"
        checks.append(Check("recorder_syncs", r["host"], bool(s["clean"]), said))
    return checks


def straggler_checks(stages: list[dict[str, Any]], ranks: list[dict[str, Any]]) -> list[Check]:
    """The rank slowed on purpose is flagged, and no other."""
    phase = next((r["result"]["straggler"] for r in ranks if r["rank"] == 0), None)
    if not phase or phase.get("slow_rank") is None:
        return []
    slow = phase["slow_rank"]
    flagged = sorted({s["rank"] for stage in stages for s in stage.get("stragglers") or ()})
    host = next((r["host"] for r in ranks if r["rank"] == slow), "")
    marks = phase.get("marks", "")
    if flagged == [slow]:
        return [Check("straggler", host, True, f"rank {slow} (+{phase['slow_ms']:g} ms own work per step, {marks}) flagged")]
    said = "nothing flagged" if not flagged else f"flagged rank(s) {flagged}"
    return [Check("straggler", host, False, f"rank {slow} was made {phase['slow_ms']:g} ms slower per step ({marks}): {said}")]


# --- words -------------------------------------------------------------------------------------------


def conclusions(rows: list[Row], checks: list[Check], not_run: list[Mapping[str, Any]], passed: bool) -> list[str]:
    out = [f"{c.check} on {c.host}: {c.detail}" for c in checks if not c.passed]
    for r in rows:
        if r.verdict == "LOW":
            out.append(f"LOW: {LABELS.get(r.check, r.check)} on {r.host} {r.device}: {_figure(r.value, r.unit)} is "
                       f"{r.fraction:.0%} of {r.limit_reference}: {_figure(r.limit or 0, r.unit)} (a healthy node reaches {EXPECTED[r.check]:.0%})")
    passed_checks = [c for c in CHECK_LABELS if c in {k.check for k in checks if k.passed} - {k.check for k in checks if not k.passed}]
    if passed_checks:
        out.append("passed: " + ", ".join(CHECK_LABELS[c] for c in passed_checks))
    by_reason: dict[str, list[str]] = {}
    for n in _distinct(not_run):
        by_reason.setdefault(n["why"] if n["host"] == "*" else f"{n['why']}: {n['host']}", []).append(n["check"])
    for why, parts in by_reason.items():
        out.append(f"not run ({why}): {', '.join(parts)}")
    out.append("SELFTEST PASSED" if passed else "SELFTEST FAILED: see the lines above")
    return out


CHECK_LABELS = {
    "placement": "placement",
    "gpu_health": "GPU health",
    "recorder_syncs": "no host sync from the recorder",
    "straggler": "straggler flagged",
}

_ORDER = list(LABELS)


def _row_order(r: Row) -> tuple[int, str, int]:
    return (_ORDER.index(r.check) if r.check in _ORDER else len(_ORDER), r.host, r.rank)


def table_columns(rows: list[Row]) -> list[str]:
    """The table's columns, without those no row fills (a CPU-only run has no limits to show)."""
    columns = ["host", "rank", "device", "check", "figure", "limit", "of_limit", "verdict"]
    if len({r.host for r in rows}) <= 1:
        columns.remove("host")
    if all(r.limit is None for r in rows):
        columns = [c for c in columns if c not in ("limit", "of_limit", "verdict")]
    return columns


def _table_row(r: Row) -> dict[str, Any]:
    return {
        "host": r.host,
        "rank": r.rank,
        "device": r.device,
        "check": LABELS.get(r.check, r.check),
        "figure": _figure(r.value, r.unit),
        "limit": "-" if r.limit is None else f"{num(r.limit)} {r.limit_source}",
        "of_limit": "-" if r.fraction is None else f"{r.fraction:.0%}",
        "verdict": r.verdict,
    }


def _figure(value: float, unit: str) -> str:
    """A figure with its unit; a CPU's TFLOP/s in GFLOP/s, where it reads better."""
    if unit == "TFLOP/s" and value < 1:
        return f"{num(value * 1e3)} GFLOP/s"
    return f"{num(value)} {unit}"



def _distinct(items: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    for item in items:
        if dict(item) not in seen:
            seen.append(dict(item))
    return seen
