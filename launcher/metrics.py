"""The on-device metrics recorder: d2l's "keep the logs on the device, move them once".

Inside the step loop nothing here synchronises with the device or calls ``.item()``:
``log`` keeps a reference to the (0-d) tensor, ``timer`` records CUDA events on the current
stream (host clocks on the CPU, where work is synchronous anyway) and ``step`` bumps a host
integer. ``to_host`` at the end does one synchronisation and one device-to-host copy.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import torch


class MetricsRecorder:
    def __init__(self, device: "torch.device", *, on_first_step: Callable[[], None] | None = None) -> None:
        self.device = device
        self.steps = 0
        self._on_first_step = on_first_step
        self._tensors: dict[str, list["torch.Tensor"]] = {}
        self._numbers: dict[str, list[float]] = {}
        self._events: dict[str, list[tuple[Any, Any]]] = {}
        self._host_times_ms: dict[str, list[float]] = {}
        self._step_hooks: list[Callable[[int, float], None]] = []
        self._last_step_t = time.perf_counter()
        self._use_events = device.type == "cuda"

    # --- inside the loop: no host sync -----------------------------------------------------------
    def log(self, name: str, value: "torch.Tensor | float | int") -> None:
        """Keep a value. Tensors stay where they are (no copy, no sync); numbers stay on the host."""
        if isinstance(value, (int, float)):
            self._numbers.setdefault(name, []).append(float(value))
        else:
            self._tensors.setdefault(name, []).append(value.detach().reshape(()))

    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        """Time a block: CUDA events on the GPU (read at the end), a host clock on the CPU."""
        if self._use_events:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.setdefault(name, []).append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._host_times_ms.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)

    def add_time_ms(self, name: str, ms: float) -> None:
        """Record a duration measured elsewhere (e.g. a host clock around synchronised work)."""
        self._host_times_ms.setdefault(name, []).append(float(ms))

    def step(self) -> None:
        """Count a step: a host integer, never a device sync (the progress display reads it)."""
        self.steps += 1
        now = time.perf_counter()
        if self.steps == 1 and self._on_first_step is not None:
            self._on_first_step()
        for hook in self._step_hooks:
            hook(self.steps, now - self._last_step_t)
        self._last_step_t = now

    def add_step_hook(self, hook: Callable[[int, float], None]) -> None:
        """Call ``hook(steps, host_seconds_since_last_step)`` on every step (e.g. Ray metrics)."""
        self._step_hooks.append(hook)

    # --- at the end: one sync, one copy -----------------------------------------------------------
    def to_host(self) -> dict[str, Any]:
        """Everything recorded, as plain Python data; one device sync and one copy in all."""
        values: dict[str, list[float]] = {k: list(v) for k, v in self._numbers.items()}
        times = {k: list(v) for k, v in self._host_times_ms.items()}
        if self._tensors:
            import torch

            names = list(self._tensors)
            flat = torch.cat([torch.stack([t.to(torch.float64) for t in self._tensors[n]]) for n in names]).cpu()
            offset = 0
            for name in names:
                count = len(self._tensors[name])
                values.setdefault(name, []).extend(flat[offset : offset + count].tolist())
                offset += count
        if self._events:
            import torch

            torch.cuda.synchronize(self.device)
            for name, pairs in self._events.items():
                times.setdefault(name, []).extend(start.elapsed_time(end) for start, end in pairs)
        return {"steps": self.steps, "values": values, "times_ms": times}
