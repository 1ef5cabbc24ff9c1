"""Counting what a block of code makes the host wait for: values read back from a tensor, and on
CUDA the synchronisations PyTorch itself reports (the d2l chapter's "per-step ``.item()`` stalls the
GPU", measured rather than asserted)."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

# Tensor methods that hand a tensor's values to Python or to host memory: on a GPU every one of
# them waits for the device (a host synchronisation); on the CPU they are plain reads.
HOST_READS = frozenset({"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "__complex__"})


HOST_COPIES = frozenset({"cpu", "to", "copy_"})


SYNC_WARNING = "synchronizing CUDA operation"


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
            def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
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


def _device_to_host(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
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
