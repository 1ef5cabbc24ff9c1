"""A node's GPUs as NVML reports them: memory, links, errors, clocks, topology; and their health.

``read_inventory`` asks NVML (the ``pynvml`` module of nvidia-ml-py, or a ``RecordedNvml``) once
per fact and never raises where NVML cannot start: no driver means no inventory, not a crash.
Every query past the GPU's identity is optional: an old driver, a consumer card or a missing
permission answers NVMLError, and the reading says "unknown" (None, 0, (), "?") instead.

``record`` runs ``read_inventory`` against the real library through a recorder, so a recording
holds exactly the calls ``read_inventory`` makes and the answers it got; ``RecordedNvml`` plays
them back, on machines without a GPU (tests) or from a bug report::

    python -m launcher.hardware.nvml            # the inventory as JSON
    python -m launcher.hardware.nvml --record   # every raw answer, for RecordedNvml

Recording format: ``{"nvml_recording": 1, "system": {function: answer}, "devices": [{function:
answer or {"<extra args>": answer}}]}``. A device call's answer sits under its device (the handle
is the index); a call with arguments beyond the handle keys its answers by them, comma-joined
(handles as their index). Structs are dicts of their fields, tuples are lists, bytes are text, and
an NVML error is ``{"nvml_error": code}``.

Never imports torch: it runs in every preflight.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Mapping

RECORDING_FORMAT = 1

# NVML's C ABI values (stable across driver releases): read_inventory passes these itself so that
# a stand-in for pynvml need not carry pynvml's constants.
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_NVLINK_MAX_LINKS = 36

MIB = 1024 * 1024

# Clock-event (throttle) reasons that mean the GPU runs slower than it should. GPU idle,
# application clocks, sync boost and display clocks are deliberate, not a slowdown.
CLOCK_EVENT_REASONS = (
    (0x04, "sw_power_cap"),
    (0x08, "hw_slowdown"),
    (0x20, "sw_thermal"),
    (0x40, "hw_thermal"),
    (0x80, "hw_power_brake"),
)
# Drawing near the power limit under load is normal: only the other reasons are a health problem.
HARMLESS_CLOCK_EVENTS = frozenset({"sw_power_cap"})

COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}

# nvmlDeviceGetTopologyCommonAncestor's levels, named as `nvidia-smi topo -m` names them. A
# multi-GPU board (INTERNAL) is no farther apart than a single PCIe switch.
TOPOLOGY_LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}

# nvmlDeviceGetNvLinkVersion answers nvmlNvlinkVersion_t, not the generation (A100 answers 5 for
# NVLink 3.1): 1=1.0, 2=2.0, 3=2.2, 4=3.0, 5=3.1, 6=4.0, 7=5.0, 8=6.0.
NVLINK_GENERATION_OF_VERSION = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5, 8: 6}


@dataclass(frozen=True)
class GpuReading:
    index: int  # NVML index (PCI bus order)
    name: str
    uuid: str  # "GPU-..."
    pci_bus_id: str
    memory_total_mib: int
    memory_used_mib: int
    memory_free_mib: int
    pcie_gen: int | None  # current link generation / width, and the device's max
    pcie_width: int | None
    pcie_max_gen: int | None
    pcie_max_width: int | None
    nvlink_version: int | None  # NVLink generation (4 on H100); None: no NVLink
    nvlink_active: int  # active NVLink links (0 without NVLink)
    ecc_uncorrected_volatile: int | None  # None: ECC not supported/enabled
    retired_pages_pending: bool | None
    remapped_rows_pending: bool | None
    remapped_rows_failure: bool | None
    throttle_reasons: tuple[str, ...]  # active clock-event reasons that slow the GPU (CLOCK_EVENT_REASONS)
    compute_mode: str  # "default", "exclusive_thread", "prohibited", "exclusive_process" ("?": unknown)
    temperature_c: int | None
    power_w: float | None
    sm_clock_mhz: int | None
    sm_clock_max_mhz: int | None
    utilization_gpu_pct: int | None = None  # nvmlDeviceGetUtilizationRates' gpu (what nvidia-smi shows)


@dataclass(frozen=True)
class NvmlInventory:
    driver_version: str
    cuda_driver_version: str  # "12.4" (nvmlSystemGetCudaDriverVersion 12040)
    gpus: tuple[GpuReading, ...]
    # like `nvidia-smi topo -m`: "X" on the diagonal, "NV<k>" for k NVLinks between the pair, else
    # PIX/PXB/PHB/NODE/SYS; "?" where NVML does not say
    topology: tuple[tuple[str, ...], ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "NvmlInventory":
        known = {f.name for f in fields(GpuReading)}  # a newer writer's extra fields are ignored
        gpus = tuple(
            GpuReading(**{**{k: v for k, v in g.items() if k in known}, "throttle_reasons": tuple(g.get("throttle_reasons", ()))})
            for g in data.get("gpus", ())
        )
        return cls(
            driver_version=str(data["driver_version"]),
            cuda_driver_version=str(data["cuda_driver_version"]),
            gpus=gpus,
            topology=tuple(tuple(str(cell) for cell in row) for row in data.get("topology", ())),
        )


# --- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _NvLinks:
    version: int | None  # generation
    remote_bus_ids: tuple[str, ...]  # one per active link: the peer GPU's or an NVSwitch's PCI bus id


def _text(value: Any) -> str:
    # pynvml before 11.5 answers bytes; structs' char arrays are bytes in every version
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _bus_id(value: str) -> str:
    return value.strip().upper()


def _ask(nvml: Any, function: str, *args: Any) -> Any | None:
    """An optional query's answer, or None where NVML cannot give it (not supported, no
    permission, a driver or pynvml too old to have the function)."""
    query = getattr(nvml, function, None)
    if query is None:
        return None
    try:
        return query(*args)
    except nvml.NVMLError:
        return None


def _optional_int(value: Any | None) -> int | None:
    return None if value is None else int(value)


def _cuda_version_text(version: int | None) -> str:
    return "?" if version is None else f"{version // 1000}.{(version % 1000) // 10}"


def _clock_event_mask(nvml: Any, handle: Any) -> int | None:
    # The "throttle" function was renamed "clocks event" in driver 535; older drivers lack the new one.
    for function in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        query = getattr(nvml, function, None)
        if query is None:
            continue
        try:
            return int(query(handle))
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) != NVML_ERROR_FUNCTION_NOT_FOUND:
                return None
    return None


def _scan_nvlinks(nvml: Any, handle: Any) -> _NvLinks:
    """Active links and where they lead. Links are numbered from 0; the first link NVML refuses
    is past the device's last (or the device has no NVLink at all)."""
    remote: list[str] = []
    active: list[int] = []
    links_answered = 0
    for link in range(NVML_NVLINK_MAX_LINKS):
        state = _ask(nvml, "nvmlDeviceGetNvLinkState", handle, link)
        if state is None:
            break
        links_answered += 1
        if int(state):
            active.append(link)
            pci = _ask(nvml, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
            remote.append("?" if pci is None else _bus_id(_text(pci.busId)))
    if not links_answered:
        return _NvLinks(None, ())
    # an active link says the version in use; with none active, link 0 still says what the GPU has
    version = _optional_int(_ask(nvml, "nvmlDeviceGetNvLinkVersion", handle, active[0] if active else 0))
    return _NvLinks(None if version is None else NVLINK_GENERATION_OF_VERSION.get(version), tuple(remote))


def _memory_errors(nvml: Any, handle: Any) -> tuple[int | None, bool | None, bool | None, bool | None]:
    """(volatile uncorrectable ECC errors, retired pages pending, row remap pending, row remap failed)."""
    ecc = _optional_int(_ask(nvml, "nvmlDeviceGetTotalEccErrors", handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC))
    pages = _ask(nvml, "nvmlDeviceGetRetiredPagesPendingStatus", handle)
    rows = _ask(nvml, "nvmlDeviceGetRemappedRows", handle)  # (correctable, uncorrectable, pending, failure)
    return (
        ecc,
        None if pages is None else bool(pages),
        None if rows is None else bool(rows[2]),
        None if rows is None else bool(rows[3]),
    )


def _read_gpu(nvml: Any, index: int, handle: Any, links: _NvLinks) -> GpuReading:
    name = _ask(nvml, "nvmlDeviceGetName", handle)
    uuid = _ask(nvml, "nvmlDeviceGetUUID", handle)
    pci = _ask(nvml, "nvmlDeviceGetPciInfo", handle)
    memory = _ask(nvml, "nvmlDeviceGetMemoryInfo", handle)
    mask = _clock_event_mask(nvml, handle)
    power_mw = _ask(nvml, "nvmlDeviceGetPowerUsage", handle)
    mode = _ask(nvml, "nvmlDeviceGetComputeMode", handle)
    utilization = _ask(nvml, "nvmlDeviceGetUtilizationRates", handle)
    ecc, pages_pending, rows_pending, rows_failed = _memory_errors(nvml, handle)
    return GpuReading(
        index=index,
        name="?" if name is None else _text(name),
        uuid="?" if uuid is None else _text(uuid),
        pci_bus_id="?" if pci is None else _bus_id(_text(pci.busId)),
        memory_total_mib=0 if memory is None else int(memory.total) // MIB,
        memory_used_mib=0 if memory is None else int(memory.used) // MIB,
        memory_free_mib=0 if memory is None else int(memory.free) // MIB,
        pcie_gen=_optional_int(_ask(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle)),
        pcie_width=_optional_int(_ask(nvml, "nvmlDeviceGetCurrPcieLinkWidth", handle)),
        pcie_max_gen=_optional_int(_ask(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", handle)),
        pcie_max_width=_optional_int(_ask(nvml, "nvmlDeviceGetMaxPcieLinkWidth", handle)),
        nvlink_version=links.version,
        nvlink_active=len(links.remote_bus_ids),
        ecc_uncorrected_volatile=ecc,
        retired_pages_pending=pages_pending,
        remapped_rows_pending=rows_pending,
        remapped_rows_failure=rows_failed,
        throttle_reasons=() if mask is None else tuple(reason for bit, reason in CLOCK_EVENT_REASONS if mask & bit),
        compute_mode="?" if mode is None else COMPUTE_MODES.get(int(mode), "?"),
        temperature_c=_optional_int(_ask(nvml, "nvmlDeviceGetTemperature", handle, NVML_TEMPERATURE_GPU)),
        power_w=None if power_mw is None else int(power_mw) / 1000.0,
        sm_clock_mhz=_optional_int(_ask(nvml, "nvmlDeviceGetClockInfo", handle, NVML_CLOCK_SM)),
        sm_clock_max_mhz=_optional_int(_ask(nvml, "nvmlDeviceGetMaxClockInfo", handle, NVML_CLOCK_SM)),
        utilization_gpu_pct=None if utilization is None else int(utilization.gpu),
    )


def _nvlinks_between(gpus: list[GpuReading], links: list[_NvLinks], i: int, j: int) -> int:
    """NVLinks joining GPUs i and j: direct links, or through NVSwitches, which join every GPU on
    the fabric by as many links as the less connected of the two has to it (what nvidia-smi shows).
    A link that leads to no GPU here is taken for an NVSwitch."""
    gpu_buses = {g.pci_bus_id for g in gpus}
    direct = sum(1 for bus in links[i].remote_bus_ids if bus == gpus[j].pci_bus_id)
    switched_i = sum(1 for bus in links[i].remote_bus_ids if bus not in gpu_buses)
    switched_j = sum(1 for bus in links[j].remote_bus_ids if bus not in gpu_buses)
    return direct + min(switched_i, switched_j)


def _topology(nvml: Any, handles: list[Any], gpus: list[GpuReading], links: list[_NvLinks]) -> tuple[tuple[str, ...], ...]:
    n = len(gpus)
    matrix = [["X" if i == j else "?" for j in range(n)] for i in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            nvlinks = _nvlinks_between(gpus, links, i, j)
            if nvlinks:
                cell = f"NV{nvlinks}"
            elif handles[i] is None or handles[j] is None:
                cell = "?"
            else:  # asked once per pair: the PCIe path is the same both ways
                level = _ask(nvml, "nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j])
                cell = "?" if level is None else TOPOLOGY_LEVELS.get(int(level), "?")
            matrix[i][j] = matrix[j][i] = cell
    return tuple(tuple(row) for row in matrix)


def _read_all(nvml: Any) -> NvmlInventory:
    driver = _ask(nvml, "nvmlSystemGetDriverVersion")
    cuda = _ask(nvml, "nvmlSystemGetCudaDriverVersion")
    handles: list[Any] = []
    for index in range(int(nvml.nvmlDeviceGetCount())):
        # a GPU NVML cannot even open (fallen off the bus) still counts: its reading says "unknown"
        handles.append(_ask(nvml, "nvmlDeviceGetHandleByIndex", index))
    links = [_NvLinks(None, ()) if h is None else _scan_nvlinks(nvml, h) for h in handles]
    gpus = [_unreadable_gpu(i) if h is None else _read_gpu(nvml, i, h, links[i]) for i, h in enumerate(handles)]
    return NvmlInventory(
        driver_version="?" if driver is None else _text(driver),
        cuda_driver_version=_cuda_version_text(_optional_int(cuda)),
        gpus=tuple(gpus),
        topology=_topology(nvml, handles, gpus, links),
    )


UNREADABLE = "?"  # the UUID of a GPU whose NVML handle could not be had


def _unreadable_gpu(index: int) -> GpuReading:
    unknown: dict[str, Any] = {f.name: None for f in fields(GpuReading)}
    unknown.update(index=index, name="?", uuid=UNREADABLE, pci_bus_id="?", compute_mode="?", throttle_reasons=(), nvlink_active=0)
    unknown.update(memory_total_mib=0, memory_used_mib=0, memory_free_mib=0)
    return GpuReading(**unknown)


def _pynvml() -> Any | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _open_inventory(nvml: Any | None) -> tuple[NvmlInventory | None, str]:
    """The inventory, or None and why not."""
    nvml = _pynvml() if nvml is None else nvml
    if nvml is None:
        return None, "nvidia-ml-py (pynvml) is not installed"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:  # no driver, no libnvidia-ml, driver/library mismatch
        return None, f"NVML did not start: {exc}"
    try:
        return _read_all(nvml), ""
    except nvml.NVMLError as exc:  # the device count itself failed: NVML is of no use here
        return None, f"NVML could not count the GPUs: {exc}"
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass  # what was read stands


def read_inventory(nvml: Any | None = None) -> NvmlInventory | None:
    """None where NVML cannot start (no driver/library): never raises for that. `nvml`: the pynvml
    module (default) or a RecordedNvml."""
    return _open_inventory(nvml)[0]


# --- which GPUs a job sees, and whether they are fit ----------------------------------------------


def visible_gpus(inventory: NvmlInventory, visible: str | None) -> list[GpuReading]:
    """The GPUs CUDA_VISIBLE_DEVICES exposes, in the order CUDA numbers them (indices or UUID
    prefixes; stop at the first entry that matches nothing, as CUDA does; None = all).

    Indices are NVML's (PCI bus order), which are CUDA's under CUDA_DEVICE_ORDER=PCI_BUS_ID and on
    any node of identical GPUs. A MIG entry matches no GPU here.
    """
    if visible is None:
        return list(inventory.gpus)
    chosen: list[GpuReading] = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry:
            break
        if entry.lstrip("-").isdigit():
            match = next((g for g in inventory.gpus if g.index == int(entry)), None)
        else:
            match = next((g for g in inventory.gpus if g.uuid.startswith(entry) or g.uuid.startswith(f"GPU-{entry}")), None)
        if match is None or match in chosen:  # CUDA also refuses a GPU named twice
            break
        chosen.append(match)
    return chosen


def health_problems(gpu: GpuReading, *, min_free_mib: int = 0) -> list[str]:
    """What makes this GPU unfit for a job, each a short phrase naming what was found. Empty:
    healthy. sw_power_cap alone is not a problem (it is normal under load)."""
    problems: list[str] = []
    if gpu.uuid == UNREADABLE:  # its handle failed (a GPU fallen off the bus); unified memory reads 0 MiB and is fine
        problems.append("NVML cannot read this GPU (lost or unreachable)")
    if gpu.ecc_uncorrected_volatile:
        errors = gpu.ecc_uncorrected_volatile
        problems.append(f"{errors} uncorrectable ECC error{'s' if errors != 1 else ''} (volatile)")
    if gpu.retired_pages_pending:
        problems.append("retired pages pending (reset the GPU)")
    if gpu.remapped_rows_pending:
        problems.append("row remapping pending (reset the GPU)")
    if gpu.remapped_rows_failure:
        problems.append("row remapping failed")
    slowdowns = [reason for reason in gpu.throttle_reasons if reason not in HARMLESS_CLOCK_EVENTS]
    if slowdowns:
        clocks = f" (sm {gpu.sm_clock_mhz} of {gpu.sm_clock_max_mhz} MHz)" if gpu.sm_clock_mhz is not None and gpu.sm_clock_max_mhz else ""
        problems.append(f"clocks held down: {', '.join(slowdowns)}{clocks}")
    if min_free_mib > 0 and gpu.memory_total_mib > 0 and gpu.memory_free_mib < min_free_mib:
        problems.append(f"only {gpu.memory_free_mib} MiB free, the job needs {min_free_mib}")
    if gpu.compute_mode == "prohibited":
        problems.append("compute mode prohibited")
    return problems


def granted_gpu_problems(index: int, visible: str | None, nvml: Any | None = None) -> list[str]:
    """The health problems of the GPU a process was granted (its ``cuda:<index>`` under
    ``visible``, the process's CUDA_VISIBLE_DEVICES), each naming the GPU's NVML index and UUID;
    empty when it is healthy or NVML cannot say (no driver library). Free memory is not judged
    here: a restarted rank's predecessor may still be letting go of it."""
    inventory = read_inventory(nvml)
    if inventory is None:
        return []
    gpus = visible_gpus(inventory, visible)
    if index >= len(gpus):
        return []
    gpu = gpus[index]
    return [f"GPU {gpu.index} ({gpu.uuid}): {problem}" for problem in health_problems(gpu)]


# --- a GPU's clocks over one figure's run ----------------------------------------------------------

# What each clock-event reason means for a figure, in a report's words.
CLOCK_EVENT_WORDS = {
    "sw_power_cap": "power cap",
    "hw_slowdown": "hardware slowdown",
    "sw_thermal": "thermal slowdown",
    "hw_thermal": "hardware thermal slowdown",
    "hw_power_brake": "power brake",
}
# A reason present in at least this fraction of a run's samples explains a figure.
EXPLAINS = 0.10


@dataclass(frozen=True)
class GpuSample:
    """One NVML reading of a GPU while a figure runs (None: NVML did not say)."""

    t_s: float  # seconds since the sampler started
    sm_mhz: int | None
    mem_mhz: int | None
    power_w: float | None
    power_limit_w: float | None
    temperature_c: int | None
    reasons: tuple[str, ...]  # active clock-event reasons (CLOCK_EVENT_REASONS)


@dataclass(frozen=True)
class GpuClocks:
    """A GPU's clocks, power and clock-event (throttle) reasons over one figure's run: what makes a
    figure lower than its neighbour (the power cap, heat) visible beside it."""

    samples: int
    seconds: float
    sm_mhz_min: int | None
    sm_mhz_median: int | None
    sm_mhz_max: int | None
    sm_mhz_top: int | None  # the GPU's max SM clock (NVML)
    mem_mhz_median: int | None
    power_w_median: float | None
    power_w_max: float | None
    power_limit_w: float | None
    temperature_c_max: int | None
    reasons: dict[str, float]  # fraction of the samples with each reason (those seen at all)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "GpuClocks | None":
        if not data:
            return None
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["reasons"] = {str(k): float(v) for k, v in dict(data.get("reasons") or {}).items()}
        return cls(**values)

    def sm_range(self) -> str | None:
        if self.sm_mhz_min is None or self.sm_mhz_max is None:
            return None
        same = self.sm_mhz_min == self.sm_mhz_max
        return f"SM clock {self.sm_mhz_min} MHz" if same else f"SM clock {self.sm_mhz_min}-{self.sm_mhz_max} MHz"

    def why(self, at_least: float = EXPLAINS) -> str | None:
        """Why a figure measured under these clocks is low, in words, or None where no clock-event
        reason was active in ``at_least`` of the samples: "power cap: 700 W reached in 80% of
        samples, SM clock 1590-1980 MHz"."""
        parts = []
        for reason, share in sorted(self.reasons.items(), key=lambda kv: -kv[1]):
            if share < at_least:
                continue
            words = CLOCK_EVENT_WORDS.get(reason, reason)
            if reason == "sw_power_cap":
                limit = f"{self.power_limit_w:.0f} W" if self.power_limit_w else "the power limit"
                parts.append(f"{words}: {limit} reached in {share:.0%} of samples")
            elif reason in ("sw_thermal", "hw_thermal") and self.temperature_c_max is not None:
                parts.append(f"{words} in {share:.0%} of samples (up to {self.temperature_c_max} C)")
            else:
                parts.append(f"{words} in {share:.0%} of samples")
        if not parts:
            return None
        sm = self.sm_range()
        return ", ".join([*parts, *([sm] if sm else [])])

    def words(self) -> str:
        """All of it, short: "SM clock 1590-1980 MHz (median 1755), memory 2619 MHz, 690 W max of 700 W, 61 C max"."""
        parts = []
        if sm := self.sm_range():
            parts.append(sm + (f" (median {self.sm_mhz_median})" if self.sm_mhz_median is not None and self.sm_mhz_min != self.sm_mhz_max else ""))
        if self.mem_mhz_median is not None:
            parts.append(f"memory {self.mem_mhz_median} MHz")
        if self.power_w_max is not None:
            parts.append(f"{self.power_w_max:.0f} W max" + (f" of {self.power_limit_w:.0f} W" if self.power_limit_w else ""))
        if self.temperature_c_max is not None:
            parts.append(f"{self.temperature_c_max} C max")
        seen = [f"{CLOCK_EVENT_WORDS.get(r, r)} {share:.0%}" for r, share in sorted(self.reasons.items(), key=lambda kv: -kv[1])]
        if seen:
            parts.append("clock events: " + ", ".join(seen))
        return ", ".join(parts) + f" ({self.samples} samples over {self.seconds:.2g} s)"


def summarize_samples(samples: list[GpuSample], sm_mhz_top: int | None = None) -> GpuClocks | None:
    """min/median/max SM clock, median memory clock, median and max power, the power limit, the
    hottest reading and the fraction of samples with each clock-event reason. None: no samples."""
    if not samples:
        return None

    def known(values: list[Any]) -> list[Any]:
        return [v for v in values if v is not None]

    sm = known([s.sm_mhz for s in samples])
    mem = known([s.mem_mhz for s in samples])
    power = known([s.power_w for s in samples])
    limits = known([s.power_limit_w for s in samples])
    temps = known([s.temperature_c for s in samples])
    seen = sorted({r for s in samples for r in s.reasons})
    return GpuClocks(
        samples=len(samples),
        seconds=round(samples[-1].t_s - samples[0].t_s, 3),
        sm_mhz_min=min(sm) if sm else None,
        sm_mhz_median=int(statistics.median(sm)) if sm else None,
        sm_mhz_max=max(sm) if sm else None,
        sm_mhz_top=sm_mhz_top,
        mem_mhz_median=int(statistics.median(mem)) if mem else None,
        power_w_median=round(float(statistics.median(power)), 1) if power else None,
        power_w_max=round(max(power), 1) if power else None,
        power_limit_w=round(max(limits), 1) if limits else None,
        temperature_c_max=max(temps) if temps else None,
        reasons={r: round(sum(r in s.reasons for s in samples) / len(samples), 3) for r in seen},
    )


class GpuSampler:
    """NVML's readings of one GPU in a thread, every ``interval_s``, while a figure runs::

        with GpuSampler(uuid="GPU-...") as sampler:
            ...  # the timed trials
        sampler.clocks  # a GpuClocks, or None (no GPU, no NVML, the GPU not found)

    The GPU is found by its UUID (what torch's device properties give: CUDA_VISIBLE_DEVICES and
    CUDA_DEVICE_ORDER do not matter) or else by NVML index. One reading at the start and one at the
    end, so a short run still has two. Never raises for NVML: ``why_not`` says what stopped it.
    ``nvml``: the pynvml module (default) or a stand-in (RecordedNvml, a test's fake).
    """

    def __init__(self, uuid: str | None = None, index: int | None = None, *, interval_s: float = 0.02,
                 nvml: Any | None = None, clock: Callable[[], float] = time.monotonic, enabled: bool = True) -> None:
        self.uuid, self.index, self.interval_s = uuid, index, interval_s
        self._nvml = nvml
        self._clock = clock
        self._enabled = enabled and (uuid is not None or index is not None)
        self._handle: Any = None
        self._t0 = 0.0
        self._samples: list[GpuSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._top: int | None = None
        self.clocks: GpuClocks | None = None
        self.why_not: str | None = None if self._enabled else "no GPU"

    def __enter__(self) -> "GpuSampler":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def samples(self) -> list[GpuSample]:
        return list(self._samples)

    def start(self) -> None:
        if not self._enabled:
            return
        nvml = _pynvml() if self._nvml is None else self._nvml
        if nvml is None:
            self.why_not = "nvidia-ml-py (pynvml) is not installed"
            return
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            self.why_not = f"NVML did not start: {exc}"
            return
        self._nvml = nvml
        self._handle = self._find(nvml)
        if self._handle is None:
            self.why_not = f"NVML has no GPU {self.uuid or self.index}"
            self._shutdown()
            return
        self._top = _optional_int(_ask(nvml, "nvmlDeviceGetMaxClockInfo", self._handle, NVML_CLOCK_SM))
        self._t0 = self._clock()
        self._samples = [self.sample()]
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> GpuClocks | None:
        if self._handle is None:
            return None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self._samples.append(self.sample())
        except Exception:  # noqa: BLE001 - a reading lost at the end loses one sample, not the figure
            pass
        self._shutdown()
        self._handle = None
        self.clocks = summarize_samples(self._samples, self._top)
        return self.clocks

    def sample(self) -> GpuSample:
        nvml, handle = self._nvml, self._handle
        mask = _clock_event_mask(nvml, handle)
        power = _ask(nvml, "nvmlDeviceGetPowerUsage", handle)
        limit = _ask(nvml, "nvmlDeviceGetEnforcedPowerLimit", handle)
        return GpuSample(
            t_s=round(self._clock() - self._t0, 4),
            sm_mhz=_optional_int(_ask(nvml, "nvmlDeviceGetClockInfo", handle, NVML_CLOCK_SM)),
            mem_mhz=_optional_int(_ask(nvml, "nvmlDeviceGetClockInfo", handle, NVML_CLOCK_MEM)),
            power_w=None if power is None else int(power) / 1000.0,
            power_limit_w=None if limit is None else int(limit) / 1000.0,
            temperature_c=_optional_int(_ask(nvml, "nvmlDeviceGetTemperature", handle, NVML_TEMPERATURE_GPU)),
            reasons=() if mask is None else tuple(reason for bit, reason in CLOCK_EVENT_REASONS if mask & bit),
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._samples.append(self.sample())
            except Exception:  # noqa: BLE001 - NVML gone mid-run: the samples so far stand
                return

    def _find(self, nvml: Any) -> Any | None:
        if self.uuid is None:
            return _ask(nvml, "nvmlDeviceGetHandleByIndex", self.index)
        count = _ask(nvml, "nvmlDeviceGetCount")
        for i in range(int(count or 0)):
            handle = _ask(nvml, "nvmlDeviceGetHandleByIndex", i)
            uuid = None if handle is None else _ask(nvml, "nvmlDeviceGetUUID", handle)
            if uuid is not None and _text(uuid).removeprefix("GPU-") == self.uuid.removeprefix("GPU-"):
                return handle
        return None

    def _shutdown(self) -> None:
        nvml = self._nvml
        if nvml is None:
            return
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


# --- recording and playing back -------------------------------------------------------------------


class _Handle(int):
    """A device handle that is its NVML index: what RecordedNvml hands out, and what the recorder
    hands read_inventory in place of the library's (it keeps the real one)."""


def _locate(function: str, args: tuple[Any, ...]) -> tuple[int | None, str | None]:
    """Where a call's answer lives: its device (None: the system) and the key of its arguments
    beyond the handle (None: no arguments, the answer sits under the function's name)."""
    if args and isinstance(args[0], _Handle):
        device, extra = int(args[0]), args[1:]
    elif function == "nvmlDeviceGetHandleByIndex":
        device, extra = int(args[0]), ()
    else:
        device, extra = None, args
    return device, (",".join(str(int(a)) for a in extra) if extra else None)


def _as_json(answer: Any) -> Any:
    if isinstance(answer, bytes):
        return _text(answer)
    if isinstance(answer, (tuple, list)):
        return [_as_json(a) for a in answer]
    if hasattr(answer, "_fields_"):  # a ctypes struct
        return {name: _as_json(getattr(answer, name)) for name, *_ in answer._fields_}
    if isinstance(answer, SimpleNamespace):
        return {name: _as_json(value) for name, value in vars(answer).items()}
    return answer


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        return SimpleNamespace(**value)
    if isinstance(value, list):
        return tuple(value)
    return value


def _error_class() -> type[Exception]:
    pynvml = _pynvml()
    error: type[Exception] = pynvml.NVMLError if pynvml is not None else _FallbackNVMLError
    return error


class _FallbackNVMLError(Exception):
    """pynvml.NVMLError's shape, where nvidia-ml-py is not installed."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class RecordedNvml:
    """Stands in for the pynvml module, answering from a recording (see record()). Recorded errors
    re-raise as pynvml.NVMLError with the recorded code (e.g. NOT_SUPPORTED); a call the
    recording lacks answers FUNCTION_NOT_FOUND, as a driver too old for it would."""

    def __init__(self, recording: Mapping[str, Any]) -> None:
        self._system: Mapping[str, Any] = recording.get("system", {})
        self._devices: list[Mapping[str, Any]] = list(recording.get("devices", ()))
        self.NVMLError = _error_class()

    @classmethod
    def from_file(cls, path: str | Path) -> "RecordedNvml":
        return cls(json.loads(Path(path).read_text()))

    def __getattr__(self, function: str) -> Any:
        if not function.startswith("nvml"):
            raise AttributeError(function)
        return lambda *args: self._answer(function, args)

    def _answer(self, function: str, args: tuple[Any, ...]) -> Any:
        device, key = _locate(function, args)
        if function == "nvmlDeviceGetHandleByIndex":
            if device is None or not 0 <= device < len(self._devices):
                raise self.NVMLError(NVML_ERROR_INVALID_ARGUMENT)
            self._raise_if_error(self._devices[device].get(function))
            return _Handle(device)
        section = self._system if device is None else self._devices[device]
        if function not in section:
            raise self.NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        answer = section[function]
        self._raise_if_error(answer)  # an error in place of all of a function's answers stands for each
        if key is not None:
            if key not in answer:
                raise self.NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
            answer = answer[key]
            self._raise_if_error(answer)
        return _from_json(answer)

    def _raise_if_error(self, answer: Any) -> None:
        if isinstance(answer, dict) and "nvml_error" in answer:
            raise self.NVMLError(int(answer["nvml_error"]))


class _Recorder:
    """Passes read_inventory's calls to the library and writes down each answer (see the module's
    docstring for where). Handles it gives out are indices (_Handle); it keeps the real ones."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._real_handles: dict[int, Any] = {}
        self.recording: dict[str, Any] = {"nvml_recording": RECORDING_FORMAT, "system": {}, "devices": []}

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._nvml, name)
        if not name.startswith("nvml") or not callable(target):
            return target  # NVMLError and the constants
        return lambda *args: self._call(name, target, args)

    def _call(self, function: str, target: Any, args: tuple[Any, ...]) -> Any:
        real_args = [self._real_handles[int(a)] if isinstance(a, _Handle) else a for a in args]
        try:
            answer = target(*real_args)
        except self._nvml.NVMLError as exc:
            self._store(function, args, {"nvml_error": int(exc.value)})
            raise
        if function == "nvmlDeviceGetHandleByIndex":  # the handle itself is no answer to keep
            self._real_handles[int(args[0])] = answer
            return _Handle(int(args[0]))
        self._store(function, args, _as_json(answer))
        return answer

    def _section(self, device: int | None) -> dict[str, Any]:
        if device is None:
            system: dict[str, Any] = self.recording["system"]
            return system
        devices: list[dict[str, Any]] = self.recording["devices"]
        devices.extend({} for _ in range(device + 1 - len(devices)))
        return devices[device]

    def _store(self, function: str, args: tuple[Any, ...], answer: Any) -> None:
        device, key = _locate(function, args)
        section = self._section(device)
        if key is None:
            section[function] = answer
        else:
            section.setdefault(function, {})[key] = answer


def record(nvml: Any | None = None) -> dict[str, Any]:
    """Every raw NVML answer read_inventory asks for, JSON-able, for tests and bug reports (run on
    a GPU machine: `python -m launcher.hardware.nvml --record > h100.json`)."""
    nvml = _pynvml() if nvml is None else nvml
    if nvml is None:  # recorded as the library being absent, which is what it amounts to
        return {"nvml_recording": RECORDING_FORMAT, "system": {"nvmlInit": {"nvml_error": NVML_ERROR_LIBRARY_NOT_FOUND}}, "devices": []}
    recorder = _Recorder(nvml)
    read_inventory(recorder)
    return recorder.recording


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--record" in args:
        print(json.dumps(record(), indent=1))
        return 0
    inventory, reason = _open_inventory(None)
    print(json.dumps({"nvml": None, "reason": reason} if inventory is None else inventory.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
