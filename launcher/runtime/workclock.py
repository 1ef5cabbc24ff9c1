"""A rank's own work per step, apart from the time it waits for its peers in collectives.

In synchronous DDP every rank steps at the pace of the slowest, so step times cannot name the
straggler; the time a rank spends on its own work can. Two sources feed one :class:`WorkClock`:

- **DDP, with no change to the job's code.** :func:`install_ddp_timing` makes every
  ``DistributedDataParallel`` model, at its first forward, put a post-accumulate-grad hook on its
  parameters and a forward pre-hook on the module it wraps, and adds one global optimizer step
  pre-hook. Own work of a step = from the previous ``optimizer.step()`` to DDP's forward (data
  loading, ...), plus from the wrapped module's forward to the end of backward's compute (the
  first gradient hook of a backward queues an autograd final callback, which runs before the one
  DDP queues later to wait for the all-reduces). Left out: DDP's buffer broadcast before the
  forward and its wait for the all-reduces after the backward, the two places a rank waits for
  slower peers. DDP's communication itself is left alone: a Python comm hook would cost 1.16x a
  small CPU step, these hooks 0.99x, within the noise (benchmarks/straggler_overhead.py).
- **Jobs that call collectives themselves** wrap their compute in ``with ctx.metrics.work():``;
  the sections of one step (up to ``ctx.metrics.step()``) add up to its own work. When a job uses
  sections, they win over the DDP hooks.

Never a device sync: on the CPU the host clock is the truth (the work is synchronous); on a GPU
each mark is a CUDA event recorded on the current stream, and a pair is read only once
``Event.query()`` says both have happened (later steps read earlier pairs).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator

RECENT_STEPS = 20  # the figure is the median of this many recent steps: one slow step (a checkpoint) moves it little
MAX_SECTIONS = 256  # work() blocks kept for one step; a job that never calls step() folds them into samples


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


def _never_raises(method: Callable[..., None]) -> Callable[..., None]:
    """Timing is best effort: any error (a CUDA event of another device, a sticky CUDA error)
    turns it off for the rest of the rank's life instead of reaching the job's backward() or
    optimizer.step(). During CUDA graph capture nothing is marked (an event recorded there could
    not be queried)."""

    def guarded(self: "WorkClock", *args: Any) -> None:
        if not self.enabled or (self.use_events and _capturing()):
            return
        try:
            method(self, *args)
        except Exception:  # noqa: BLE001 - see above
            self.enabled = False
            with self._lock:
                self._pending.clear()

    guarded.__doc__ = method.__doc__
    return guarded


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_current_stream_capturing())


class WorkClock:
    """Own-work seconds of recent steps. The hooks run on the training thread (and, for DDP's
    gradients, autograd's); readable samples are moved into the recent window there too, so that
    ``recent()``, which the progress beacon's thread calls, never touches a device."""

    def __init__(self, use_events: bool = False, recent_steps: int = RECENT_STEPS) -> None:
        self.use_events = use_events
        self.enabled = True
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=recent_steps)
        self._pending: deque[_Pairs] = deque()  # steps whose marks the device has not reached yet
        self._sections: list[tuple[_Mark, _Mark]] = []  # this step's ``work()`` sections so far
        self.uses_sections = False
        # DDP: the spans of own work of the step under way (see forward_entered / compute_started)
        self._started = False  # an optimizer step was seen: the steps after it are measured
        self.optimizer_steps = 0
        self._span_start: _Mark | None = None
        self._spans: list[tuple[_Mark, _Mark]] = []
        self._ready: _Mark | None = None  # where the last backward of this step ended
        self._backward_queued = False

    # --- DDP side ----------------------------------------------------------------------------------
    @_never_raises
    def forward_entered(self) -> None:
        """DDP's forward starts: own work pauses, DDP may wait for the peers (buffer broadcast)."""
        if self._span_start is not None and not self.uses_sections:
            self._spans.append((self._span_start, _Mark(self.use_events)))
            self._span_start = None

    @_never_raises
    def compute_started(self) -> None:
        """The wrapped module's own forward starts (after DDP's own synchronisation)."""
        if not self.uses_sections:
            self._span_start = _Mark(self.use_events)

    @_never_raises
    def gradient_ready(self) -> None:
        """A gradient was accumulated: at the end of this backward (autograd's final callback,
        queued before DDP's, which waits for the all-reduces) this rank's own work is done."""
        if self.uses_sections or self._backward_queued:
            return
        import torch

        self._backward_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    @_never_raises
    def _backward_done(self) -> None:
        self._backward_queued = False
        self._ready = _Mark(self.use_events)

    def count_optimizer_step(self) -> None:
        """Counted whether or not timing is still on: a DDP job's steps, where it counts none
        itself (a torchrun script), for the progress line and hang detection."""
        self.optimizer_steps += 1

    @_never_raises
    def optimizer_step(self) -> None:
        """An optimizer's ``step()`` starts: the backward, the wait for the peers included, is over."""
        if self.uses_sections:
            return
        now = _Mark(self.use_events)
        ready, start = self._ready, self._span_start
        if ready is not None and start is not None and ready.t >= start.t:
            self._spans.append((start, ready))
        if self._started and self._spans and ready is not None:
            with self._lock:
                self._pending.append(tuple(self._spans))
        self._started, self._spans, self._ready, self._span_start = True, [], None, now
        self._backward_queued = False  # a backward that failed never ran its callback
        self._drain()

    # --- ``ctx.metrics.work()`` side -------------------------------------------------------------
    @contextmanager
    def section(self) -> Iterator[None]:
        """Time a block of this rank's own work (no collective inside)."""
        self.uses_sections = True
        start = _Mark(self.use_events) if self.enabled else None
        try:
            yield
        finally:
            if start is not None and self.enabled:
                self._sections.append((start, _Mark(self.use_events)))
                if len(self._sections) >= MAX_SECTIONS:
                    self.step()

    @_never_raises
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

    def recent(self) -> float | None:
        """The median own work per step of the recent steps (None before the first); host data
        only: any thread may call it."""
        with self._lock:
            return statistics.median(self._recent) if self._recent else None

    def spread(self) -> tuple[float | None, int]:
        """How much the recent steps' own work varies (their median absolute deviation from
        the median), and how many steps the window holds: a figure from a full window that
        varies little is a rank's real pace; one that jumps about is the machine's noise."""
        with self._lock:
            window = list(self._recent)
        if not window:
            return None, 0
        median = statistics.median(window)
        return statistics.median(abs(x - median) for x in window), len(window)


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
            self.module.register_forward_pre_hook(lambda _module, _args: clock.compute_started())
        clock.forward_entered()
        return original_forward(self, *args, **kwargs)

    DDP.forward = forward  # type: ignore[method-assign]
    def on_optimizer_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        clock.count_optimizer_step()
        clock.optimizer_step()

    step_hook = register_optimizer_step_pre_hook(on_optimizer_step)

    def undo() -> None:
        DDP.forward = original_forward  # type: ignore[method-assign]
        step_hook.remove()

    return undo
