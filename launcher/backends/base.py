"""The one small interface every backend implements: start a plan, poll it, stop it."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterator

from launcher.logstream import LogRouter
from launcher.plan import LaunchPlan, NodeTarget


@dataclass(frozen=True)
class RankExit:
    """What the process layer knows about a rank that ended badly (beyond its own report)."""

    rank: int
    exitcode: int | None
    signal: str | None = None
    oom_suspected: bool = False
    host: str | None = None


@dataclass(frozen=True)
class BackendStatus:
    done: bool
    ok: bool = False
    rank_exits: tuple[RankExit, ...] = ()
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Backend(ABC):
    """Runs one LaunchPlan. The supervisor drives it; the backend never decides a run's fate."""

    name: str = "base"

    @classmethod
    @contextlib.contextmanager
    def session(cls, job: Any) -> Iterator[None]:
        """Resources that live for a whole run, across its stages and restarts (e.g. a Ray
        runtime). Entered once by ``run_job`` before the first stage; must clean up on exit."""
        yield

    def __init__(self, plan: LaunchPlan, logs: LogRouter) -> None:
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

    @staticmethod
    def describe_plan(plan: LaunchPlan) -> list[str]:
        """Human-readable commands for ``--dry-run`` (nothing is started)."""
        return []

    @classmethod
    def check_job(cls, job: Any, cluster: str | None) -> None:
        """Refuse, before anything starts, what this backend cannot run (raise a LauncherError)."""

    @classmethod
    def schedules_onto_cluster(cls) -> bool:
        """True when the backend places ranks on its own cluster (a Ray cluster): the plan then
        comes from ``pool_nodes`` inside the session, not from this machine or ``--cluster``."""
        return False

    @classmethod
    def pool_nodes(cls, job: Any) -> list[NodeTarget]:
        """The backend's cluster as nodes to plan on; asked inside ``session``."""
        raise NotImplementedError(f"{cls.name} does not schedule onto a cluster of its own")
