"""The on-device metrics recorder: d2l's "keep the logs on the device, move them once".

Inside the step loop nothing here synchronises with the device or calls ``.item()``:
``log`` keeps a copy of the (0-d) tensor made where it lies (queued on the device, so an
accumulator updated in place later still logs the value it had), ``timer`` records CUDA events
on the current stream (host clocks on the CPU, where work is synchronous anyway) and ``step``
bumps a host integer and stores it into the rank's step counter (``launcher.runtime.stepcount``:
a plain store into a shared mapping, which its host reads after the rank is gone). ``to_host``
at the end does one synchronisation and one device-to-host copy (one per device where values
were logged on more than one, see ``log``).
"""

from __future__ import annotations

import numbers
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator

from launcher.runtime.workclock import WorkClock

if TYPE_CHECKING:
    import torch

    from launcher.runtime.stepcount import StepCounter


class _CountingWorkClock(WorkClock):
    """The work clock, whose count of a DDP job's optimizer steps also goes into the step counter
    while the job counts none itself (a torchrun script): the counter holds what the beacon says."""

    def __init__(self, use_events: bool, counted: Callable[[], int], cell: Any) -> None:
        super().__init__(use_events=use_events)
        self._counted = counted
        self._cell = cell

    def count_optimizer_step(self) -> None:
        super().count_optimizer_step()
        if not self._counted():
            self._cell[0] = self.optimizer_steps


class MetricsRecorder:
    def __init__(self, device: "torch.device", *, on_first_step: Callable[[], object] | None = None, step_counter: "StepCounter | None" = None) -> None:
        self.device = device
        self.steps = 0
        # where step() stores its count: the rank's counter file's mapping, or 8 bytes of our own
        # (no counter: the store costs the same and needs no test)
        self.step_counter = step_counter
        self._cell: Any = step_counter.cell if step_counter is not None else memoryview(bytearray(8)).cast("q")
        self._on_first_step = on_first_step
        self._tensors: dict[str, list["torch.Tensor"]] = {}
        self._numbers: dict[str, list[float]] = {}
        self._events: dict[str, list[tuple[Any, Any]]] = {}
        self._host_times_ms: dict[str, list[float]] = {}
        self._step_hooks: list[Callable[[int, float], None]] = []
        self._last_step_t = time.perf_counter()
        self._use_events = device.type == "cuda"
        # own work per step apart from waiting for peers (straggler detection): DDP's hook or ``work()``
        self.work_clock: WorkClock = _CountingWorkClock(self._use_events, lambda: self.steps, self._cell)

    # --- inside the loop: no host sync -----------------------------------------------------------
    def log(self, name: str, value: "torch.Tensor | float | int") -> None:
        """Keep a value: a real number (``float``, ``int``, numpy scalars) on the host; a one-element
        tensor as a copy, never a view, with no host sync:

        - on the recorder's device (the usual case): ``clone()``, queued on the device;
        - on another GPU while the recorder is on one: copied to the recorder's device
          (``non_blocking``: a device-to-device copy the streams order, the host does not wait);
        - across the host/device boundary (a CPU tensor logged by a GPU rank, or the reverse):
          cloned where it lies. A host-to-device copy of a pageable tensor would not be free here:
          CUDA makes the host wait for the stream before copying pageable memory (``non_blocking``
          or not; sync debug mode does not see it), and pinning it first costs a pinned allocation
          per value. ``to_host`` copies each device's values once at the end instead.
        """
        if isinstance(value, (int, float, numbers.Real)):
            self._numbers.setdefault(name, []).append(float(value))
            return
        kept = value.detach().reshape(())
        if kept.device != self.device and kept.device.type == self.device.type == "cuda":
            kept = kept.to(self.device, non_blocking=True)  # a new tensor: a copy, not a view
        else:
            kept = kept.clone()
        self._tensors.setdefault(name, []).append(kept)

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

    def work(self) -> ContextManager[None]:
        """Mark a block of this rank's own work (no collective inside) for straggler detection:
        ``with ctx.metrics.work(): loss = step(batch)``. A step's blocks (up to ``step()``) add up to
        its own work. DDP models need none of this: the runtime times them itself (workclock)."""
        return self.work_clock.section()

    def resume_count(self, steps: int) -> None:
        """Go on counting from ``steps``: a rank that replaced a lost one in place took over its
        peers' count with their state (``launcher.runtime.inplace``); its step counter says so too."""
        self.steps = steps
        self._cell[0] = steps

    def add_time_ms(self, name: str, ms: float) -> None:
        """Record a duration measured elsewhere (e.g. a host clock around synchronised work)."""
        self._host_times_ms.setdefault(name, []).append(float(ms))

    def step(self) -> None:
        """Count a step: a host integer, never a device sync (the progress display reads it), also
        stored into the rank's step counter (a plain store into a mapping: no system call)."""
        steps = self.steps = self.steps + 1
        self._cell[0] = steps
        if self.work_clock.uses_sections:  # else it has nothing to close (DDP's hooks time the step)
            self.work_clock.step()
        now = time.perf_counter()
        if steps == 1 and self._on_first_step is not None:
            self._on_first_step()
        for hook in self._step_hooks:
            hook(steps, now - self._last_step_t)
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

            # one stack and one copy to the host per device the values lie on (one in the usual case)
            kept = [(name, t) for name, ts in self._tensors.items() for t in ts]
            by_device: dict[Any, list[int]] = {}
            for i, (_, t) in enumerate(kept):
                by_device.setdefault(t.device, []).append(i)
            host: list[float] = [0.0] * len(kept)
            for indices in by_device.values():
                copied = torch.stack([kept[i][1].to(torch.float64) for i in indices]).cpu().tolist()
                for i, v in zip(indices, copied):
                    host[i] = v
            for (name, _), v in zip(kept, host):
                values.setdefault(name, []).append(v)
        if self._events:
            import torch

            torch.cuda.synchronize(self.device)
            for name, pairs in self._events.items():
                times.setdefault(name, []).extend(start.elapsed_time(end) for start, end in pairs)
        return {"steps": self.steps, "values": values, "times_ms": times}
