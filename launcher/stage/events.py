"""What a stage's ranks tell the run loop while they run: typed events, from every rank on every host.

An engine delivers them through its own channel (the agent's output forwarded from a local pipe,
an SSH session or an srun step; a Ray actor's output drain) into the stage's ``EventQueue``; the
run loop, the console's progress line, ``/metrics``, straggler detection and root-cause dating
read nothing else. Standard library and the rank contract only.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Union

from launcher.protocol import RankProgress, RankReport
from launcher.records import RankExit


@dataclass(slots=True)
class RankBeacon:
    """A rank's latest sign of life: phase, host step count, own work per step, pid."""

    rank: int
    beacon: RankProgress
    host: str | None = None  # where it runs, when the plan could not say (a scheduler placed it)
    received: float = field(default_factory=time.time)  # when the launcher got it (the beacon's latency)


@dataclass(frozen=True)
class RankReported:
    """A rank's report: how it ended, its phases, metrics and error (with traceback)."""

    report: RankReport


@dataclass(frozen=True)
class RankExited:
    """What the process layer saw of a rank that ended badly (exit code, signal, OOM kill)."""

    exit: RankExit


@dataclass(frozen=True)
class RanksLost:
    """Ranks that went with their host (a lost SSH host or Slurm node, a Ray actor that died):
    each one that has not reported fails with ``error_type``, dated ``at`` or, where that is None,
    by its own last beacon (its last sign of life), so that the root cause is the loss and not a
    peer that lost its connection to it."""

    ranks: tuple[int, ...]
    host: str
    error_type: str
    message: str
    traceback: str = ""
    at: float | None = None


StageEvent = Union[RankBeacon, RankReported, RankExited, RanksLost]


class EventQueue:
    """Thread-safe: channels put events as they arrive, the run loop takes them in order."""

    def __init__(self) -> None:
        self._items: deque[StageEvent] = deque()
        self._cond = threading.Condition()

    def put(self, event: StageEvent) -> None:
        with self._cond:
            self._items.append(event)
            self._cond.notify()

    def put_all(self, events: list[StageEvent]) -> None:
        if events:
            with self._cond:
                self._items.extend(events)
                self._cond.notify()

    def take(self, timeout_s: float = 0.0) -> list[StageEvent]:
        """Every event so far, waiting up to ``timeout_s`` for the first one."""
        with self._cond:
            if not self._items and timeout_s > 0:
                self._cond.wait(timeout_s)
            items = list(self._items)
            self._items.clear()
        return items
