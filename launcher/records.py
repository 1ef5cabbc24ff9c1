"""Typed records that cross the launcher's modules: statuses, failures, stage outcomes.

Built in one place each (the run loop builds outcomes, ``control.diagnosis`` failures) and turned
into plain data only at the edge (``to_dict`` for result.json). What a stage does about a failure,
a hang or a straggler (the failure classes and the policies) is ``launcher.policies``'. Standard
library only.
"""

from __future__ import annotations

import enum
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from launcher.policies import FailureClass
from launcher.protocol import RankReport


def new_run_id() -> str:
    """When the run started, and a few random hex digits: sorts by time, unique per machine."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


# the run's one document in its run directory (``launcher.results.store`` writes and reads it)
RESULT_FILE = "result.json"


class BackendName(str, enum.Enum):
    """The built-in engines' names, for words that list them (the CLI's help). What ``backend:``
    accepts is the registry's (``launcher.backends.names()``), registered engines included."""

    TORCHRUN = "torchrun"
    RAY = "ray"
    SLURM = "slurm"

    @classmethod
    def names(cls) -> list[str]:
        return [b.value for b in cls]


class RunStatus(str, enum.Enum):
    """The state of a stage or a whole run; the last four are terminal."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"
    INTERRUPTED = "interrupted"
    HUNG = "hung"  # its ranks stopped making progress for timeouts.hang_s

    @property
    def terminal(self) -> bool:
        return self not in (RunStatus.PENDING, RunStatus.RUNNING)

    @property
    def exit_code(self) -> int:
        """0 success, 130 interrupted, 1 anything else that ended (the CLI's contract)."""
        return {RunStatus.SUCCEEDED: 0, RunStatus.INTERRUPTED: 130}.get(self, 1)


class FailureReason(str, enum.Enum):
    FAILED = "failed"  # a rank (or a host, an agent) failed
    TIMEOUT = "timeout"  # timeouts.run_s ran out
    INTERRUPTED = "interrupted"  # Ctrl-C, SIGTERM, a stop request
    NOT_STARTED = "not_started"  # a stage could not start (a host, a port, an agent)
    HUNG = "hung"  # no progress for timeouts.hang_s: the culprits named from every rank's evidence

    @property
    def status(self) -> RunStatus:
        return {
            FailureReason.TIMEOUT: RunStatus.TIMEOUT,
            FailureReason.INTERRUPTED: RunStatus.INTERRUPTED,
            FailureReason.HUNG: RunStatus.HUNG,
        }.get(self, RunStatus.FAILED)


@dataclass(frozen=True)
class AttemptRecord:
    """One start of a stage's group: how it ended, why, and what a restart resumed from."""

    attempt: int
    status: RunStatus
    started_at: float
    ended_at: float
    failure_class: FailureClass | None = None
    cause: str = ""  # the failure's one line
    steps: int = 0  # the furthest rank's step count in this attempt
    resumed_step: int | None = None  # the checkpoint step this attempt started from
    checkpoint_step: int | None = None  # the last complete checkpoint when it ended
    lost_steps: int | None = None  # steps done after that checkpoint: what the next attempt does again
    restarted: bool = False
    decision: str = ""  # why it was, or was not, restarted
    world_size: int | None = None  # its ranks (an elastic world's attempt after a lost host has fewer)

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt, "world_size": self.world_size, "status": self.status.value, "started_at": self.started_at, "ended_at": self.ended_at,
            "failure_class": self.failure_class.value if self.failure_class else None, "cause": self.cause, "steps": self.steps,
            "resumed_step": self.resumed_step, "checkpoint_step": self.checkpoint_step, "lost_steps": self.lost_steps,
            "restarted": self.restarted, "decision": self.decision,
        }  # fmt: skip


