"""What a run tells whoever watches it: the run loop emits events, a renderer shows them.

The library never imports the terminal UI: ``run_job`` takes any ``RunEvents``; the CLI passes the
rich console (``launcher.ui.console.RunUI``), a notebook gets ``PlainEvents`` (rank lines and a
short summary as plain text), and tests can pass ``RunEvents()`` to see nothing.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, TextIO

if TYPE_CHECKING:
    from launcher.control.planning import StagePlan
    from launcher.results.store import RunResult


@dataclass(frozen=True)
class RankLive:
    """One rank while its stage runs, from its beacon."""

    rank: int
    host: str
    phase: str
    steps: int
    beacon_t: float | None  # when the beacon was last written (the rank's own clock)
    work_s: float | None = None  # own work per step apart from waiting for peers, median of recent steps
    straggler: bool = False  # flagged by the run loop's straggler watch


@dataclass(frozen=True)
class StageProgress:
    """A stage while it runs: what every rank's beacon says, read twice a second."""

    world_size: int
    elapsed_s: float
    ranks: tuple[RankLive, ...]
    restarts: int = 0
    phases: Mapping[str, int] = field(default_factory=dict)  # phase -> how many ranks are in it

    @property
    def steps_min(self) -> int:
        return min((r.steps for r in self.ranks), default=0)

    @property
    def steps_max(self) -> int:
        return max((r.steps for r in self.ranks), default=0)


class RunEvents:
    """Every event a run emits; each does nothing here. Renderers override what they show."""

    def note(self, text: str) -> None:
        """Something the plan decided that the spec did not say outright."""

    def message(self, text: str) -> None:
        """The launcher's own line during a stage (a restart, a port retry)."""

    def rank_output(self, source: str, text: str) -> None:
        """One line of a rank's (``host:rank``) or an agent's (``host:agent``) output."""

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        """A stage (one world size) is about to start."""

    def progress(self, plan: StagePlan, progress: StageProgress) -> None:
        """Twice a second while a stage runs."""

    def remote_progress(self, progress: StageProgress) -> None:
        """A stage's progress as the launcher running it on a cluster reported it (a Ray job's log,
        about once a second): the plan stayed there, ``progress.world_size`` names the stage."""

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
