"""The run loop against a scripted fake backend: every fate of a stage, in milliseconds.

No processes: the fake backend (tests/unit/fakebackend.py) plays what pollers, agents and ranks
would do (reports, beacons, log lines, rank exits) on a schedule of polls, and the loop's waits
are shrunk to a millisecond.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from launcher.control import runloop
from launcher.control.planning import plan_stage
from launcher.control.runloop import StopRequest, run_stage
from launcher.errors import BackendError, LauncherError
from launcher.evidence import CollectiveCall, RankEvidence, StackFrame, ThreadStack
from launcher.masking import MASK
from launcher.protocol import RankProgress, RankStatus, StagePaths, WorkerConfig
from launcher.policies import FailureClass
from launcher.records import FailureReason, RunStatus, StageOutcome
from launcher.hardware.devices import NodeInventory
from launcher.spec.model import load_job
from launcher.stage.events import RankBeacon
from launcher.stage.plan import NodeTarget, StagePlan
from launcher.stage.watch import RunEvents, StageProgress
from tests.fake_time import FakeTime
from tests.unit.fakebackend import (
    DONE_OK,
    STOPPED,
    Attempt,
    FakeEngine,
    FakeStage,
    Status,
    Step,
    error,
    exits,
    peer_loss,
    scripted,
)

OK = RankStatus.OK
NODE = NodeTarget("h", "127.0.0.1", NodeInventory("h", 2), "python3")
FIRST_PORT = 29500
SECRET = "hunter2secret"
BOTH_RUNNING = Step(beacons={0: "running", 1: "running"})


@pytest.fixture(autouse=True)
def fast_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runloop, "POLL_S", 0.001)
    monkeypatch.setattr(runloop, "MIN_TURN_S", 0.001)
    monkeypatch.setattr(runloop, "PROGRESS_EVERY_S", 0.0)  # a progress event every poll
    monkeypatch.setattr(runloop, "FAILURE_GRACE_S", 0.05)
    monkeypatch.setattr(runloop, "STACK_DUMP_WAIT_S", 0.0)
    monkeypatch.setattr(runloop, "NOTICE_LISTEN_S", 0.05)


class Plans:
    """``make_plan`` for run_stage: a 2-rank CPU stage on one node, a new port on every call."""

    def __init__(self, tmp_path: Path, extra: str = "") -> None:
        spec = tmp_path / "j.yaml"
        spec.write_text("name: j\nentrypoint: launcher.workloads.matmul:run\nresources: {cpu_workers: 2}\n" + extra)
        self.job = load_job(spec)
        self.run_dir = tmp_path / "run"
        self.asked: list[int] = []  # the attempt number of every call
        self.made: list[StagePlan] = []

    def __call__(self, attempt: int) -> StagePlan:
        self.asked.append(attempt)
        port = FIRST_PORT + len(self.made)
        plan = plan_stage(self.job, [NODE], 2, "cpu", run_dir=self.run_dir, master_port=port, backend=None)
        self.made.append(plan)
        return plan

    @property
    def paths(self) -> StagePaths:
        return StagePaths.of(self.run_dir, 2)


class Recorded(RunEvents):
    def __init__(self) -> None:
        self.messages: list[str] = []
        self.progresses: list[StageProgress] = []

    def message(self, text: str) -> None:
        self.messages.append(text)

    def progress(self, progress: StageProgress) -> None:
        self.progresses.append(progress)


def run(plans: Plans, backend: FakeEngine, stop: StopRequest | None = None, events: RunEvents | None = None) -> StageOutcome:
    # not ``stop or StopRequest()``: a StopRequest not yet set is falsy
    return run_stage(plans, backend, stop=StopRequest() if stop is None else stop, events=events)


def success(*, logs: dict | None = None) -> Attempt:
    return Attempt(
        polls=[
            Step(beacons={0: "rendezvous", 1: "rendezvous"}),
            Step(beacons={0: "running", 1: "running"}, logs=logs or {}),
            Step(beacons={0: "finished", 1: "finished"}, reports={0: OK, 1: OK}, status=DONE_OK),
        ]
    )


# --- success --------------------------------------------------------------------------------------


def test_success_loads_every_report_and_tears_down_once(tmp_path: Path) -> None:
    plans, events = Plans(tmp_path), Recorded()
    backend = scripted(success(logs={0: ["step 1 done"]}))
    outcome = run(plans, backend, events=events)

    assert outcome.status == RunStatus.SUCCEEDED and outcome.ok and outcome.failure is None
    assert (outcome.world_size, outcome.restarts, outcome.script) == (2, 0, False)
    assert [r.status for r in outcome.reports] == [OK, OK]
    assert [r.result for r in outcome.reports] == [{"rank": 0}, {"rank": 1}]
    assert [r.rendezvous for r in outcome.reports] == [f"127.0.0.1:{FIRST_PORT}"] * 2
    (b,) = backend.instances
    # the group ended by itself: no poll after the teardown, which happens exactly once
    assert b.calls == ["start", "poll", "poll", "poll", "stop", "collect"]
    assert outcome.started_at <= outcome.ended_at
    assert set(outcome.load_avg) == {"start", "end"}
    assert all(len(v) == 3 and all(isinstance(x, float) for x in v) for v in outcome.load_avg.values())
    # the worker config every rank reads, written before the start
    assert WorkerConfig.from_json(plans.paths.worker_config.read_text()) == plans.made[0].worker
    # result reports name only log files that exist
    assert outcome.reports[0].log == str(plans.paths.log(0)) and Path(outcome.reports[0].log).read_text() == "step 1 done\n"
    assert outcome.reports[1].log is None and not plans.paths.log(1).exists()
    # progress read from the beacons while it ran
    assert [p.phases for p in events.progresses] == [{"rendezvous": 2}, {"running": 2}]
    assert [r.phase for r in events.progresses[-1].ranks] == ["running", "running"]
    assert events.messages == []


def test_reports_an_engine_brings_back_in_collect_are_read(tmp_path: Path) -> None:
    """A remote engine's collect() delivers the reports its live channel missed: they count."""
    backend = scripted(Attempt(polls=[Step(status=DONE_OK)], on_collect=Step(reports={0: OK, 1: OK})))
    outcome = run(Plans(tmp_path), backend)
    assert outcome.status == RunStatus.SUCCEEDED
    assert [r.status for r in outcome.reports] == [OK, OK]