@dataclass(frozen=True)
class Recovery:
    """One lost rank's story where the stage tried recovery in place (``launcher.runtime.inplace``):
    who died and when, when the survivors saw it, when every rank stepped again, the steps lost;
    or, where it fell back to the restart path (``in_place`` false), why. Times are the hosts'
    clocks: over several hosts the death is seen by the lost rank's node and the rest by the rank
    that sent the state, so ``detection_s`` and ``recovery_s`` carry the two clocks' offset."""

    attempt: int  # the group's start it happened in (0: the first)
    gen: int  # the group's generation it formed (1: the first recovery of that start)
    in_place: bool  # recovered with the survivors' processes; false: the restart path took it
    dead_ranks: tuple[int, ...]
    died_at: float  # the first sign of the loss: a survivor's broken collective, or the keeper's poll
    detection_s: float | None = None  # death -> the survivors' broken collective
    recovery_s: float | None = None  # death -> every rank stepping again
    state_s: float | None = None  # the state sent from a survivor's memory (the replacement's own start included)
    state_bytes: int | None = None
    resumed_step: int | None = None  # the completed steps the group went on from
    steps_lost: int | None = None  # steps done before the death that were done again
    why: str = ""  # a fallback's reason
    # what took each dead rank's place: "warm spare" (its prepare done ahead), "warm spare
    # (preparing)" (sent before its prepare returned), "forked" (from the rank server at the loss),
    # "new actor" (Ray: the driver started one), "spare host <name>" (a lost host's ranks, on that host)
    replacements: tuple[str, ...] = ()
    # a recovery that timed out: where each rank of the node was then ("rank 1 (pid 123) at train.py:40 ...")
    stuck: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Recovery":
        def number(key: str) -> float | None:
            value = data.get(key)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        def count(key: str) -> int | None:
            value = data.get(key)
            return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

        return cls(
            attempt=int(data.get("attempt") or 0), gen=int(data.get("gen") or 0), in_place=bool(data["in_place"] if "in_place" in data else data.get("path") == "in_place"),
            dead_ranks=tuple(int(r) for r in data.get("dead_ranks") or ()), died_at=float(data.get("died_at") or 0.0),
            detection_s=number("detection_s"), recovery_s=number("recovery_s"), state_s=number("state_s"),
            state_bytes=count("state_bytes"), resumed_step=count("resumed_step"), steps_lost=count("steps_lost"), why=str(data.get("why") or ""),
            replacements=tuple(str(r) for r in data.get("replacements") or ()), stuck=tuple(str(r) for r in data.get("stuck") or ()),
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt, "gen": self.gen, "path": "in_place" if self.in_place else "restart", "dead_ranks": list(self.dead_ranks),
            "died_at": self.died_at, "detection_s": self.detection_s, "recovery_s": self.recovery_s, "state_s": self.state_s,
            "state_bytes": self.state_bytes, "resumed_step": self.resumed_step, "steps_lost": self.steps_lost, "why": self.why,
            "replacements": list(self.replacements), **({"stuck": list(self.stuck)} if self.stuck else {}),
        }  # fmt: skip


@dataclass(frozen=True)
class RankExit:
    """What the process layer knows about a rank that ended badly (beyond its own report)."""

    rank: int
    exitcode: int | None
    signal: str | None = None
    oom_suspected: bool = False
    host: str | None = None
    collateral: bool = False  # stopped by its agent because another rank failed first


@dataclass(frozen=True)
class RootCause:
    """The first failure of a stage: which rank, where, and what it raised or how it died."""

    rank: int
    host: str | None
    local_rank: int | None
    device: str | None
    type: str
    message: str
    traceback: str = ""
    log_tail: tuple[str, ...] = ()
    exitcode: int | None = None
    signal: str | None = None
    hint: str | None = None  # one line on the likely fix, when the failure has a known cause

    def line(self) -> str:
        return f"rank {self.rank} on {self.host} ({self.device}): {self.type}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "host": self.host,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "device": self.device,
            "type": self.type,
            "message": self.message,
            "traceback": self.traceback,
        }
        if self.exitcode is not None or self.signal is not None:
            data.update(exitcode=self.exitcode, signal=self.signal)
        data["log_tail"] = list(self.log_tail)
        if self.hint:
            data["hint"] = self.hint
        return data


@dataclass(frozen=True)
class Failure:
    """Why a stage (or the run) did not succeed: the root cause apart from the collateral."""

    reason: FailureReason
    summary: str
    root_cause: RootCause | None = None
    collateral_ranks: tuple[int, ...] = ()
    stuck_ranks: tuple[int, ...] = ()
    hang: HangDiagnosis | None = None
    failure_class: FailureClass | None = None

    def to_dict(self) -> dict[str, Any]:
        data = {
            "reason": self.reason.value,
            "failure_class": self.failure_class.value if self.failure_class else None,
            "summary": self.summary,
            "root_cause": self.root_cause.to_dict() if self.root_cause else None,
            "collateral_ranks": list(self.collateral_ranks),
            "stuck_ranks": list(self.stuck_ranks),
        }
        if self.hang is not None:
            data["hang"] = self.hang.to_dict()
        return data


@dataclass(frozen=True)
class HangCulprit:
    """A rank that holds a hung stage up, and why it is the odd one out."""

    rank: int
    host: str
    device: str
    why: str  # "has not reached all_reduce #12", "is frozen (stopped)", "is in a different collective"
    where: str  # "train.py:88 time.sleep(3600)": the innermost line of the job's own code
    file: str = ""
    line: int = 0
    collective_seq: int | None = None  # its flight recorder's last collective

    def describe(self) -> str:
        return f"rank {self.rank} on {self.host} ({self.device}) {self.why}" + (f" — it is at {self.where}" if self.where else "")

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": self.host, "device": self.device, "why": self.why, "where": self.where,
                "file": self.file, "line": self.line, "collective_seq": self.collective_seq}  # fmt: skip


