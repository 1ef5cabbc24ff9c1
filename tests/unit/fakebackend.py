"""A scripted fake stage engine for unit tests of the run loop: no processes, no sockets.

A script is one ``Attempt`` per stage the run loop starts (one per restart or port retry). An
attempt lists what each ``poll()`` of its handle returns, in order, and what happens just before
it returns (``Step``): rank beacons and reports delivered as the live channel delivers them
(typed events on the stage's queue), rank log lines routed through the run loop's ``LogRouter``,
rank exits the process layer saw, or any callable (set a stop request, write a raw file).

Once its steps ran out, an attempt's ``poll()`` returns ``then`` (by default: still running, i.e.
the group hangs) until the run loop calls ``stop()``; from then on it returns ``after_stop``.

``scripted(*attempts)`` makes a ``FakeEngine`` to hand to ``run_stage``; its ``instances`` list
records every stage handle started, each with its plan and the calls the run loop made on it.
"""

from __future__ import annotations

import signal as signal_module
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, Union

from launcher.evidence import RankEvidence
from launcher.protocol import LOG_PREFIX_SEPARATOR, RankError, RankProgress, RankReport, RankStatus
from launcher.records import RankExit
from launcher.stage.engine import HandleStatus, LaunchRequest, StageEngine, StageHandle
from launcher.stage.events import RankBeacon, RankExited, RankReported
from launcher.stage.logrouting import LogRouter
from launcher.stage.plan import StagePlan


@dataclass(frozen=True)
class Status:
    """What a poll returns (``HandleStatus``), plus the rank exits the process layer saw by then
    (delivered as ``RankExited`` events, as an agent's failure records are)."""

    done: bool
    ok: bool = False
    detail: str = ""
    rendezvous_port_in_use: bool = False
    rank_exits: tuple[RankExit, ...] = ()

    def handle_status(self) -> HandleStatus:
        return HandleStatus(self.done, self.ok, self.detail, self.rendezvous_port_in_use)


RUNNING = Status(done=False)
DONE_OK = Status(done=True, ok=True)
# what the process layer says once the run loop stopped a group that had not ended by itself
STOPPED = Status(done=True, ok=False, detail="stopped by the launcher")

# what a rank's report says: OK, or the error it raised
Outcome = Union[RankStatus, RankError]


def error(type_: str, message: str, *, at: float | None = None, traceback: str | None = None) -> RankError:
    """A rank's error as the worker records it (``traceback`` defaults to a plausible one)."""
    tb = traceback if traceback is not None else (
        "Traceback (most recent call last):\n"
        '  File "/job/train.py", line 12, in run\n'
        f"    raise {type_}({message!r})\n"
        f"{type_}: {message}\n"
    )
    return RankError(type=type_, message=message, traceback=tb, time=time.time() if at is None else at)


def peer_loss(at: float | None = None) -> RankError:
    """What gloo raises in a rank whose peer died under it."""
    return error(
        "RuntimeError",
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500",
        at=at,
    )


@dataclass(frozen=True)
class Step:
    """One ``poll()``: its side effects (in this order), then the status it returns."""

    status: Status = RUNNING
    beacons: Mapping[int, str] = field(default_factory=dict)  # rank -> phase
    logs: Mapping[int, Sequence[str]] = field(default_factory=dict)  # rank -> lines
    reports: Mapping[int, Outcome] = field(default_factory=dict)  # rank -> OK or its error
    effect: Callable[["FakeStage"], None] | None = None


@dataclass(frozen=True)
class Attempt:
    """What one stage handle (one attempt of a stage) does."""

    polls: Sequence[Step] = ()
    then: Status = RUNNING  # every poll after ``polls`` ran out, until stopped
    after_stop: Status = STOPPED  # every poll once stopped
    start_error: BaseException | None = None  # raised by start(), after it stopped what it started
    on_stop: Step | None = None  # side effects of stop() (its status is not used)
    on_collect: Step | None = None  # side effects of collect(): reports a remote host brought back
    # what gather_evidence() returns for a stalled stage; None: the seam's default (SIGUSR1, nothing)
    evidence: Sequence[RankEvidence] | None = None