def test_group_that_ends_ok_with_a_rank_without_report_failed(tmp_path: Path) -> None:
    """The process layer says ok, but rank 1 never reported: stopped, at its beacon's last phase."""
    backend = scripted(Attempt(polls=[Step(beacons={0: "finished", 1: "rendezvous"}, reports={0: OK}, status=DONE_OK)]))
    outcome = run(Plans(tmp_path), backend)
    assert outcome.status == RunStatus.FAILED
    assert outcome.reports[1].status == RankStatus.STOPPED and outcome.reports[1].last_phase == "rendezvous"
    assert (outcome.reports[1].rank, outcome.reports[1].host, outcome.reports[1].device) == (1, "h", "cpu")
    failure = outcome.failure
    assert failure is not None and failure.root_cause is None
    assert failure.summary == "the group ended without a rank report" and failure.collateral_ranks == (1,)


# --- failures -------------------------------------------------------------------------------------


def test_rank_failure_report_fails_fast_without_waiting_for_the_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runloop, "FAILURE_GRACE_S", 30.0)  # a real error must not wait for it
    after_stop = Status(done=True, ok=False, rank_exits=exits((0, "SIGTERM")), detail="agent on h exited with 1")
    backend = scripted(
        Attempt(
            polls=[BOTH_RUNNING, Step(logs={1: ["loading batch 7"]}, reports={1: error("ValueError", "bad batch shape (3, 4)")})],
            after_stop=after_stop,  # the group never ends by itself
        )
    )
    clock = FakeTime.install(monkeypatch, runloop)
    outcome = run(Plans(tmp_path), backend)
    assert clock.elapsed < runloop.FAILURE_GRACE_S  # the loop's own clock: it never waited out the grace

    (b,) = backend.instances
    assert b.polls_before_stop == 2  # stopped on the poll that saw the report
    assert b.calls == ["start", "poll", "poll", "stop", "collect", "poll"]
    assert outcome.status == RunStatus.FAILED and outcome.failure is not None
    failure = outcome.failure
    assert failure.reason == FailureReason.FAILED
    root = failure.root_cause
    assert root is not None and (root.rank, root.host, root.local_rank, root.device) == (1, "h", 1, "cpu")
    assert (root.type, root.message) == ("ValueError", "bad batch shape (3, 4)")
    assert "raise ValueError" in root.traceback and root.log_tail == ("loading batch 7",)
    assert failure.summary == "rank 1 on h (cpu): ValueError: bad batch shape (3, 4)"
    assert failure.collateral_ranks == (0,) and failure.stuck_ranks == ()
    assert outcome.reports[0].status == RankStatus.STOPPED and outcome.reports[0].last_phase == "running"
    assert outcome.reports[1].status == RankStatus.FAILED and outcome.reports[1].error.type == "ValueError"
    assert outcome.rendezvous_port_in_use is False