@dataclass(frozen=True)
class HangGroup:
    """Ranks found at the same place: the same line of the job's code, the same collective."""

    ranks: tuple[int, ...]
    where: str
    collective: str | None = None  # "all_reduce #12" where they wait in one
    state: str = ""  # "stopped" for frozen processes, "gone" for ranks that had ended

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), "where": self.where, "collective": self.collective, "state": self.state}


@dataclass(frozen=True)
class HangDiagnosis:
    """A hung stage, explained: the culprits first, every rank grouped by where it was."""

    summary: str  # the console's one line, after "HUNG: "
    stalled_for_s: float
    detected_after_s: float  # seconds into the stage
    culprits: tuple[HangCulprit, ...]
    groups: tuple[HangGroup, ...]
    evidence_dir: str = ""  # world<N>/hang on the launching machine: every rank's stacks and collectives
    gather_s: float = 0.0  # how long gathering the evidence took

    def to_dict(self) -> dict[str, Any]:
        return {
            "summary": self.summary, "stalled_for_s": round(self.stalled_for_s, 1), "detected_after_s": round(self.detected_after_s, 1),
            "culprits": [c.to_dict() for c in self.culprits], "groups": [g.to_dict() for g in self.groups],
            "evidence_dir": self.evidence_dir, "gather_s": round(self.gather_s, 2),
        }  # fmt: skip


@dataclass
class Straggler:
    """One rank flagged while its stage ran: who, where, how much slower, and for how long."""

    rank: int
    host: str
    device: str
    work_s: float  # the rank's own work per step when flagged (median of recent steps)
    peers_median_s: float  # the other ranks' median at that moment
    flagged_after_s: float  # seconds into the stage when the flag went up
    peak_ratio: float = 0.0
    cleared_after_s: float | None = None  # when it caught up again (None: flagged to the end)

    @property
    def ratio(self) -> float:
        return self.work_s / self.peers_median_s if self.peers_median_s > 0 else float("inf")

    def describe(self) -> str:
        times = f"{self.ratio:.1f}x" if self.peers_median_s > 0 else "their figure is 0"
        return (f"straggler: rank {self.rank} on {self.host} ({self.device}): own work {_ms(self.work_s)} per step "
                f"vs {_ms(self.peers_median_s)} for its peers (median), {times}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "host": self.host, "device": self.device,
            "work_s": round(self.work_s, 6), "peers_median_s": round(self.peers_median_s, 6),
            # None where the peers' median is 0 (an infinite ratio is not JSON)
            "ratio": _finite(self.ratio), "peak_ratio": _finite(max(self.peak_ratio, self.ratio)),
            "flagged_after_s": round(self.flagged_after_s, 3),
            "cleared_after_s": None if self.cleared_after_s is None else round(self.cleared_after_s, 3),
        }  # fmt: skip


def _finite(ratio: float) -> float | None:
    return round(ratio, 3) if ratio != float("inf") else None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


@dataclass
class StageOutcome:
    """One stage (one world size) after it ended, as the run loop hands it to the results."""

    world_size: int
    status: RunStatus
    started_at: float
    ended_at: float
    script: bool = False  # a script joins the process group itself: no rendezvous phases
    restarts: int = 0
    reports: list[RankReport] = field(default_factory=list)
    failure: Failure | None = None
    rendezvous_port_in_use: bool = False
    load_avg: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # "start"/"end"
    stragglers: list[Straggler] = field(default_factory=list)
    attempts: list[AttemptRecord] = field(default_factory=list)  # every start of the group, the last one included

    @property
    def ok(self) -> bool:
        return self.status == RunStatus.SUCCEEDED


@dataclass(frozen=True)
class SkippedWorld:
    """A world size ``scaling.workers`` lists that these nodes cannot run: why, and what would."""

    world_size: int
    reason: str  # e.g. "needs 2 worker slot(s) per node but 1 GPU(s) give 1"
    remedy: str  # e.g. "it runs where this node has 2 GPUs, or here with resources.ranks_per_gpu: 2"

    def describe(self) -> str:
        return f"world size {self.world_size} skipped: it {self.reason}; {self.remedy}"

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "reason": self.reason, "remedy": self.remedy}


