"""What a node has: its GPUs (from NVML, else from its command-line face, nvidia-smi) and CPU cores.

Also the device helpers of d2l's "GPUs" chapter (``cpu``, ``gpu``, ``num_gpus``, ``try_gpu``,
``try_all_gpus``). Discovery never imports torch, so ``launch devices`` answers instantly; the
helpers import it on first use.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

    from launcher.hardware.nvml import NvmlInventory  # NVML's module is imported where a GPU may be read

NVIDIA_SMI_FIELDS = "index,name,memory.total,memory.used,utilization.gpu,uuid"
NVIDIA_SMI_ARGS = ("--query-gpu=" + NVIDIA_SMI_FIELDS, "--format=csv,noheader,nounits")


@dataclass(frozen=True)
class GpuInfo:
    index: int  # index as the processes on this node will see it (after CUDA_VISIBLE_DEVICES)
    physical_index: int
    name: str
    memory_total_mib: int
    memory_used_mib: int | None
    utilization_pct: int | None
    uuid: str
    memory_free_mib: int | None = None  # NVML only
    health: tuple[str, ...] = ()  # NVML's problems with this GPU (``launcher.hardware.nvml.health_problems``); empty: none found

    def unfit(self, min_free_fraction: float = 0.0) -> list[str]:
        """Why a job should not run on this GPU: its health problems, and too little free memory."""
        problems = list(self.health)
        free = self.memory_free_mib
        if free is None and self.memory_used_mib is not None and self.memory_total_mib:
            free = self.memory_total_mib - self.memory_used_mib
        if free is not None and self.memory_total_mib and free < min_free_fraction * self.memory_total_mib:
            problems.append(
                f"only {free} of {self.memory_total_mib} MiB free (another process holds the rest; the job wants {min_free_fraction:.0%} free)"
            )
        return problems

    def label(self) -> str:
        """How a message names it: its index on the host (as nvidia-smi numbers it) and its UUID."""
        seen_as = f", cuda:{self.index} for the job" if self.index != self.physical_index else ""
        return f"GPU {self.physical_index} ({self.uuid}{seen_as})"


@dataclass(frozen=True)
class NodeInventory:
    hostname: str
    cpu_count: int
    gpus: tuple[GpuInfo, ...] = ()
    source: str = "none"  # where the GPU list came from: nvml, nvidia-smi, recorded, none
    cuda_visible_devices: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def unfit_gpus(self, wanted: int | None, *, min_free_fraction: float = 0.0) -> list[str]:
        """Each problem of the GPUs a job will use here (the first ``wanted`` the job sees; None:
        all), naming the host, the GPU's index and UUID, and what was found."""
        chosen = self.gpus if wanted is None else self.gpus[:wanted]
        return [f"{self.hostname}: {g.label()}: {problem}" for g in chosen for problem in g.unfit(min_free_fraction)]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NodeInventory":
        gpus = tuple(GpuInfo(**{**g, "health": tuple(g.get("health", ()))}) for g in data.get("gpus", ()))
        return cls(
            hostname=data["hostname"],
            cpu_count=int(data["cpu_count"]),
            gpus=gpus,
            source=data.get("source", "none"),
            cuda_visible_devices=data.get("cuda_visible_devices"),
            notes=tuple(data.get("notes", ())),
        )