def test_rank_killed_by_a_signal_is_the_root_cause_and_its_peer_collateral(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 is SIGKILLed (no report; only the process layer knows); rank 0 then reports the
    lost connection. The loop waits for the process layer rather than blaming rank 0."""
    monkeypatch.setattr(runloop, "FAILURE_GRACE_S", 30.0)  # the group's end comes well before it
    died = Status(done=True, ok=False, rank_exits=exits((1, "SIGKILL")), detail="agent on h exited with 1")
    backend = scripted(Attempt(polls=[BOTH_RUNNING, Step(reports={0: peer_loss()}), Step(), Step(status=died)]))
    clock = FakeTime.install(monkeypatch, runloop)
    outcome = run(Plans(tmp_path), backend)
    assert clock.elapsed < runloop.FAILURE_GRACE_S  # the loop's own clock: ended with the group, not the grace

    (b,) = backend.instances
    assert b.polls_before_stop == 4 and b.calls[-2:] == ["stop", "collect"]
    failure = outcome.failure
    assert outcome.status == RunStatus.FAILED and failure is not None
    root = failure.root_cause
    assert root is not None and (root.rank, root.host, root.local_rank, root.device) == (1, "h", 1, "cpu")
    assert (root.type, root.signal, root.exitcode) == ("KilledBySignal", "SIGKILL", None)
    assert root.message == "killed by SIGKILL"
    assert failure.collateral_ranks == (0,)
    assert outcome.reports[1].status == RankStatus.STOPPED and outcome.reports[1].last_phase == "running"


def test_peer_loss_alone_waits_the_grace_before_failing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only "a peer is gone" so far: the process layer gets FAILURE_GRACE_S to say who died."""
    after_stop = Status(done=True, ok=False, rank_exits=exits((1, "SIGKILL")))
    backend = scripted(Attempt(polls=[BOTH_RUNNING, Step(reports={0: peer_loss()})], after_stop=after_stop))
    clock = FakeTime.install(monkeypatch, runloop)
    outcome = run(Plans(tmp_path), backend)

    (b,) = backend.instances
    # the loop's own clock: it waited the whole grace, and stopped on the first turn after it
    assert runloop.FAILURE_GRACE_S <= clock.elapsed <= runloop.FAILURE_GRACE_S + 3 * runloop.MIN_TURN_S, clock.elapsed
    assert b.polls_before_stop >= 3  # kept polling through the grace
    assert outcome.status == RunStatus.FAILED
    root = outcome.failure.root_cause
    # what the process layer said after the stop still names the rank that died
    assert root is not None and (root.rank, root.type) == (1, "KilledBySignal")
    assert outcome.failure.collateral_ranks == (0,)


def test_a_real_error_during_the_grace_fails_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runloop, "FAILURE_GRACE_S", 30.0)
    now = time.time()
    backend = scripted(
        Attempt(
            polls=[
                Step(reports={0: peer_loss(at=now)}),
                Step(),
                Step(reports={1: error("ZeroDivisionError", "division by zero", at=now - 0.5)}),
            ]
        )
    )
    outcome = run(Plans(tmp_path), backend)
    assert backend.instances[0].polls_before_stop == 3
    root = outcome.failure.root_cause
    assert root is not None and (root.rank, root.type) == (1, "ZeroDivisionError")
    assert outcome.failure.collateral_ranks == (0,)


def test_a_failure_to_start_propagates_after_the_engine_tore_down(tmp_path: Path) -> None:
    """An engine that cannot start stops what it started itself; the run loop has no handle to stop."""
    backend = scripted(Attempt(start_error=BackendError("cannot start the torchrun agent for h: boom")))
    with pytest.raises(LauncherError, match="boom"):
        run(Plans(tmp_path), backend)
    (b,) = backend.instances
    assert b.calls == ["start", "stop"]


# --- restarts and port retries --------------------------------------------------------------------


def failing(message: str, *, log: str | None = None) -> Attempt:
    return Attempt(
        polls=[BOTH_RUNNING, Step(logs={0: [log]} if log else {}, reports={0: error("RuntimeError", message)})],
        after_stop=Status(done=True, ok=False, rank_exits=exits((1, "SIGTERM"))),
    )


