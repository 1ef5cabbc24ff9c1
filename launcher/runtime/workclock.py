"""A rank's own work per step, apart from the time it waits for its peers in collectives.

In synchronous DDP every rank steps at the pace of the slowest, so step times cannot name the
straggler; the time a rank spends on its own work can. Two sources feed one :class:`WorkClock`:

- **DDP, with no change to the job's code.** :func:`install_ddp_timing` makes every
  ``DistributedDataParallel`` model register, at its first forward, a post-accumulate-grad hook on
  each of its parameters (the last one to fire in a backward marks this rank's gradients ready:
  its forward and backward are done), and adds one global optimizer step pre-hook (``step()``
  starts once ``backward()`` returned, that is once the all-reduce of every bucket completed:
  every rank is done). A step's own work is the time from the previous ``optimizer.step()`` to
  this step's last ready gradient: optimizer, data loading, forward and backward, but not the
  wait for the others. DDP's communication is left alone: a Python comm hook would cost 1.17x a
  small CPU step, these hooks 1.015x, within the noise (benchmarks/straggler_overhead.py).
- **Jobs that call collectives themselves** wrap their compute in ``with ctx.metrics.work():``;
  the sections of one step (up to ``ctx.metrics.step()``) add up to its own work. When a job uses
  sections, they win over the DDP hooks.

Never a device sync: on the CPU the host clock is the truth (the work is synchronous); on a GPU
each mark is a CUDA event recorded on the current stream, and a pair is read only once
``Event.query()`` says both have happened (later steps read earlier pairs).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator

RECENT_STEPS = 20  # the recent mean is over this many steps: a few seconds of a typical job


class _Mark:
    """One point in time: a host clock reading, or a CUDA event on the current stream."""

    __slots__ = ("t", "event")

    def __init__(self, use_events: bool) -> None:
        self.t = time.perf_counter()
        self.event: Any = None
        if use_events:
            import torch

            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def seconds_until(self, later: "_Mark") -> float:
        if self.event is not None and later.event is not None:
            return self.event.elapsed_time(later.event) / 1e3
        return later.t - self.t


_Pairs = tuple[tuple[_Mark, _Mark], ...]  # the (start, end) spans of one step's own work


class WorkClock:
    """Own-work seconds of recent steps; ``recent_mean()`` is what the progress beacon reports."""

    def __init__(self, use_events: bool = False, recent_steps: int = RECENT_STEPS) -> None:
        self.use_events = use_events
        self._lock = threading.Lock()  # DDP's future callbacks run on the process group's thread
        self._recent: deque[float] = deque(maxlen=recent_steps)
        self._pending: deque[_Pairs] = deque()  # steps whose marks the device has not reached yet
        self._sections: list[tuple[_Mark, _Mark]] = []  # this step's ``work()`` sections so far
        self.uses_sections = False
        self._last_step: _Mark | None = None  # the previous optimizer step's start
        self._ready: _Mark | None = None  # this step's last gradient so far
        self._grads = 0  # gradients accumulated since the last optimizer step
        self._grads_per_step = 1  # learnt from the previous step (1 until then: mark every one)

    # --- DDP side -----------------------------------------------------------------------------------
    def gradient_ready(self) -> None:
        """A parameter's gradient was accumulated. The last of a backward (as many as the step
        before had: only that one records a CUDA event) marks this rank's own work done."""
        if self.uses_sections:
            return
        self._grads += 1
        if self._grads >= self._grads_per_step:
            self._ready = _Mark(self.use_events)

    def optimizer_step(self) -> None:
        """An optimizer's ``step()`` starts: the backward, the wait for the peers included, is over."""
        if self.uses_sections:
            return
        now = _Mark(self.use_events)
        with self._lock:
            if self._ready is not None and self._last_step is not None:  # the first step has no start
                self._pending.append(((self._last_step, self._ready),))
            if self._grads:
                self._grads_per_step = self._grads
            self._grads, self._ready, self._last_step = 0, None, now
        self._drain()

    # --- ``ctx.metrics.work()`` side -------------------------------------------------------------
    @contextmanager
    def section(self) -> Iterator[None]:
        """Time a block of this rank's own work (no collective inside)."""
        self.uses_sections = True
        start = _Mark(self.use_events)
        try:
            yield
        finally:
            self._sections.append((start, _Mark(self.use_events)))

    def step(self) -> None:
        """A step ended (``ctx.metrics.step()``): its sections, if any, make one sample."""
        if not self._sections:
            return
        with self._lock:
            self._pending.append(tuple(self._sections))
        self._sections = []
        self._drain()

    # --- reading ----------------------------------------------------------------------------------
    def _drain(self) -> None:
        """Move every readable step into the recent window (never waits on a device)."""
        with self._lock:
            while self._pending and all(a.ready() and b.ready() for a, b in self._pending[0]):
                pairs = self._pending.popleft()
                self._recent.append(sum(a.seconds_until(b) for a, b in pairs))

    def recent_mean(self) -> float | None:
        self._drain()
        with self._lock:
            return sum(self._recent) / len(self._recent) if self._recent else None


# --- DDP, with no change to the job's code ---------------------------------------------------------


def install_ddp_timing(clock: WorkClock) -> Callable[[], None]:
    """Time every ``DistributedDataParallel`` model used from now on (see the module's doc);
    returns the function that undoes it (the hooks already on a model's parameters stay, and
    stay cheap)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        raise AttributeError("torch.Tensor.register_post_accumulate_grad_hook (torch >= 2.1)")
    original_forward = DDP.__dict__["forward"]

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_gpulaunch_timed", False):
            self._gpulaunch_timed = True
            for param in self.module.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(lambda _param: clock.gradient_ready())
        return original_forward(self, *args, **kwargs)

    DDP.forward = forward
    step_hook = register_optimizer_step_pre_hook(lambda _optimizer, _args, _kwargs: clock.optimizer_step())

    def undo() -> None:
        DDP.forward = original_forward
        step_hook.remove()

    return undo
