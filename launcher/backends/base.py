"""The one small interface every backend implements: start a plan, poll it, stop it.

A backend receives a ``StagePlan`` (control.planning) and turns it into its own launch request:
torchrun commands, Ray actors, an sbatch script. It never derives ranks, devices or threads
again; the run loop (control.runloop) decides a stage's fate, the backend only reports.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from launcher.procutil import stage_worker_pids
from launcher.records import RankExit

if TYPE_CHECKING:
    from pathlib import Path

    from launcher.control.events import RunEvents
    from launcher.control.logrouting import LogRouter
    from launcher.control.planning import NodeTarget, StagePlan
    from launcher.results.store import RunResult
    from launcher.spec.model import LoadedJob


@dataclass(frozen=True)
class LaunchRequest:
    """What a backend would submit for one stage, printable: ``--dry-run`` shows exactly this."""

    backend: str
    commands: tuple[str, ...]  # the commands, scripts or actors, as a user could run or read them
    notes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        return [*self.commands, *(f"({note})" for note in self.notes)]


@dataclass(frozen=True)
class BackendStatus:
    done: bool
    ok: bool = False
    rank_exits: tuple[RankExit, ...] = ()
    detail: str = ""
    # the agent could not bind the rendezvous port another process took first: retry on another
    rendezvous_port_in_use: bool = False


class Backend(ABC):
    """Runs one StagePlan. The run loop drives it; the backend never decides a run's fate."""

    name: str = "base"

    @classmethod
    @contextlib.contextmanager
    def session(cls, job: LoadedJob) -> Iterator[None]:
        """Resources that live for a whole run, across its stages and restarts (e.g. a Ray
        runtime). Entered once by ``run_job`` before the first stage; must clean up on exit."""
        yield

    def __init__(self, plan: StagePlan, logs: LogRouter) -> None:
        self.plan = plan
        self.logs = logs

    @abstractmethod
    def start(self) -> None:
        """Spawn every process of the plan and return without waiting for them."""

    @abstractmethod
    def poll(self) -> BackendStatus:
        """Non-blocking: has the group ended, and how."""

    @abstractmethod
    def stop(self, grace_s: float = 5.0) -> None:
        """Tear everything down (gracefully, then by force); idempotent; returns when all is gone."""

    def collect(self) -> None:
        """Bring per-rank reports to the launcher's stage directory (no-op where they are local)."""

    def signal_ranks(self, signum: int) -> None:
        """Send a signal to every live rank this launcher can reach (SIGUSR1: a stack dump into
        its log, on a hang): those on this machine, found by the pid and start time in their
        progress files."""
        for pid in stage_worker_pids(self.plan.stage_dir).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    @staticmethod
    @abstractmethod
    def launch_request(plan: StagePlan) -> LaunchRequest:
        """The backend's own launch request for ``plan``, for ``--dry-run`` (nothing is started)."""

    @classmethod
    def check_job(cls, job: LoadedJob, cluster: str | None) -> None:
        """Refuse, before anything starts, what this backend cannot run (raise a LauncherError)."""

    @classmethod
    def schedules_onto_cluster(cls) -> bool:
        """True when the backend places ranks on its own cluster (a Ray cluster): the plan then
        comes from ``pool_nodes`` inside the session, not from this machine or ``--cluster``."""
        return False

    @classmethod
    def pool_nodes(cls, job: LoadedJob) -> list[NodeTarget]:
        """The backend's cluster as nodes to plan on; asked inside ``session``."""
        raise NotImplementedError(f"{cls.name} does not schedule onto a cluster of its own")

    # --- a backend whose scheduler runs the whole launcher as one job (a Slurm batch job) --------

    @classmethod
    def submits_run(cls) -> bool:
        """True when ``run_job`` should hand the whole run to this backend's scheduler (which
        runs the launcher again, inside the job) instead of running the stages from here."""
        return False

    @classmethod
    def submit_run(cls, job: LoadedJob, *, out: Path, events: RunEvents, stop: object | None, detach: bool) -> RunResult:
        """Submit the run, follow it to its end (or return once submitted, with ``detach``) and
        return its result; the same exit codes and ``result.json`` as a run from here. ``stop``:
        the caller's StopRequest (true once a stop is asked for), besides SIGINT and SIGTERM."""
        raise NotImplementedError(f"{cls.name} runs its stages from here")

    @classmethod
    def plan_submission(cls, job: LoadedJob, *, out: Path) -> tuple[list[StagePlan], list[LaunchRequest], list[str]]:
        """For ``--dry-run``: the plans, what would be submitted, and notes. Nothing is submitted."""
        raise NotImplementedError(f"{cls.name} runs its stages from here")
