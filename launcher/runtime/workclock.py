"""A rank's own work per step, apart from the time it waits for its peers in collectives.

In synchronous DDP every rank steps at the pace of the slowest, so step times cannot name the
straggler; the time a rank spends on its own work can. Two sources feed one :class:`WorkClock`:

- **DDP, with no change to the job's code.** :func:`install_ddp_timing` wraps
  ``DistributedDataParallel`` so that every model gets a communication hook (the job's own hook, if
  it registers one, is wrapped, not replaced). The hook marks when the *last* gradient bucket of a
  backward is ready (this rank's forward and backward are done) and, through the all-reduce's
  future, when that bucket's all-reduce completed (every rank is done). A step's own work is the
  time from the previous step's completed all-reduce to this step's last ready bucket: data
  loading, optimizer step, forward and backward, but not the wait for the others.
- **Jobs that call collectives themselves** wrap their compute in ``with ctx.metrics.work():``;
  the sections of one step (up to ``ctx.metrics.step()``) add up to its own work. When a job uses
  sections, they win over the DDP hook.

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
        self._last_done: _Mark | None = None  # the previous step's completed all-reduce

    # --- DDP hook side ----------------------------------------------------------------------------
    def backward_ready(self) -> None:
        """The last gradient bucket of a backward is ready: this rank's own work is done."""
        if self.uses_sections:
            return
        ready = _Mark(self.use_events)
        with self._lock:
            if self._last_done is not None:  # the first step has no start: it is not measured
                self._pending.append(((self._last_done, ready),))
                self._last_done = None
        self._drain()

    def allreduce_done(self) -> None:
        """The last bucket's all-reduce completed: every rank is done with this step."""
        mark = _Mark(self.use_events)
        with self._lock:
            self._last_done = mark

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
    """Give every ``DistributedDataParallel`` model built from now on a timing communication hook;
    returns the function that undoes it. The hook is registered at the model's first forward, so
    a job that registers its own hook first gets it wrapped instead (a built-in C++ hook cannot be
    wrapped: such a model is not timed)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    originals = {name: DDP.__dict__[name] for name in (*_BUILTIN_HOOKS, "forward", "register_comm_hook") if name in DDP.__dict__}
    original_forward, original_register = originals["forward"], originals["register_comm_hook"]

    def register_comm_hook(self: Any, state: object, hook: Callable[..., Any]) -> None:
        self._gpulaunch_timed = True
        original_register(self, state, _timed(clock, hook))

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_gpulaunch_timed", False):
            self._gpulaunch_timed = True
            # state = the model's own group: what DDP's built-in all-reduce would use
            original_register(self, self.process_group, _timed(clock, None))
        return original_forward(self, *args, **kwargs)

    patched: dict[str, Any] = {"forward": forward, "register_comm_hook": register_comm_hook}
    for name in _BUILTIN_HOOKS:
        if name in originals:
            patched[name] = _untimed(originals[name])
    for name, function in patched.items():
        setattr(DDP, name, function)

    def undo() -> None:
        for name, function in originals.items():
            setattr(DDP, name, function)

    return undo


# DDP's ways to install a C++ hook (the name has changed across torch versions)
_BUILTIN_HOOKS = ("register_builtin_comm_hook", "_register_builtin_comm_hook")


def _untimed(register_builtin: Callable[..., Any]) -> Callable[..., Any]:
    def register(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._gpulaunch_timed = True  # a C++ hook: nothing to wrap, the model is not timed
        return register_builtin(self, *args, **kwargs)

    return register


def _timed(clock: WorkClock, inner: Callable[..., Any] | None) -> Callable[..., Any]:
    """A comm hook that marks the last bucket's readiness and its all-reduce's completion around
    ``inner`` (the job's own hook, or DDP's default all-reduce when the job has none)."""

    # no annotations: DDP checks a hook's (they must be GradBucket / Future, not strings)
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        last = bucket.is_last()
        if last:
            clock.backward_ready()
        if inner is not None:
            fut = inner(state, bucket)
        else:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            fut = allreduce_hook(state, bucket)  # DDP's own default: the same maths as no hook
        if not last:
            return fut

        def done(f: Any) -> Any:
            clock.allreduce_done()
            return f.value()

        return fut.then(done)

    return hook
