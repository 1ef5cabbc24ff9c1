"""The selftest's figures set against what the hardware can do at most, and its pass/fail checks.

``summarize`` (the selftest job's hook, run once on the launching machine) takes the ranks'
reports: their figures, each node's NVML inventory, where each rank landed, the recorder's sync
count and the straggler phase, plus the stragglers the launcher flagged live. Each figure gets
its limit (``launcher.hardware.limits``: the datasheet's peak for the GPU model, the PCIe link's or the
NVLinks' speed that NVML reports for that GPU) and the fraction of it reached; one below
``EXPECTED`` is flagged "LOW". Pure: tests feed it recorded NVML answers and figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from launcher.hardware.limits import gpu_peaks, nvlink_limit_gbs, pcie_limit_gbs
from launcher.hardware.nvml import GpuClocks, GpuReading, NvmlInventory, health_problems, visible_gpus
from launcher.workloads.stats import num

# The fraction of its limit a figure of a healthy node reaches (public measurements: 70-80% of the
# dense bf16 peak for large square products on H100 SXM, 85-90% of PCIe for pinned copies, 70-80%
# of NVLink for NCCL's all-reduce bus bandwidth where NVLink joins every pair). Below it the figure
# is flagged "LOW". bf16 at 0.60, not 0.70: a healthy H200 SXM on its default 700 W cap made
# 675-678 TFLOP/s of 989 (68-69%, the power cap reached in every sample, a hand cuBLAS loop the same;
# gpu_session.sh, 2026-11-28): dense bf16 products are power-bound on these parts, and a node that is
# really slow (a lowered power limit, heat, a degraded link) is well below 0.60. An all-reduce over GPUs that NVLink does not join all to all is shown against
# its link, not judged: the host's path (PCIe switches, the CPUs' link) sets its pace. Nor is one
# over gloo on CUDA tensors (ranks sharing a GPU): it goes through host memory, not NVLink.
EXPECTED: dict[str, float] = {
    "matmul_bf16": 0.60,
    "matmul_fp32": 0.60,
    "h2d_pinned": 0.75,
    "d2h_pinned": 0.75,
    "peer_copy": 0.60,
    "allreduce_node": 0.60,
}

LABELS: dict[str, str] = {
    "matmul_bf16": "matmul bf16",
    "matmul_bf16_hand": "matmul bf16, hand loop",
    "matmul_fp32": "matmul fp32",
    "matmul_fp32_hand": "matmul fp32, hand loop",
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
    clocks: dict[str, Any] | None = None  # the GPU's clocks, power and clock-event reasons over the run (GpuClocks)
    why: str | None = None  # what the clocks say slowed it ("power cap: 700 W reached in 80% of samples, ...")
    reference: dict[str, Any] | None = None  # a hand loop's figure right after, with the ratio (matmul)


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
    rows = [figure_row(f, ranks, inventories) for r in ranks for f in r["result"]["figures"]]
    rows = sorted(rows + [hand_row(r) for r in rows if r.reference], key=_row_order)
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
    if check.startswith("allreduce") and figure.get("backend") == "gloo":  # host memory's pace, not a link's
        limit = fraction = None
    expected = EXPECTED.get(check)
    if check == "allreduce_node" and not _nvlinked_all_to_all(inventories.get(host)):
        expected = None
    verdict = "-" if fraction is None or expected is None else ("ok" if fraction >= expected else "LOW")
    clocks = GpuClocks.from_dict(figure.get("clocks"))
    return Row(host or "all", figure["rank"], device or "-", check, figure["value"], figure["unit"], limit.value if limit else None,
               limit.source if limit else None, limit.reference if limit else None, fraction, verdict, figure["detail"],
               clocks=figure.get("clocks"), why=clocks.why() if clocks else None, reference=figure.get("reference"))


def hand_row(row: Row) -> Row:
    """The hand loop's figure beside a matmul figure: shown against the same limit, not judged."""
    ref = row.reference or {}
    value = float(ref.get("value") or 0.0)
    fraction = value / row.limit if row.limit else None
    detail = f"n={ref.get('n')}, {ref.get('iters')} products, host clock around the loop ({float(ref.get('seconds') or 0):.2g} s), right after"
    return Row(row.host, row.rank, row.device, f"{row.check}_hand", value, row.unit, row.limit, row.limit_source, row.limit_reference,
               fraction, "-", detail)


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
    checks += sharing_checks(ranks)
    return checks