def test_a_failed_attempt_is_archived_and_the_restart_succeeds(tmp_path: Path) -> None:
    plans, events = Plans(tmp_path, "max_restarts: 1\nrestart_on: [all]\n"), Recorded()
    backend = scripted(failing("flaky", log="first try"), success())
    outcome = run(plans, backend, events=events)

    assert outcome.status == RunStatus.SUCCEEDED and outcome.restarts == 1 and outcome.failure is None
    assert plans.asked == [0, 1]
    first, second = backend.instances
    assert (first.plan.rendezvous.port, second.plan.rendezvous.port) == (FIRST_PORT, FIRST_PORT + 1)
    assert all((b.count("stop"), b.count("collect")) == (1, 1) for b in backend.instances)
    assert events.messages == ["restarting the group (restart 1 of 1 (job_error))"]
    # the first attempt's reports, beacons and logs moved aside; the stage's own are the second's
    archive = plans.paths.root / "attempt0"
    archived = json.loads((archive / "reports" / "rank0.json").read_text())
    assert archived["status"] == "failed" and archived["error"]["message"] == "flaky"
    assert (archive / "logs" / "rank0.log").read_text() == "first try\n"
    assert json.loads((archive / "progress" / "rank1.json").read_text())["phase"] == "running"
    assert [r.status for r in outcome.reports] == [OK, OK]
    assert [r.rendezvous for r in outcome.reports] == [f"127.0.0.1:{FIRST_PORT + 1}"] * 2
    assert [r.log for r in outcome.reports] == [None, None]  # attempt0's log is not this attempt's


def test_restarts_exhausted_report_the_last_attempt(tmp_path: Path) -> None:
    plans = Plans(tmp_path, "max_restarts: 1\nrestart_on: [all]\n")
    backend = scripted(failing("first"), failing("second"))
    outcome = run(plans, backend)
    assert outcome.status == RunStatus.FAILED and outcome.restarts == 1
    assert outcome.failure.root_cause.message == "second"
    assert (plans.paths.root / "attempt0" / "reports" / "rank0.json").exists()
    assert not (plans.paths.root / "attempt1").exists()
    assert set(outcome.load_avg) == {"start", "end"}


def port_taken(port: int) -> Attempt:
    return Attempt(
        polls=[
            Step(
                status=Status(
                    done=True, ok=False, detail=f"rendezvous port {port} on h was already in use", rendezvous_port_in_use=True
                )
            )
        ]
    )


def test_a_taken_rendezvous_port_is_retried_on_a_new_one_without_a_restart(tmp_path: Path) -> None:
    plans, events = Plans(tmp_path), Recorded()  # max_restarts: 0
    backend = scripted(port_taken(FIRST_PORT), port_taken(FIRST_PORT + 1), success())
    outcome = run(plans, backend, events=events)

    assert outcome.status == RunStatus.SUCCEEDED and outcome.restarts == 0
    assert plans.asked == [0, 0, 0]  # the same attempt, on a new port each time
    assert [b.plan.rendezvous.port for b in backend.instances] == [FIRST_PORT, FIRST_PORT + 1, FIRST_PORT + 2]
    for n in (1, 2):
        assert (plans.paths.root / f"port-retry{n}" / "reports").is_dir()
        assert (plans.paths.root / f"port-retry{n}" / "logs").is_dir()
    assert not (plans.paths.root / "port-retry3").exists() and not (plans.paths.root / "attempt0").exists()
    assert len(events.messages) == 2 and f"rendezvous port {FIRST_PORT} was taken" in events.messages[0]
    assert f"rendezvous port {FIRST_PORT + 1} was taken" in events.messages[1]


def test_port_retries_are_bounded(tmp_path: Path) -> None:
    plans = Plans(tmp_path)
    backend = scripted(*(port_taken(FIRST_PORT + i) for i in range(runloop.PORT_RETRIES + 1)))
    outcome = run(plans, backend)
    assert len(backend.instances) == runloop.PORT_RETRIES + 1
    assert outcome.status == RunStatus.FAILED and outcome.rendezvous_port_in_use and outcome.restarts == 0
    last = FIRST_PORT + runloop.PORT_RETRIES
    assert outcome.failure.summary == f"rendezvous port {last} on h was already in use"
    assert outcome.failure.root_cause is None


def test_a_taken_port_is_not_retried_after_a_stop_request(tmp_path: Path) -> None:
    stop = StopRequest()
    taken = port_taken(FIRST_PORT).polls[0].status
    backend = scripted(Attempt(polls=[Step(status=taken, effect=lambda b: stop.set("SIGINT"))]))
    outcome = run(Plans(tmp_path), backend, stop=stop)
    assert len(backend.instances) == 1 and outcome.status == RunStatus.FAILED


# --- timeout and stop -----------------------------------------------------------------------------


