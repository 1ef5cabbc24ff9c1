"""Whether an attempt's failure is worth a restart, and what the attempt leaves on record.

Pure: an ended attempt's outcome and what its ranks' beacons said in, a class, a decision and an
``AttemptRecord`` out. The class comes from what the launcher already knows (the root cause's
type, the process layer's exit, the hang watch, the stop request); ``restart_on`` decides which
classes spend ``max_restarts``; a job error that repeats the previous attempt's traceback is not
restarted again (it will fail the same way), a user's stop never is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from launcher.protocol import ACTOR_DIED, HOST_LOST, NODE_LOST, RankError, RankProgress, is_peer_loss
from launcher.policies import FailureClass, RestartPolicy
from launcher.records import AttemptRecord, FailureReason, RootCause, StageOutcome

# errors a rank raises while it meets the others, before the job's code runs
_RENDEZVOUS_ERRORS = re.compile(r"DistStoreError|DistNetworkError|RendezvousTimeout|RendezvousError|RendezvousClosed|TimeoutError|ConnectionRefused")
_OOM_ERRORS = re.compile(r"OutOfMemoryError|OutOfMemoryKill|CUDA out of memory|MemoryError")


def classify(outcome: StageOutcome) -> FailureClass | None:
    """The class of an attempt that did not succeed (None for one that did)."""
    failure = outcome.failure
    if outcome.ok or failure is None:
        return None
    if failure.failure_class is not None:
        return failure.failure_class
    by_reason = {
        FailureReason.HUNG: FailureClass.HANG,
        FailureReason.TIMEOUT: FailureClass.TIMEOUT,
        FailureReason.INTERRUPTED: FailureClass.STOPPED,
        FailureReason.NOT_STARTED: FailureClass.RENDEZVOUS,
    }
    if failure.reason in by_reason:
        return by_reason[failure.reason]
    root = failure.root_cause
    if root is None:
        return FailureClass.RANK_LOST  # the group ended without any rank's account: a process died
    return _class_of_root(root, outcome)


def _class_of_root(root: RootCause, outcome: StageOutcome) -> FailureClass:
    if root.type in (HOST_LOST, NODE_LOST):
        return FailureClass.HOST_LOST
    if _OOM_ERRORS.search(root.type) or "out of memory" in root.message.lower():
        return FailureClass.OOM
    if root.type == ACTOR_DIED or root.signal or root.type in ("KilledBySignal", "ProcessExit"):
        return FailureClass.RANK_LOST
    if is_peer_loss(RankError(root.type, root.message, root.traceback, 0.0)):
        return FailureClass.RANK_LOST  # only a peer's loss was seen: someone went away
    report = next((r for r in outcome.reports if r.rank == root.rank), None)
    before_job = report is not None and "pg_ready" not in report.phases and not outcome.script
    if before_job and _RENDEZVOUS_ERRORS.search(f"{root.type}: {root.message}"):
        return FailureClass.RENDEZVOUS
    return FailureClass.JOB_ERROR


def error_signature(root: RootCause | None) -> str:
    """What "the same traceback" compares: the exception and the frames it came through."""
    return "" if root is None else f"{root.type}: {root.message}\n{root.traceback}"


@dataclass(frozen=True)
class Decision:
    restart: bool
    why: str


def decide(
    policy: RestartPolicy, outcome: StageOutcome, failure_class: FailureClass | None, *, attempt: int, previous_error: str, stopping: bool
) -> Decision:
    """Restart or not, and why (the console's line, result.json's ``decision``)."""
    if failure_class is None:
        return Decision(False, "")
    if stopping or failure_class in (FailureClass.STOPPED, FailureClass.PREEMPTED):
        return Decision(False, "a stop is never restarted")
    if failure_class not in policy.restart_on:
        chosen = ", ".join(sorted(c.value for c in policy.restart_on)) or "nothing"
        return Decision(False, f"{failure_class.value} is not in restart_on ({chosen})")
    if attempt >= policy.max_restarts:
        return Decision(False, f"max_restarts={policy.max_restarts} spent" if policy.max_restarts else "max_restarts is 0")
    root = outcome.failure.root_cause if outcome.failure else None
    if failure_class == FailureClass.JOB_ERROR and previous_error and error_signature(root) == previous_error:
        return Decision(False, "the job raised the same error, with the same traceback, as the attempt before: a restart would fail the same way")
    return Decision(True, f"restart {attempt + 1} of {policy.max_restarts} ({failure_class.value})")


@dataclass(frozen=True)
class AttemptProgress:
    """How far an attempt got, from its ranks' last beacons."""

    steps: int = 0
    resumed_step: int | None = None
    checkpoint_step: int | None = None
    steps_at_checkpoint: int | None = None

    @classmethod
    def of(cls, beacons: Mapping[int, RankProgress]) -> "AttemptProgress":
        if not beacons:
            return cls()
        # rank 0 writes (or publishes) every checkpoint: its beacon says which one is complete
        writer = beacons.get(0) or beacons[min(beacons)]
        resumed = [b.resumed_step for b in beacons.values() if b.resumed_step is not None]
        return cls(max(b.steps for b in beacons.values()), max(resumed) if resumed else None, writer.ckpt_step, writer.ckpt_at)

    @property
    def lost_steps(self) -> int:
        """Steps done after the last checkpoint: what the next attempt does again."""
        return max(0, self.steps - (self.steps_at_checkpoint or 0))


def attempt_record(
    outcome: StageOutcome, progress: AttemptProgress, failure_class: FailureClass | None, decision: Decision, *, attempt: int, started_at: float
) -> AttemptRecord:
    return AttemptRecord(
        attempt=attempt,
        status=outcome.status,
        started_at=started_at,
        ended_at=outcome.ended_at,
        failure_class=failure_class,
        cause=outcome.failure.summary if outcome.failure else "",
        steps=progress.steps,
        resumed_step=progress.resumed_step,
        checkpoint_step=progress.checkpoint_step,
        lost_steps=progress.lost_steps if failure_class is not None else None,
        restarted=decision.restart,
        decision=decision.why,
        world_size=outcome.world_size,
    )