class FakeEngine(StageEngine):
    """An engine that plays its ``attempts``, one per stage started, and records the handles."""

    name = "fake"

    def __init__(self, attempts: Sequence[Attempt]) -> None:
        self.attempts = tuple(attempts)
        self.instances: list[FakeStage] = []

    def launch_request(self, plan: StagePlan) -> LaunchRequest:
        return LaunchRequest("fake", (f"fake {plan.job} world={plan.world_size} at {plan.rendezvous}",))

    def start(self, plan: StagePlan, logs: LogRouter) -> StageHandle:
        index = len(self.instances)
        assert index < len(self.attempts), f"the run loop started stage #{index + 1}; the script has {len(self.attempts)}"
        stage = FakeStage(plan, logs, self.attempts[index])
        self.instances.append(stage)
        stage.calls.append("start")
        if stage.script.start_error is not None:
            stage.stop()  # as a real engine does: what it started is gone before it raises
            raise stage.script.start_error
        return stage


class FakeStage(StageHandle):
    def __init__(self, plan: StagePlan, logs: LogRouter, script: Attempt) -> None:
        super().__init__(plan, logs)
        self.script = script
        self.calls: list[str] = []  # "start", "poll", "signal_ranks:SIGUSR1", "gather_evidence", "stop", "collect"
        self.signals: list[int] = []
        self.polls_before_stop = 0
        self.stopped = False
        self._next = 0

    # --- what the run loop calls -------------------------------------------------------------------

    def poll(self) -> HandleStatus:
        self.calls.append("poll")
        if self.stopped:
            return self._status(self.script.after_stop)
        self.polls_before_stop += 1
        if self._next < len(self.script.polls):
            step = self.script.polls[self._next]
            self._next += 1
            self.play(step)
            return self._status(step.status)
        return self._status(self.script.then)

    def _status(self, status: Status) -> HandleStatus:
        if status.rank_exits and status.done:
            self.emit(*(RankExited(e) for e in status.rank_exits))
        return status.handle_status()

    def stop(self, grace_s: float = 5.0) -> None:
        self.calls.append("stop")
        if not self.stopped and self.script.on_stop is not None:
            self.play(self.script.on_stop)
        self.stopped = True

    def collect(self) -> None:
        self.calls.append("collect")
        if self.script.on_collect is not None:
            self.play(self.script.on_collect)

    def signal_ranks(self, signum: int) -> None:
        self.calls.append(f"signal_ranks:{signal_module.Signals(signum).name}")
        self.signals.append(signum)

    def gather_evidence(self) -> list[RankEvidence]:
        self.calls.append("gather_evidence")
        if self.script.evidence is None:
            return super().gather_evidence()
        return list(self.script.evidence)

    # --- what a step does, as the real processes would -------------------------------------------

    def count(self, call: str) -> int:
        return self.calls.count(call)

    def play(self, step: Step) -> None:
        for rank, phase in step.beacons.items():
            self.beacon(rank, phase)
        for rank, lines in step.logs.items():
            for line in lines:
                self.log(rank, line)
        for rank, outcome in step.reports.items():
            self.report(rank, outcome)
        if step.effect is not None:
            step.effect(self)

    def beacon(self, rank: int, phase: str, steps: int = 0) -> None:
        self.emit(RankBeacon(rank, RankProgress(phase=phase, steps=steps, t=time.time())))

    def log(self, rank: int, line: str) -> None:
        """A line of the rank's output, as an agent's merged output carries it (``host:rank| text``)."""
        host = self.plan.ranks[rank].host
        self.logs.route(f"{host}:{rank}{LOG_PREFIX_SEPARATOR}{line}", host)

    def report(self, rank: int, outcome: Outcome) -> RankReport:
        slot = self.plan.ranks[rank]
        now = time.time()
        report = RankReport(
            rank=slot.rank,
            local_rank=slot.local_rank,
            node_rank=slot.node_rank,
            world_size=self.plan.world_size,
            host=slot.host,
            device=slot.device,
            status=RankStatus.OK if outcome == RankStatus.OK else RankStatus.FAILED,
            phases={"spawned": now - 0.01, "finished": now},
            result={"rank": rank} if outcome == RankStatus.OK else None,
            error=outcome if isinstance(outcome, RankError) else None,
            hostname="fakehost",
            pid=10_000 + rank,
            rendezvous=str(self.plan.rendezvous),
        )
        self.emit(RankReported(report))
        return report


def scripted(*attempts: Attempt) -> FakeEngine:
    """A FakeEngine that plays ``attempts`` in turn (one per stage the run loop starts)."""
    return FakeEngine(attempts)


def exits(*items: tuple[int, str | int]) -> tuple[RankExit, ...]:
    """``exits((1, "SIGKILL"), (0, 3))``: rank exits by signal name or exit code, on host "h"."""
    return tuple(
        RankExit(rank, None, how, host="h") if isinstance(how, str) else RankExit(rank, how, host="h") for rank, how in items
    )
