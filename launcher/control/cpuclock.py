"""The launcher's own CPU seconds (user + system of this process and its threads; not the agents,
ranks or anything else it starts), split by the phases of a run, for ``result.json``'s
``phases.launcher_cpu_s``.

What it guards is the launcher's cost around the user's work: ``before_spawn`` (from the
process's start to the first agent or rank spawned: the interpreter, the imports, the spec, the
preflight, the plan) and ``after_exit`` (from the last stage's processes' exit to the result about
to be written: collecting, aggregating, the summary, plots). CPU seconds, not wall time: on a shared
machine they barely move with the load, so a budget on them can be tight
(``benchmarks/launcher_cpu.py`` holds a no-op run to one, naming the phase that grew).

One clock per run, begun by ``run_job``; the run loop marks the stage's phases on the same clock.
"""

from __future__ import annotations

import resource
import threading
from typing import Any

# Phases in the order a run meets them (a phase seen again, say a second stage's, adds to its sum)
BEFORE_SPAWN = ("start", "preflight", "run_dir", "metrics", "session", "plan", "spawn")
AFTER_EXIT = ("stage_end", "results")


def cpu_s() -> float:
    """This process's CPU seconds so far, every thread's, user + system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuPhases:
    """CPU seconds by phase: ``mark(name)`` charges what was spent since the previous mark to
    ``name``. The first mark's phase includes everything since the process started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0.0  # from the process's start: the interpreter and the imports are the launcher's too
        self._spent: dict[str, float] = {}
        self.spawned_at: float | None = None  # the CPU clock when the first agent (or rank) was spawned
        self.exited_at: float | None = None  # ... when the last stage's processes had all exited

    def mark(self, phase: str) -> None:
        now = cpu_s()
        with self._lock:
            self._spent[phase] = self._spent.get(phase, 0.0) + now - self._last
            self._last = now
            if phase == "spawn" and self.spawned_at is None:
                self.spawned_at = now
            if phase == "running":
                self.exited_at = now

    def record(self) -> dict[str, Any]:
        """What ``result.json`` keeps: ``before_spawn``, ``after_exit``, ``total`` and ``by_phase``
        (seconds, rounded to the millisecond). Marks ``results`` first: everything up to now since
        the stage ended is the results' (what follows, writing the file and exiting, is not counted)."""
        self.mark("results")
        with self._lock:
            total = self._last
            before = self.spawned_at
            after = total - self.exited_at if self.exited_at is not None else None
            spent = dict(self._spent)
        return {
            "before_spawn": _ms(before),
            "after_exit": _ms(after),
            "total": _ms(total),
            "by_phase": {name: _ms(s) for name, s in spent.items()},
        }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


_clock = CpuPhases()


def begin() -> CpuPhases:
    """A run's clock (``run_job`` begins one; ``start`` is what the process spent until now)."""
    global _clock
    _clock = CpuPhases()
    _clock.mark("start")
    return _clock


def mark(phase: str) -> None:
    """Charge the CPU since the last mark to ``phase`` on the current run's clock."""
    _clock.mark(phase)


def record() -> dict[str, Any]:
    """The current run's ``launcher_cpu_s`` (``CpuPhases.record``)."""
    return _clock.record()