def test_run_timeout_dumps_stacks_and_names_the_stuck_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plans = Plans(tmp_path, "timeouts: {run_s: 0.2}\nmax_restarts: 2\n")
    backend = scripted(
        Attempt(
            polls=[BOTH_RUNNING, Step(beacons={0: "finished"}, reports={0: OK})],
            after_stop=Status(done=True, ok=False, rank_exits=exits((1, "SIGTERM"))),
        )
    )
    clock = FakeTime.install(monkeypatch, runloop)
    outcome = run(plans, backend)
    assert clock.elapsed >= 0.2  # the loop's own clock: run_s was honoured

    (b,) = backend.instances  # a timeout is not restarted
    assert b.signals == [signal.SIGUSR1]
    assert b.calls[-4:] == ["signal_ranks:SIGUSR1", "stop", "collect", "poll"]  # stacks dumped before the stop
    assert outcome.status == RunStatus.TIMEOUT and outcome.restarts == 0
    failure = outcome.failure
    assert failure.reason == FailureReason.TIMEOUT and failure.root_cause is None
    assert failure.stuck_ranks == (1,)
    assert failure.summary == "run exceeded timeouts.run_s=0.2s; stuck ranks: [1]"
    assert outcome.reports[1].status == RankStatus.STOPPED and outcome.reports[1].last_phase == "running"
    assert outcome.reports[0].ok


def counting(*steps_of: int) -> Step:
    """Every rank running, rank k at ``steps_of[k]`` steps (a fresh beacon each time)."""
    return Step(effect=lambda stage: [stage.beacon(rank, "running", steps=n) for rank, n in enumerate(steps_of)])


