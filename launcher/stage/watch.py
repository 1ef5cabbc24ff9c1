"""What a run tells whoever watches it: the run loop (or a submitted run's follower) emits events,
a watcher shows or exports them.

The library never imports the terminal UI: ``run_job`` takes any ``RunEvents``; the CLI passes the
rich console (``launcher.ui.console.RunUI``), a notebook gets ``PlainEvents`` (rank lines and a
short summary as plain text), the launcher inside a cluster job forwards them over the remote-run
wire (``launcher.stage.wire``), and tests can pass ``RunEvents()`` to see nothing.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, TextIO

if TYPE_CHECKING:
    from launcher.results.store import RunResult


@dataclass(slots=True)
class RankLive:
    """One rank while its stage runs, from its latest beacon."""

    rank: int
    host: str
    phase: str
    steps: int
    beacon_t: float | None  # when the beacon was written (the rank's own clock)
    work_s: float | None = None  # own work per step apart from waiting for peers, median of recent steps
    straggler: bool = False  # flagged by the run loop's straggler watch
    work_mad_s: float | None = None  # how much those recent steps vary (median absolute deviation)
    work_n: int | None = None  # how many recent steps the figure covers (None: not said)


@dataclass(frozen=True)
class StageProgress:
    """A stage while it runs: every rank's latest beacon, as the run loop has them."""

    world_size: int
    elapsed_s: float
    ranks: tuple[RankLive, ...]
    restarts: int = 0
    phases: Mapping[str, int] = field(default_factory=dict)  # phase -> how many ranks are in it
    resumed_step: int | None = None  # the checkpoint step this attempt's job resumed from

    @property
    def steps_min(self) -> int:
        return min((r.steps for r in self.ranks), default=0)

    @property
    def steps_max(self) -> int:
        return max((r.steps for r in self.ranks), default=0)


def count_phases(ranks: tuple[RankLive, ...]) -> dict[str, int]:
    phases: dict[str, int] = {}
    for r in ranks:
        phases[r.phase] = phases.get(r.phase, 0) + 1
    return phases


class RunEvents:
    """Every event a run emits; each does nothing here. Watchers override what they show."""

    def note(self, text: str) -> None:
        """Something the plan decided that the spec did not say outright."""

    def message(self, text: str) -> None:
        """The launcher's own line during a stage (a restart, a port retry)."""

    def rank_output(self, source: str, text: str) -> None:
        """One line of a rank's (``host:rank``) or an agent's (``host:agent``) output."""

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        """A stage (one world size) is about to start."""

    def progress(self, progress: StageProgress) -> None:
        """Twice a second while a stage runs (from a submitted run: as often as its wire brings it)."""

    def stage_finished(self) -> None:
        """The stage ended (its outcome is in the run's result)."""

    def finished(self, result: RunResult) -> None:
        """The run ended; ``result.json`` is written."""


class PlainEvents(RunEvents):
    """Plain text for notebooks and logs: rank output as ``host:rank text`` and a short summary."""

    def __init__(self, stream: TextIO | None = None, *, echo_ranks: bool = True) -> None:
        self.stream = stream
        self.echo_ranks = echo_ranks
        self._lock = threading.Lock()

    def _print(self, text: str) -> None:
        with self._lock:
            print(text, file=self.stream or sys.stdout, flush=True)

    def note(self, text: str) -> None:
        self._print(f"note: {text}")

    def message(self, text: str) -> None:
        self._print(f"launcher: {text}")

    def rank_output(self, source: str, text: str) -> None:
        if self.echo_ranks:
            self._print(f"{source} {text}" if source else text)

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        self._print(f"{job}: world size {world_size} on {device_type} ({backend})")

    def finished(self, result: RunResult) -> None:
        failure = result.data.get("failure") or {}
        tail = f": {failure.get('summary')}" if failure else ""
        self._print(f"{result.data['job']}: {result.status}{tail}")
        self._print(f"result: {result.path}")


class TeeEvents(RunEvents):
    """Every event to each of several watchers, in order (the console, then the metrics)."""

    def __init__(self, *watchers: RunEvents) -> None:
        self.watchers = watchers

    def note(self, text: str) -> None:
        for w in self.watchers:
            w.note(text)

    def message(self, text: str) -> None:
        for w in self.watchers:
            w.message(text)

    def rank_output(self, source: str, text: str) -> None:
        for w in self.watchers:
            w.rank_output(source, text)

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        for w in self.watchers:
            w.stage_started(job, world_size, device_type, backend)

    def progress(self, progress: StageProgress) -> None:
        for w in self.watchers:
            w.progress(progress)

    def stage_finished(self) -> None:
        for w in self.watchers:
            w.stage_finished()

    def finished(self, result: RunResult) -> None:
        for w in self.watchers:
            w.finished(result)