def _optional_int(text: str) -> int | None:
    text = text.strip()
    try:
        return int(float(text))
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def parse_nvidia_smi_csv(text: str) -> list[GpuInfo]:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total,memory.used,utilization.gpu,uuid
    --format=csv,noheader,nounits`` output."""
    gpus = []
    for row in csv.reader(io.StringIO(text)):
        if not row or not row[0].strip():
            continue
        if len(row) < 6:
            raise ValueError(f"unexpected nvidia-smi row: {row!r}")
        index, name, total, used, util, uuid = (cell.strip() for cell in row[:6])
        gpus.append(
            GpuInfo(
                index=int(index),
                physical_index=int(index),
                name=name,
                memory_total_mib=_optional_int(total) or 0,
                memory_used_mib=_optional_int(used),
                utilization_pct=_optional_int(util),
                uuid=uuid,
            )
        )
    return gpus


def apply_visible_devices(gpus: list[GpuInfo], visible: str | None) -> list[GpuInfo]:
    """Keep and renumber the GPUs that ``CUDA_VISIBLE_DEVICES`` exposes, as CUDA does.

    Entries are indices or (prefixes of) UUIDs; CUDA stops at the first entry it cannot match.
    A MIG device (``MIG-<uuid>``) is not in nvidia-smi's GPU list: it is kept as a GPU whose
    details are unknown, so that it is planned on rather than silently replaced by the CPU.
    """
    if visible is None:
        return gpus
    chosen: list[GpuInfo] = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry:
            break
        match = None
        if entry.startswith("MIG-"):
            match = GpuInfo(-1, -1, "MIG device", 0, None, None, entry)
        elif entry.lstrip("-").isdigit():
            match = next((g for g in gpus if g.physical_index == int(entry)), None)
        else:
            match = next((g for g in gpus if g.uuid.startswith(entry) or g.uuid == f"GPU-{entry}"), None)
        if match is None or match in chosen:
            break
        chosen.append(match)
    return [replace(g, index=i) for i, g in enumerate(chosen)]


def usable_cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_nvidia_smi() -> str | None:
    """Raw nvidia-smi CSV, or None where there is no NVIDIA driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *NVIDIA_SMI_ARGS], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


# What NVIDIA's kernel driver leaves on a machine with its GPUs (a container given GPUs included;
# /dev/dxg: WSL2's GPU). Where none is there, neither NVML nor nvidia-smi can see a GPU, and loading
# NVML to be told so costs every launch on a CPU machine ~20-30 ms before its ranks start.
NVIDIA_DEVICE_NODES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg")


def nvidia_device_nodes() -> bool:
    """Whether this machine may have an NVIDIA GPU (anything but Linux: assumed it may)."""
    return not sys.platform.startswith("linux") or any(os.path.exists(p) for p in NVIDIA_DEVICE_NODES)


def gpus_from_nvml(inventory: NvmlInventory) -> list[GpuInfo]:
    """NVML's readings as this module's GpuInfo (physical numbering: CUDA_VISIBLE_DEVICES applies after)."""
    from launcher.hardware.nvml import health_problems

    return [
        GpuInfo(
            index=g.index,
            physical_index=g.index,
            name=g.name,
            memory_total_mib=g.memory_total_mib,
            memory_used_mib=g.memory_used_mib,
            utilization_pct=g.utilization_gpu_pct,
            uuid=g.uuid,
            memory_free_mib=g.memory_free_mib,
            health=tuple(health_problems(g)),
        )
        for g in inventory.gpus
    ]


def _physical_gpus(query: Callable[[], str | None] | None, nvml: Any | None, source: str, notes: list[str]) -> tuple[list[GpuInfo] | None, str]:
    """Every GPU of the node and where the list came from: NVML (in process, no subprocess to
    start) unless the caller hands nvidia-smi output, then nvidia-smi. None: no driver at all."""
    if query is None:
        if nvml is None and not nvidia_device_nodes():  # a machine without NVIDIA's driver: no NVML to load
            notes.append("no NVIDIA driver found (no /dev/nvidiactl, /proc/driver/nvidia or /dev/dxg)")
            return None, "none"
        from launcher.hardware.nvml import read_inventory

        inventory = read_inventory(nvml)
        if inventory is not None:
            return gpus_from_nvml(inventory), "nvml"
        query = run_nvidia_smi
    raw = query()
    if raw is None:
        notes.append("no NVIDIA driver found (nvidia-smi missing or failing)")
        return None, "none"
    try:
        return parse_nvidia_smi_csv(raw), source
    except ValueError as exc:
        notes.append(f"could not read nvidia-smi output: {exc}")
        return [], "none"