def sharing_checks(ranks: list[dict[str, Any]]) -> list[Check]:
    """No GPU shared by more ranks than ``ranks_per_gpu`` asked for (1 unless the spec says so)."""
    by_gpu: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in sorted(ranks, key=lambda r: r["rank"]):
        if uuid := r["result"]["placement"].get("uuid"):
            by_gpu.setdefault((r["host"], uuid), []).append(r)
    shared = {key: rs for key, rs in by_gpu.items() if len(rs) > 1}
    if not shared:
        return []
    unintended = {key: rs for key, rs in shared.items() if any(len(rs) > int(r["result"]["placement"].get("ranks_per_gpu") or 1) for r in rs)}
    checks = []
    for host in sorted({h for h, _ in unintended}):
        mine = [rs for (h, _), rs in unintended.items() if h == host]
        sharing = sum(len(rs) for rs in mine)
        said = "; ".join(f"ranks {', '.join(str(r['rank']) for r in rs)} on {rs[0]['result']['placement']['uuid']}" for rs in mine)
        asked = max(int(r["result"]["placement"].get("ranks_per_gpu") or 1) for rs in mine for r in rs)
        checks.append(Check("placement", host, False, f"{sharing} ranks share {len(mine)} GPU(s) ({said}), "
                                                      f"but ranks_per_gpu is {asked}"))
    for (host, uuid), rs in shared.items():
        if (host, uuid) not in unintended:
            k = int(rs[0]["result"]["placement"].get("ranks_per_gpu") or 1)
            checks.append(Check("placement", host, True, f"ranks {', '.join(str(r['rank']) for r in rs)} share {uuid}, "
                                                         f"as ranks_per_gpu={k} asks (process group over gloo)"))
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
                       f"{r.fraction:.0%} of {r.limit_reference}: {_figure(r.limit or 0, r.unit)} (a healthy node reaches {EXPECTED[r.check]:.0%})"
                       + (f"; the GPU's clocks say why: {r.why}" if r.why else ""))
        elif r.why:
            out.append(f"{LABELS.get(r.check, r.check)} on {r.host} {r.device} ({_figure(r.value, r.unit)}) ran slowed: {r.why}")
        if r.reference:
            out.append(hand_words(r))
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


# A matmul figure and a hand loop right after at the same size agree within this (the bar).
HAND_AGREES = 0.03


def hand_words(r: Row) -> str:
    """A matmul figure beside its hand loop: "matmul bf16 on node-a cuda:0: 781 TFLOP/s, 0.994 of a
    hand loop's 786 TFLOP/s right after (n=8192, 1.6 s each): within 3%"."""
    ref = r.reference or {}
    value, ratio = float(ref.get("value") or 0.0), ref.get("ratio")
    seconds = f"{float(ref.get('figure_seconds') or 0):.2g} s timed vs the loop's {float(ref.get('seconds') or 0):.2g} s"
    said = (f"{LABELS.get(r.check, r.check)} on {r.host} {r.device}: {_figure(r.value, r.unit)}, "
            f"{'?' if ratio is None else f'{ratio:.3f}'} of a hand loop's {_figure(value, r.unit)} right after (n={ref.get('n')}, {seconds})")
    if ratio is None:
        return said
    return said + (f": within {HAND_AGREES:.0%}" if abs(ratio - 1) <= HAND_AGREES else f": NOT within {HAND_AGREES:.0%}")


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
    columns = ["host", "rank", "device", "check", "figure", "limit", "of_limit", "verdict", "gpu_clocks"]
    if len({r.host for r in rows}) <= 1:
        columns.remove("host")
    if all(r.limit is None for r in rows):
        columns = [c for c in columns if c not in ("limit", "of_limit", "verdict")]
    if all(r.clocks is None for r in rows):
        columns.remove("gpu_clocks")
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
        "gpu_clocks": _clocks_cell(r.clocks),
    }


def _clocks_cell(clocks: Mapping[str, Any] | None) -> str:
    """The table's short view of a figure's GPU clocks: "1590-1980 MHz, 700/700 W, power cap 80%"."""
    c = GpuClocks.from_dict(clocks)
    if c is None:
        return "-"
    parts = []
    if c.sm_mhz_min is not None and c.sm_mhz_max is not None:
        parts.append(f"{c.sm_mhz_min} MHz" if c.sm_mhz_min == c.sm_mhz_max else f"{c.sm_mhz_min}-{c.sm_mhz_max} MHz")
    if c.power_w_max is not None:
        parts.append(f"{c.power_w_max:.0f}/{c.power_limit_w:.0f} W" if c.power_limit_w else f"{c.power_w_max:.0f} W")
    if c.temperature_c_max is not None:
        parts.append(f"{c.temperature_c_max} C")
    parts += [f"{_REASON_SHORT.get(k, k)} {v:.0%}" for k, v in sorted(c.reasons.items(), key=lambda kv: -kv[1]) if v > 0]
    return ", ".join(parts) or "-"


_REASON_SHORT = {"sw_power_cap": "power cap", "hw_slowdown": "HW slowdown", "sw_thermal": "thermal", "hw_thermal": "HW thermal",
                 "hw_power_brake": "power brake"}


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
