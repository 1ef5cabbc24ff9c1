"""Small helpers shared by the d2l "GPUs" workloads: parameters, clocks, sync counters, plots.

Everything here is imported inside the ranks (``run``), by the launcher before it spawns anything
(to check ``params`` against a workload's ``Params``) and at the end of a run (``summarize`` /
``plot``); torch and matplotlib are imported lazily so that those stay cheap.
"""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from statistics import median
from typing import Annotated, Any, Callable, Iterator, Literal, Mapping

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator

from launcher.validation import Real

# Tensor methods that hand a tensor's values to Python or to host memory: on a GPU every one of
# them waits for the device (a host synchronisation); on the CPU they are plain reads.
HOST_READS = frozenset({"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "__complex__"})
HOST_COPIES = frozenset({"cpu", "to", "copy_"})
SYNC_WARNING = "synchronizing CUDA operation"


class WorkloadParams(BaseModel):
    """A workload's ``params``, checked by the launcher before anything is spawned (unknown keys
    and wrong types exit 2 with the spec's file and line) and read by the ranks with defaults;
    ``null`` means the default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # `--set params.steps=null`, or a spec unsetting what the file it extends set
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, Mapping) else data


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _distinct(values: tuple[Any, ...]) -> tuple[Any, ...]:
    if len(set(values)) != len(values):
        raise ValueError("expected each size once")  # a repeated size would be timed, and counted, twice
    return values


Count = Annotated[StrictInt, Field(ge=1)]
NonNegative = Annotated[StrictInt, Field(ge=0)]
Positive = Annotated[Real, Field(gt=0)]
# `sizes: 64` means `sizes: [64]`
Sizes = Annotated[tuple[Count, ...], BeforeValidator(_as_list), Field(min_length=1), AfterValidator(_distinct)]
PositiveSizes = Annotated[tuple[Positive, ...], BeforeValidator(_as_list), Field(min_length=1), AfterValidator(_distinct)]
DtypeName = Literal["float16", "bfloat16", "float32", "float64"]


def torch_dtype(name: DtypeName) -> Any:
    import torch

    return getattr(torch, name)


def sync(device: Any) -> None:
    """Wait for the device (no-op on the CPU, where every op is synchronous)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


@contextmanager
def wall_clock(device: Any) -> Iterator[Callable[[], float]]:
    """Host wall time of a block, with the device drained before and after: ``with ... as ms: ...; ms()``."""
    sync(device)
    t0 = time.perf_counter()
    out: list[float] = []
    yield lambda: out[0]
    sync(device)
    out.append((time.perf_counter() - t0) * 1e3)


def med(values: list[float] | None) -> float | None:
    values = [v for v in values or [] if v is not None]
    return float(median(values)) if values else None


def rnd(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(float(value), digits)


def ok_ranks(stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for s in stages if s["status"] == "succeeded" for r in s["ranks"] if r.get("status") == "ok"]


class SyncCounter:
    """Counts what a block of code makes the host wait for, per phase (e.g. "loop", "end").

    ``host_reads``: tensor values handed to Python or copied from a device to host memory
    (``.item()``, ``.tolist()``, ``float(t)``, ``.cpu()`` of a CUDA tensor, ...), counted by a
    ``TorchFunctionMode`` on every device. ``device_syncs``: on CUDA only, the synchronisations
    PyTorch itself reports under ``torch.cuda.set_sync_debug_mode("warn")``; ``None`` on the CPU,
    where there is no device to wait for.
    """

    def __init__(self, device: Any) -> None:
        self.device = device
        self.host_reads: dict[str, int] = {}
        self.device_syncs: dict[str, int] | None = {} if device.type == "cuda" else None
        self.phase = "loop"

    @contextmanager
    def counting(self, phase: str) -> Iterator["SyncCounter"]:
        import torch
        from torch.overrides import TorchFunctionMode

        counter = self
        self.phase = phase
        self.host_reads.setdefault(phase, 0)

        class _Reads(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if name in HOST_READS or (name in HOST_COPIES and _device_to_host(name, args, kwargs)):
                    counter.host_reads[counter.phase] += 1
                return func(*args, **kwargs)

        cuda = self.device_syncs is not None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            previous = torch.cuda.get_sync_debug_mode() if cuda else 0
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with _Reads():
                    yield self
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(previous)
        if self.device_syncs is not None:
            syncs = sum(SYNC_WARNING in str(w.message) for w in caught)
            self.device_syncs[phase] = self.device_syncs.get(phase, 0) + syncs
        for w in caught:  # give back the warnings that were not ours
            if SYNC_WARNING not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _device_to_host(name: str, args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Is this ``cpu``/``to``/``copy_`` call a copy from a device into host memory?"""
    import torch

    if not args or not isinstance(args[0], torch.Tensor):
        return False
    if name == "copy_":
        dst, src = args[0], (args[1] if len(args) > 1 else kwargs.get("src"))
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"
    if args[0].device.type == "cpu":
        return False
    if name == "cpu":
        return True
    targets = [a for a in (*args[1:], kwargs.get("device")) if a is not None]
    return any(
        (isinstance(t, torch.Tensor) and t.device.type == "cpu") or (isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu")
        for t in targets
        if isinstance(t, (str, torch.device, torch.Tensor))
    )


def host_barrier_group(dist: Any, ctx: Any) -> Any:
    """A gloo group for barriers around host-side measurements (``None``: the default group).

    A rank waiting in an NCCL barrier may spin a CPU core; one waiting in gloo sleeps in a socket
    read, so ranks that wait while another times the CPU or the host's memory leave it alone.
    """
    return dist.new_group(backend="gloo") if ctx.pg_backend != "gloo" else None


def device_name(device: Any) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return "cpu"


def save_figure(fig: Any, run_dir: Path, name: str) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(run_dir) / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def devices_label(result: Mapping[str, Any]) -> str:
    devices = sorted({r.get("device", "?") for r in result.get("ranks", []) if r.get("status") == "ok"})
    return ", ".join(devices) or "?"