def discover(
    *,
    query: Callable[[], str | None] | None = None,
    env: dict[str, str] | None = None,
    source: str = "nvidia-smi",
    visible_override: str | None = None,
    nvml: Any | None = None,
) -> NodeInventory:
    """This node's inventory: from NVML (``nvml``: the pynvml module by default, or a
    ``RecordedNvml``), else from nvidia-smi. ``query`` returns nvidia-smi CSV instead (tests pass
    recorded output); ``source`` names what it gave.

    ``visible_override``: a ``CUDA_VISIBLE_DEVICES`` the job's own env sets for its processes;
    it replaces this process's, as it will for them.
    """
    env = dict(os.environ) if env is None else env
    visible = visible_override if visible_override is not None else env.get("CUDA_VISIBLE_DEVICES")
    notes: list[str] = []
    physical, source = _physical_gpus(query, nvml, source, notes)
    gpus: list[GpuInfo] = []
    if physical is not None:
        gpus = apply_visible_devices(physical, visible)
        if visible is not None:
            origin = "the job's env: " if visible_override is not None else ""
            notes.append(f"{origin}CUDA_VISIBLE_DEVICES={visible!r} exposes {len(gpus)} GPU(s)")
        if any(g.physical_index < 0 for g in gpus):
            notes.append("MIG devices are counted from CUDA_VISIBLE_DEVICES; their details are not queried")
    return NodeInventory(
        hostname=socket.gethostname(),
        cpu_count=usable_cpu_count(),
        gpus=tuple(gpus),
        source=source,
        cuda_visible_devices=visible,
        notes=tuple(notes),
    )


class InventoryFileError(ValueError):
    """A recorded node that cannot be read: the message says which file and what was expected."""


def load_inventory(path: str | Path, *, visible_override: str | None = None) -> NodeInventory:
    """A node recorded elsewhere, to plan for it from here (``launch JOB --dry-run --inventory
    FILE``): what ``launch devices --json`` writes (hostname, CPUs, GPUs), or an NVML recording
    (``python -m launcher.hardware.nvml --record``), which names no host and counts no CPUs: the
    file's stem and this machine's CPU count stand in for them, and the notes say so."""
    from launcher.hardware.nvml import RecordedNvml

    expected = "expected what `launch devices --json` or `python -m launcher.hardware.nvml --record` writes"
    where = Path(path)
    try:
        data = json.loads(where.read_text())
    except OSError as exc:
        raise InventoryFileError(f"--inventory {path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise InventoryFileError(f"--inventory {path}: not JSON ({exc}); {expected}") from None
    if isinstance(data, dict) and "nvml_recording" in data:
        seen = discover(nvml=RecordedNvml(data), env={}, visible_override=visible_override)
        note = f"recorded NVML ({where.name}): host named after the file; CPU count assumed to be this machine's ({seen.cpu_count})"
        return replace(seen, hostname=where.stem, source="recorded", notes=(*seen.notes, note))
    if isinstance(data, dict) and {"hostname", "cpu_count"} <= set(data):
        try:
            recorded = NodeInventory.from_dict(data)
        except (TypeError, ValueError, KeyError) as exc:
            raise InventoryFileError(f"--inventory {path}: {type(exc).__name__}: {exc}; {expected}") from None
        gpus = apply_visible_devices(list(recorded.gpus), visible_override) if visible_override is not None else list(recorded.gpus)
        return replace(recorded, gpus=tuple(gpus), notes=(*recorded.notes, f"recorded inventory ({where.name})"))
    raise InventoryFileError(f"--inventory {path}: neither a device list nor an NVML recording; {expected}")


# --- d2l helpers --------------------------------------------------------------------------------


def cpu() -> "torch.device":
    """The CPU device (d2l ``cpu()``)."""
    import torch

    return torch.device("cpu")


def gpu(i: int = 0) -> "torch.device":
    """The i-th GPU device (d2l ``gpu(i)``); it need not exist yet."""
    import torch

    return torch.device(f"cuda:{i}")


def num_gpus() -> int:
    """How many GPUs torch can use (d2l ``num_gpus()``)."""
    import torch

    return torch.cuda.device_count()


def try_gpu(i: int = 0) -> "torch.device":
    """GPU i if it exists, else the CPU (d2l ``try_gpu(i)``)."""
    return gpu(i) if num_gpus() >= i + 1 else cpu()


def try_all_gpus() -> list["torch.device"]:
    """Every GPU, or ``[cpu()]`` when there is none (d2l ``try_all_gpus()``)."""
    return [gpu(i) for i in range(num_gpus())] or [cpu()]


if __name__ == "__main__":  # used by remote preflight: `python -m launcher.hardware.devices`
    print(discover().to_json())