@dataclass(frozen=True)
class LinkMeasure:
    """One directed link between two hosts, as the preflight's network check measured it."""

    src: str  # host names, as the cluster file has them
    dst: str
    gbit_s: float | None  # payload throughput, 10^9 bits per second; None: no figure (see ``error``)
    latency_ms: float | None  # half the median round trip of a one-byte ping
    error: str | None = None  # why there is no figure: the peer did not answer on the job's interface, ...

    def describe(self) -> str:
        if self.gbit_s is None:
            return f"{self.src} -> {self.dst}: {self.error or 'no figure'}"
        latency = self.latency_ms or 0.0
        said = f"{latency * 1e3:.3g} us" if latency < 1 else f"{latency:.3g} ms"
        return f"{self.src} -> {self.dst}: {self.gbit_s:.3g} Gbit/s, {said} latency"


@dataclass(frozen=True)
class NetworkCheck:
    """The preflight's network check: every link it measured (a ring, each way), the median, and
    the verdict: links under ``min_fraction`` of the median, hosts that could not be reached, and
    the hosts to blame (on every slow link of theirs, or unreachable)."""

    links: tuple[LinkMeasure, ...]
    median_gbit_s: float | None
    min_fraction: float
    slow: tuple[str, ...]  # "slow link node-a <-> node-c: 0.9 Gbit/s vs 9.6 median"
    unreachable: tuple[str, ...]  # "node-c: no answer on eth0 within 3 s (from node-b)"
    bad_hosts: tuple[str, ...]  # the hosts the problems point at (may be empty when a link is ambiguous)
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.slow and not self.unreachable

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


@dataclass(frozen=True)
class HostSwap:
    """A host left out before the start, and the spare that took its place (None: none was needed,
    it was a spare itself, or none was left)."""

    host: str
    reasons: tuple[str, ...]
    replaced_by: str | None

    def describe(self) -> str:
        why = "; ".join(r.removeprefix(f"{self.host}: ") for r in self.reasons)
        taken = f": the spare {self.replaced_by} takes its place" if self.replaced_by else ""
        return f"{self.host} left out ({why}){taken}"


@dataclass(frozen=True)
class PreflightRecord:
    """What the checks before the start decided: the hosts used, the spares kept, the hosts left out
    and why, and the network check's links (``result.json``'s ``preflight``)."""

    hosts: tuple[str, ...]
    spares: tuple[str, ...] = ()
    left_out: tuple[HostSwap, ...] = ()
    network: NetworkCheck | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


@dataclass(frozen=True)
class AsSubmitted:
    """A submitted run as it was handed over: what a result made without the launcher inside
    records of it (its spec as shown, with secrets masked; the spec's fingerprint; the params)."""

    spec: Mapping[str, Any]
    spec_hash: str
    params: Mapping[str, Any]
    at: float | None  # when it was submitted (None: not recorded)


@dataclass(frozen=True)
class SubmittedRun:
    """What a submitter hands back for a run it handed to a scheduler (``Submitter.submit_run``,
    ``attach_run``): where the run's record landed on this machine and how the scheduler saw the
    job end. The results layer makes the run's result from it (``launcher.results.handed_back``):
    the ``result.json`` the launcher inside wrote, completed with the scheduler's words, or one
    made from them where the launcher inside wrote none. A submitter reads and writes no result."""

    backend: str
    job: str
    run_id: str
    run_dir: Path | None  # the run directory on this machine (None: nothing came back from the cluster)
    job_id: str = ""  # the scheduler's id of the job
    scheduler_address: str = ""  # where the scheduler is, where it has one (a Ray dashboard)
    # submitted and not followed (``--detach``): how to follow it; the result says ``pending``
    pending_hint: str | None = None
    state: str = ""  # the scheduler's last word on the job (COMPLETED, STOPPED, NODE_FAIL, ...)
    said_error: str | None = None  # the last ``error:`` line the launcher inside wrote, where one was seen
    brought_back: bool = False  # the run directory came back from the cluster: its result says where it is now
    stale_before: float | None = None  # a result finished before this (wall clock) is an earlier allocation's
    # why the job ended, in the scheduler's words, should the launcher inside have written no
    # result (None: the scheduler cannot say; the submitter explains the missing result itself)
    ended_without: Failure | None = None
    # stopped from here (a signal, a stop request): the result's failure says so in these words
    interrupted: Failure | None = None
    # requeued and stopped before it ran again: interrupted, whatever the allocation before wrote
    interrupted_before_rerun: bool = False
    # the scheduler's own record of the job, kept in result.json under the backend's name
    scheduler: Mapping[str, Any] = field(default_factory=dict)
    # what a result made here (``ended_without``) records of the run (None: nothing, or not known)
    submitted: AsSubmitted | None = None