def stalled_evidence() -> list[RankEvidence]:
    """Rank 0 waits in all-reduce #8, rank 1 sleeps before it (its last was #7)."""
    frame = lambda line, code: StackFrame("run", "/job/train.py", line, code)  # noqa: E731
    c10d = StackFrame("all_reduce", "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 3252)
    calls = lambda last: tuple(CollectiveCall(n, "all_reduce", "scheduled", ((8,),)) for n in range(last - 1, last + 1))  # noqa: E731
    return [
        RankEvidence(0, "h", 100, "sleeping", "py-spy", (ThreadStack("MainThread", (c10d, frame(95, "dist.all_reduce(g)")), True),), calls(8), True,
                     phases={"spawned": 1.0, "imported": 2.0, "joined": 2.5, "pg_ready": 2.6, "first_step": 3.0}),  # fmt: skip
        RankEvidence(1, "h", 101, "sleeping", "py-spy", (ThreadStack("MainThread", (frame(88, "time.sleep(60)"),), True),), calls(7), True),
    ]


def test_a_stage_whose_ranks_stop_counting_is_hung_with_the_evidence_kept(tmp_path: Path) -> None:
    plans = Plans(tmp_path, "timeouts: {hang_s: 0.3, on_hang: stop}\nmax_restarts: 2\n")
    # then the beacons keep coming (the ranks' beacon threads live on), their counts frozen
    backend = scripted(Attempt(polls=[counting(1, 1), counting(5, 5), *[counting(8, 7)] * 5000], evidence=stalled_evidence()))
    events = Recorded()
    outcome = run(plans, backend, events=events)
    (b,) = backend.instances  # on_hang: stop restarts nothing, whatever restart_on says
    assert b.calls[-4:] == ["gather_evidence", "stop", "collect", "poll"]  # the evidence while the ranks still ran
    assert outcome.status == RunStatus.HUNG and outcome.restarts == 0
    failure = outcome.failure
    assert failure.reason == FailureReason.HUNG and failure.stuck_ranks == (1,) and failure.hang is not None
    assert failure.summary.startswith("rank 1 on h (cpu) has not reached all_reduce #8 (its last was #7) — it is at train.py:88 time.sleep(60)")
    assert any(m.startswith("stalled: no rank advanced for 0 s (ranks 1 (h, step 7), 0 (h, step 8))") for m in events.messages), events.messages
    hang_dir = plans.paths.hang_dir
    assert json.loads((hang_dir / "diagnosis.json").read_text())["culprits"][0]["rank"] == 1
    assert json.loads((hang_dir / "evidence_rank0.json").read_text())["collectives"][-1]["seq"] == 8
    assert "time.sleep(60)" in (hang_dir / "stacks.txt").read_text()
    # the phases a stopped rank gave in its evidence date its report (the summary table's columns)
    assert outcome.reports[0].status == RankStatus.STOPPED and outcome.reports[0].phases["imported"] == 2.0


def test_on_hang_restart_counts_against_max_restarts_and_keeps_each_diagnosis(tmp_path: Path) -> None:
    plans = Plans(tmp_path, "timeouts: {hang_s: 0.3, on_hang: restart}\nmax_restarts: 1\n")
    hung = Attempt(polls=[counting(1, 1), *[counting(3, 2)] * 5000], evidence=stalled_evidence())
    backend = scripted(hung, hung)
    outcome = run(plans, backend)
    assert len(backend.instances) == 2 and outcome.status == RunStatus.HUNG and outcome.restarts == 1
    assert (plans.paths.root / "attempt0" / "hang" / "diagnosis.json").is_file() and (plans.paths.hang_dir / "diagnosis.json").is_file()


def test_an_engine_without_evidence_has_the_ranks_dump_their_stacks_and_names_the_stalled(tmp_path: Path) -> None:
    plans = Plans(tmp_path, "timeouts: {hang_s: 0.3}\n")
    backend = scripted(Attempt(polls=[counting(1, 1), *[counting(9, 9)] * 5000]))
    outcome = run(plans, backend)
    (b,) = backend.instances
    assert b.signals == [signal.SIGUSR1] and outcome.status == RunStatus.HUNG
    assert outcome.failure is not None and outcome.failure.hang is not None
    assert outcome.failure.summary.startswith("no rank stands out: all stalled for")


def test_no_hang_while_steps_advance_or_before_any_step(tmp_path: Path) -> None:
    plans = Plans(tmp_path, "timeouts: {hang_s: 0.3}\n")
    slow_start = [counting(0, 0)] * 3 + [Step(effect=lambda s: time.sleep(0.4))] + [counting(0, 0)] * 3
    advancing = [counting(n, n) for n in range(1, 40)]
    done = Step(beacons={0: "finished", 1: "finished"}, reports={0: OK, 1: OK}, status=DONE_OK)
    outcome = run(plans, scripted(Attempt(polls=[*slow_start, *advancing, done])))
    assert outcome.status == RunStatus.SUCCEEDED, outcome.failure


def test_stop_request_from_another_thread_interrupts_with_no_collateral(tmp_path: Path) -> None:
    stop = StopRequest()
    after_stop = Status(done=True, ok=False, rank_exits=exits((0, "SIGTERM"), (1, "SIGTERM")))
    backend = scripted(Attempt(polls=[BOTH_RUNNING], after_stop=after_stop))
    timer = threading.Timer(0.02, stop.set, args=("SIGINT",))
    timer.start()
    try:
        outcome = run(Plans(tmp_path, "max_restarts: 1\n"), backend, stop=stop)
    finally:
        timer.cancel()

    assert len(backend.instances) == 1  # an interrupted stage is not restarted
    assert outcome.status == RunStatus.INTERRUPTED
    failure = outcome.failure
    assert failure.reason == FailureReason.INTERRUPTED and failure.summary == "interrupted (SIGINT)"
    assert failure.root_cause is None and failure.collateral_ranks == () and failure.stuck_ranks == ()
    assert [r.status for r in outcome.reports] == [RankStatus.STOPPED, RankStatus.STOPPED]


def test_stop_request_at_a_given_poll(tmp_path: Path) -> None:
    stop = StopRequest()

    def ctrl_c(b: object) -> None:
        stop.set("SIGTERM")
        stop.set("SIGINT")  # the first reason stays

    backend = scripted(Attempt(polls=[BOTH_RUNNING, Step(), Step(effect=ctrl_c)]))
    outcome = run(Plans(tmp_path), backend, stop=stop)
    (b,) = backend.instances
    # the notice goes out with the stop; no job watches it, so the stage is stopped a moment later
    assert b.calls[:5] == ["start", "poll", "poll", "poll", "signal_ranks:SIGUSR2"] and b.calls[-3:] == ["stop", "collect", "poll"]
    assert outcome.status == RunStatus.INTERRUPTED
    assert outcome.failure.summary == "interrupted (SIGTERM)" and outcome.failure.collateral_ranks == ()
    assert [r.last_phase for r in outcome.reports] == ["running", "running"]


# --- secrets --------------------------------------------------------------------------------------


def test_a_secret_in_a_rank_error_is_masked_in_the_outcome_and_on_disk(tmp_path: Path) -> None:
    plans = Plans(tmp_path, f"env: {{MY_TOKEN: {SECRET}}}\n")

    def torchelastic_copy(b: object) -> None:  # torchrun's raw copy of a rank's output
        path = plans.paths.agent_log_dir(0) / "attempt_0" / "1" / "error.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'{{"message": "login refused for {SECRET}"}}')

    rank_error = error("PermissionError", f"login refused for token {SECRET}")
    backend = scripted(
        Attempt(
            polls=[BOTH_RUNNING, Step(logs={1: [f"using token {SECRET}"]}, reports={1: rank_error}, effect=torchelastic_copy)],
            after_stop=STOPPED,
        )
    )
    outcome = run(plans, backend)

    report = outcome.reports[1]
    assert report.error.message == f"login refused for token {MASK}"
    assert SECRET not in report.error.traceback and MASK in report.error.traceback
    root = outcome.failure.root_cause
    assert root.message == f"login refused for token {MASK}" and root.log_tail == (f"using token {MASK}",)
    assert SECRET not in outcome.failure.summary
    on_disk = json.loads(plans.paths.report(1).read_text())
    assert on_disk["error"]["message"] == f"login refused for token {MASK}"
    leaks = [p for p in plans.run_dir.rglob("*") if p.is_file() and SECRET in p.read_text(errors="replace")]
    assert leaks == []


# --- the StopRequest a caller hands in ------------------------------------------------------------


def test_run_job_hands_the_callers_stop_request_to_the_run_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.control import api

    class Reached(Exception):
        pass

    seen: list[StopRequest] = []

    def run_stages(loaded, engine, pool, sizing, run_dir, stop, events, *, kept=None):  # noqa: ANN001, ANN202
        seen.append(stop)
        raise Reached

    monkeypatch.setattr(api, "preflight_nodes", lambda job, cluster: ([NODE], None))
    monkeypatch.setattr(api, "_run_stages", run_stages)
    mine = StopRequest()  # a notebook keeps it, to stop the run from another thread later
    with pytest.raises(Reached):
        api.run_job(Plans(tmp_path).job, out=tmp_path / "runs", events=RunEvents(), stop=mine)
    assert seen == [mine] and seen[0] is mine


# --- restarts by failure class, checkpoints, stop notices ---------------------------------------


def beacon(rank: int, steps: int, **fields: object) -> Callable[[FakeStage], None]:
    """A beacon with the checkpoint/notice fields a rank's runtime adds (``ckpt_step`` ...)."""
    return lambda stage: stage.emit(RankBeacon(rank, RankProgress(phase="running", steps=steps, t=time.time(), **fields)))  # type: ignore[arg-type]


def killed_after_a_checkpoint() -> Attempt:
    """Rank 1 is SIGKILLed at step 13; rank 0 saved step 40 at its step 10."""
    died = Status(done=True, ok=False, rank_exits=exits((1, "SIGKILL")))
    saved = Step(effect=lambda s: (beacon(0, 10, ckpt_step=40, ckpt_at=10)(s), beacon(1, 10)(s)))
    later = Step(effect=lambda s: (beacon(0, 13, ckpt_step=40, ckpt_at=10)(s), beacon(1, 13)(s)))
    return Attempt(polls=[BOTH_RUNNING, saved, later, Step(reports={0: peer_loss()}), Step(status=died)])


def resumed(step: int) -> Attempt:
    go = Step(effect=lambda s: (beacon(0, 1, resumed_step=step, ckpt_step=step, ckpt_at=0)(s), beacon(1, 1, resumed_step=step)(s)))
    done = Step(beacons={0: "finished", 1: "finished"}, reports={0: OK, 1: OK}, status=DONE_OK)
    return Attempt(polls=[BOTH_RUNNING, go, Step(), done])


def test_a_lost_rank_restarts_by_default_and_the_record_says_from_where_and_what_was_lost(tmp_path: Path) -> None:
    events = Recorded()
    outcome = run(Plans(tmp_path, "max_restarts: 1\n"), scripted(killed_after_a_checkpoint(), resumed(40)), events=events)
    assert outcome.status == RunStatus.SUCCEEDED and outcome.restarts == 1
    first, second = outcome.attempts
    assert (first.failure_class, first.restarted, first.checkpoint_step, first.steps, first.lost_steps) == (FailureClass.RANK_LOST, True, 40, 13, 3)
    assert first.cause == "rank 1 on h (cpu): KilledBySignal: killed by SIGKILL"
    assert (second.failure_class, second.resumed_step, second.lost_steps, second.status) == (None, 40, None, RunStatus.SUCCEEDED)
    assert "restarting the group (restart 1 of 1 (rank_lost)); the job resumes from the checkpoint of step 40, 3 step(s) of work lost" in events.messages
    assert "attempt 2: the job resumed from the checkpoint of step 40" in events.messages


def test_a_job_error_is_not_restarted_by_default(tmp_path: Path) -> None:
    events = Recorded()
    backend = scripted(failing("bad shape"), success())
    outcome = run(Plans(tmp_path, "max_restarts: 3\n"), backend, events=events)
    assert len(backend.instances) == 1 and outcome.status == RunStatus.FAILED
    (only,) = outcome.attempts
    assert only.failure_class == FailureClass.JOB_ERROR and not only.restarted
    assert only.decision.startswith("job_error is not in restart_on (hang, host_lost, oom, rank_lost, rendezvous)")
    assert outcome.failure.failure_class == FailureClass.JOB_ERROR
    assert events.messages == [f"not restarted: {only.decision}"]


def test_with_restart_on_all_a_job_error_restarts_once_and_stops_when_its_traceback_repeats(tmp_path: Path) -> None:
    backend = scripted(failing("bad shape"), failing("bad shape"), success())
    outcome = run(Plans(tmp_path, "max_restarts: 5\nrestart_on: [all]\n"), backend)
    assert len(backend.instances) == 2 and outcome.status == RunStatus.FAILED and outcome.restarts == 1
    first, second = outcome.attempts
    assert first.restarted and not second.restarted
    assert second.decision.startswith("the job raised the same error, with the same traceback, as the attempt before")


def test_a_hang_restarts_as_restart_on_says_unless_on_hang_says_stop(tmp_path: Path) -> None:
    hung = Attempt(polls=[counting(1, 1), *[counting(3, 2)] * 5000], evidence=stalled_evidence())
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    restarted = run(Plans(tmp_path / "a", "timeouts: {hang_s: 0.3}\nmax_restarts: 1\n"), scripted(hung, success()))
    assert restarted.status == RunStatus.SUCCEEDED and restarted.attempts[0].failure_class == FailureClass.HANG
    kept = run(Plans(tmp_path / "b", "timeouts: {hang_s: 0.3, on_hang: stop}\nmax_restarts: 1\nrestart_on: [all]\n"), scripted(hung))
    assert kept.status == RunStatus.HUNG and kept.attempts[0].decision.startswith("hang is not in restart_on")


def test_a_stop_notice_lets_a_watching_job_save_and_return_and_the_stage_is_preempted(tmp_path: Path) -> None:
    stop = StopRequest()
    watching = Step(effect=lambda s: (beacon(0, 5, watches_stop=True)(s), beacon(1, 5, watches_stop=True)(s)))
    ctrl_c = Step(effect=lambda s: stop.set("SIGTERM"))
    # after the notice the ranks save step 6 and return: the group ends on its own, every rank ok
    saved = Step(effect=lambda s: beacon(0, 6, watches_stop=True, ckpt_step=6, ckpt_at=6)(s))
    done = Step(beacons={0: "finished", 1: "finished"}, reports={0: OK, 1: OK}, status=DONE_OK)
    backend = scripted(Attempt(polls=[BOTH_RUNNING, watching, ctrl_c, saved, done]))
    events = Recorded()
    plans = Plans(tmp_path, "max_restarts: 2\npreemption: {grace_s: 30}\n")
    outcome = run(plans, backend, stop=stop, events=events)
    (b,) = backend.instances
    assert b.signals == [signal.SIGUSR2] and b.calls.index("signal_ranks:SIGUSR2") < b.calls.index("stop")
    assert outcome.status == RunStatus.INTERRUPTED and len(outcome.attempts) == 1  # never restarted
    failure = outcome.failure
    assert failure.failure_class == FailureClass.PREEMPTED and failure.reason == FailureReason.INTERRUPTED
    assert failure.summary == f"stopped after a notice (SIGTERM): its last checkpoint is step 6; continue with: launch resume {plans.run_dir}"
    assert any(m.startswith("stop notice sent to every rank: 30s to save a checkpoint") for m in events.messages)


def test_a_stop_notice_that_the_ranks_do_not_answer_in_time_stops_them(tmp_path: Path) -> None:
    stop = StopRequest()
    watching = Step(effect=lambda s: (beacon(0, 5, watches_stop=True)(s), stop.set("SIGINT")))
    backend = scripted(Attempt(polls=[BOTH_RUNNING, watching]))  # then running for ever
    outcome = run(Plans(tmp_path, "preemption: {grace_s: 0.2}\n"), backend, stop=stop)
    (b,) = backend.instances
    assert b.signals == [signal.SIGUSR2] and b.count("stop") == 1
    assert outcome.status == RunStatus.INTERRUPTED and outcome.failure.failure_class == FailureClass.PREEMPTED
    assert "it saved no checkpoint" in outcome.failure.summary


def test_a_stop_without_a_watching_job_stops_it_without_waiting_the_grace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stop = StopRequest()
    backend = scripted(Attempt(polls=[BOTH_RUNNING, Step(effect=lambda s: stop.set("SIGINT"))]))
    clock = FakeTime.install(monkeypatch, runloop)
    outcome = run(Plans(tmp_path, "preemption: {grace_s: 30}\n"), backend, stop=stop)
    (b,) = backend.instances
    # the loop's own clock: it listened NOTICE_LISTEN_S (0.05 s here) for a watching job, then stopped, not after the 30 s grace
    assert runloop.NOTICE_LISTEN_S <= clock.elapsed <= runloop.NOTICE_LISTEN_S + 3 * runloop.MIN_TURN_S, clock.elapsed
    assert b.signals == [signal.SIGUSR2] and outcome.status == RunStatus.INTERRUPTED
    assert outcome.failure.failure_class == FailureClass.STOPPED and outcome.failure.summary == "interrupted (SIGINT)"
