"""The one run loop, shared by every engine, and the only place that decides a stage's fate.

start -> watch the stage's event stream -> on the first failure, a timeout or a signal: stop
everything -> collect -> explain the root cause. Restarts (``max_restarts``) and rendezvous-port
retries happen here too, so every engine gets the same semantics. What the ranks do reaches it as
typed events through the engine's handle (``launcher.stage.events``); it reads no rank's files.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from launcher.control import cpuclock
from launcher.control.diagnosis import explain_failure
from launcher.control.hangs import Stall, StallWatch, diagnose, stacks_text
from launcher.control.restarts import AttemptProgress, attempt_record, classify, decide, error_signature
from launcher.control.stagestate import StageState
from launcher.control.stragglers import StragglerWatch
from launcher.masking import scrub_files, secret_values
from launcher.procutil import read_json, write_json_atomic
from launcher.protocol import HOST_LOST, STOP_NOTICE_SIGNAL, RankProgress, RankReport, is_peer_loss
from launcher.policies import FailureClass
from launcher.records import AttemptRecord, Failure, FailureReason, HangDiagnosis, RunStatus, StageOutcome
from launcher.stage.engine import HandleStatus, StageEngine, StageHandle
from launcher.stage.logrouting import LogRouter
from launcher.stage.plan import StagePlan
from launcher.stage.watch import RunEvents

POLL_S = 0.05
# each turn of the watch lasts at least this long: the events of a thousand ranks, arriving all
# the time, are taken a batch at a time (a failure is still seen within a turn)
MIN_TURN_S = 0.05
PROGRESS_EVERY_S = 0.5
# After the first rank's error report, how long the process layer may take to end by itself
# (an agent notices its dead worker and reports its exit code or signal) before we stop it all.
FAILURE_GRACE_S = 2.0
STACK_DUMP_WAIT_S = 1.0
# Tries on a freshly chosen rendezvous port when another process took the one we chose before
# the agent bound it (not restarts: nothing of the job ran).
PORT_RETRIES = 3
# After a stop notice, how long to listen for a rank saying its job watches ctx.should_stop before
# stopping the stage at once (a job that began watching just now: its beacon is on its way)
NOTICE_LISTEN_S = 1.5


class StopRequest:
    """Set from a signal handler (Ctrl-C, SIGTERM) or another thread; read by the run loop."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        self.reason = self.reason or reason
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()


def load_average() -> tuple[float, float, float]:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:  # not available on this platform
        return (0.0, 0.0, 0.0)
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def run_stage(
    make_plan: Callable[[int], StagePlan],
    engine: StageEngine,
    *,
    stop: StopRequest,
    events: RunEvents | None = None,
    replace_hosts: Callable[[set[str]], str] | None = None,
    adopt_hosts: Callable[[Sequence[str]], str] | None = None,
) -> StageOutcome:
    """Run one stage to its end, restarting the group for the failures ``restart_on`` names, up
    to ``max_restarts`` times; each restart's job resumes from the last complete checkpoint.
    ``replace_hosts``: before a restart for lost hosts, have ``make_plan`` use others (spares).
    ``adopt_hosts``: after an attempt whose engine moved a lost host's ranks to a spare in place,
    have ``make_plan`` use the hosts it ended on from then on."""
    events = events or RunEvents()
    attempt = port_retries = 0
    started, load_at_start = time.time(), load_average()
    attempts: list[AttemptRecord] = []
    previous_error = ""
    while True:
        plan = make_plan(attempt)  # a freshly chosen rendezvous port every time
        outcome, progress, moved = _run_attempt(plan, engine, stop=stop, events=events, restarts=attempt)
        if moved and adopt_hosts is not None and (said := adopt_hosts(moved)):
            events.message(said)
        attempt_started, outcome.started_at, outcome.restarts = outcome.started_at, started, attempt
        if outcome.rendezvous_port_in_use and port_retries < PORT_RETRIES and not stop:
            port_retries += 1
            _archive_attempt(plan, f"port-retry{port_retries}")
            events.message(f"rendezvous port {plan.rendezvous.port} was taken before the agent bound it; trying another")
            continue
        failure_class = classify(outcome)
        decision = decide(plan.restart, outcome, failure_class, attempt=attempt, previous_error=previous_error, stopping=bool(stop))
        attempts.append(attempt_record(outcome, progress, failure_class, decision, attempt=attempt, started_at=attempt_started))
        outcome.attempts = list(attempts)
        if outcome.failure is not None and failure_class is not None:
            outcome.failure = replace(outcome.failure, failure_class=failure_class)
        if not decision.restart:
            if failure_class not in (None, FailureClass.STOPPED, FailureClass.PREEMPTED) and plan.max_restarts:
                events.message(f"not restarted: {decision.why}")
            outcome.load_avg = {"start": load_at_start, "end": load_average()}
            return outcome
        if failure_class == FailureClass.JOB_ERROR and outcome.failure is not None:
            previous_error = error_signature(outcome.failure.root_cause)
        attempt += 1
        _archive_attempt(plan, f"attempt{attempt - 1}")
        lost = {r.host for r in outcome.reports if r.error is not None and r.error.type == HOST_LOST}
        if failure_class == FailureClass.HOST_LOST and lost and replace_hosts is not None and (said := replace_hosts(lost)):
            events.message(said)
        saved = f"; the job resumes from the checkpoint of step {progress.checkpoint_step}, {progress.lost_steps} step(s) of work lost" if progress.checkpoint_step is not None else ""
        events.message(f"restarting the group ({decision.why}){saved}")


def _archive_attempt(plan: StagePlan, folder: str) -> None:
    archive = plan.stage_dir / folder
    archive.mkdir(parents=True, exist_ok=True)  # a rename, not a copy of the logs
    for src in (plan.paths.reports, plan.paths.progress_dir, plan.paths.logs, plan.paths.hang_dir):
        if src.exists():
            shutil.move(str(src), str(archive / src.name))


@dataclass
class _Watch:
    """What one attempt's watch ended with."""

    fate: RunStatus
    status: HandleStatus | None = None
    hang: HangDiagnosis | None = None
    noticed: bool = False  # the ranks were told to stop and given the grace to save first


def _run_attempt(
    plan: StagePlan, engine: StageEngine, *, stop: StopRequest, events: RunEvents, restarts: int
) -> tuple[StageOutcome, AttemptProgress, list[str]]:
    """One attempt of the stage: its outcome, how far it got, and the hosts it ended on where its
    engine moved a lost host's ranks to a spare in place (else none)."""
    plan.paths.reports.mkdir(parents=True, exist_ok=True)
    plan.paths.worker_config.write_text(plan.worker.to_json())
    secrets = secret_values(plan.spec_env)
    logs = LogRouter(plan.paths.logs, events.rank_output, secrets=secrets)
    t0 = time.time()
    state = StageState(plan, t0, restarts)
    stragglers = StragglerWatch(plan.stragglers)
    handle: StageHandle | None = None
    try:
        cpuclock.mark("plan")
        handle = engine.start(plan, logs)  # an engine that cannot start has stopped what it started
        cpuclock.mark("spawn")
        watch = _watch(handle, state, stop=stop, events=events, stragglers=stragglers, stalls=StallWatch(plan.hang))
    finally:
        cpuclock.mark("running")  # the launcher's CPU after this is the stage's end (cpuclock.AFTER_EXIT)
        if handle is not None:
            handle.stop()
            handle.collect()
        logs.close()
    assert handle is not None
    status = watch.status if watch.status is not None and watch.status.done else handle.poll()
    state.plan = handle.plan
    state.apply(handle.take_events())  # the last lines of every stream, what collect brought, how ranks ended
    scrub_files(plan.paths.torchelastic, secrets)  # torchrun's raw copies of the logs
    _store_beacons(handle.plan, state)
    reports = _store_reports(handle.plan, state.final_reports(secrets))
    fate = watch.fate
    if fate == RunStatus.SUCCEEDED and any(not r.ok for r in reports):
        fate = RunStatus.FAILED
    noticed = sorted({r.stop_notice for r in reports if r.stop_notice})
    if fate == RunStatus.SUCCEEDED and (stop or noticed):
        fate = RunStatus.INTERRUPTED  # the job returned early, for a stop notice: not finished
    progress = AttemptProgress.of(state.beacons)
    outcome = StageOutcome(plan.world_size, fate, t0, time.time(), script=plan.script_mode, reports=reports, stragglers=stragglers.flagged)
    if fate == RunStatus.INTERRUPTED and (watch.noticed or noticed):
        outcome.failure = _preempted(stop.reason or ", ".join(noticed), progress, engine.after_a_notice(plan))
    elif watch.hang is not None:
        culprits = tuple(c.rank for c in watch.hang.culprits)
        outcome.failure = Failure(FailureReason.HUNG, watch.hang.summary, stuck_ranks=culprits, hang=watch.hang)
    elif fate != RunStatus.SUCCEEDED:
        reason = {RunStatus.TIMEOUT: FailureReason.TIMEOUT, RunStatus.INTERRUPTED: FailureReason.INTERRUPTED}.get(fate, FailureReason.FAILED)
        outcome.failure = explain_failure(
            reason, reports, state.rank_exits(), detail=status.detail, run_timeout_s=plan.run_timeout_s, stop_reason=stop.reason
        )
        outcome.rendezvous_port_in_use = status.rendezvous_port_in_use
    cpuclock.mark("stage_end")
    hosts = [node.host for node in handle.plan.nodes]
    moved = hosts if plan.standby and hosts != [node.host for node in plan.nodes] else []
    return outcome, progress, moved


def _preempted(reason: str, progress: AttemptProgress, then: str) -> Failure:
    """A stop the job was told of first: where it got to, and how to go on (``then``: the engine's words)."""
    saved = f"its last checkpoint is step {progress.checkpoint_step}" if progress.checkpoint_step is not None else "it saved no checkpoint"
    summary = f"stopped after a notice ({reason}): {saved}; {then}"
    return Failure(FailureReason.INTERRUPTED, summary, failure_class=FailureClass.PREEMPTED)


def _watch(handle: StageHandle, state: StageState, *, stop: StopRequest, events: RunEvents, stragglers: StragglerWatch, stalls: StallWatch) -> _Watch:
    """Follow the stage's events until the group ends, a rank fails, the stage hangs, the run
    times out or a stop is asked for."""
    plan = handle.plan
    deadline = time.monotonic() + plan.run_timeout_s
    failed_at: float | None = None
    notice: _Notice | None = None
    next_progress = 0.0
    resumed_told = False
    while True:
        turn = time.monotonic()
        state.plan = handle.plan  # an engine that placed its ranks has the placed plan now
        state.apply(handle.take_events(POLL_S))
        status = handle.poll()
        state.apply(handle.take_events())  # what the poll routed (an agent's last lines)
        if status.done:
            return _Watch(RunStatus.SUCCEEDED if status.ok else RunStatus.FAILED, status, noticed=notice is not None)
        errors = state.errors()
        if any(not is_peer_loss(e) for e in errors):
            return _Watch(RunStatus.FAILED)  # fail fast: do not wait for the others' collective timeouts
        if errors and failed_at is None:
            # only "a peer is gone" so far: let the process layer report which rank died, and how
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
            return _Watch(RunStatus.FAILED)
        if stop and notice is None:
            notice = _Notice.send(handle)
        if notice is not None and not notice.heard(state, events):
            return _Watch(RunStatus.INTERRUPTED)  # no rank's job watches ctx.should_stop: stopped now
        if notice is not None and notice.expired():
            events.message(f"the ranks did not return within preemption.grace_s={plan.restart.stop_grace_s:g}s: stopping them")
            return _Watch(RunStatus.INTERRUPTED, noticed=True)
        if time.monotonic() > deadline:
            handle.signal_ranks(signal.SIGUSR1)  # every live rank, on every host, dumps its stacks into its log
            time.sleep(STACK_DUMP_WAIT_S)
            return _Watch(RunStatus.TIMEOUT)
        if time.monotonic() >= next_progress:
            progress, changes = stragglers.update(state.progress(), handle.plan.ranks)
            for change in changes:
                events.message(change.describe())
            events.progress(progress)
            next_progress = time.monotonic() + PROGRESS_EVERY_S
            if progress.resumed_step is not None and not resumed_told:
                events.message(f"attempt {state.restarts + 1}: the job resumed from the checkpoint of step {progress.resumed_step}")
                resumed_told = True
            stall = stalls.update(progress)
            if stall is not None:
                return _Watch(RunStatus.HUNG, hang=_diagnose_hang(handle, state, stall, events))
        time.sleep(max(0.0, MIN_TURN_S - (time.monotonic() - turn)))


@dataclass
class _Notice:
    """A stop notice sent to every rank: a job that watches ``ctx.should_stop`` saves and returns
    before ``deadline``, or is stopped. Whether any does is known from the ranks' beacons; one
    that began watching just now may not have said so yet, hence ``NOTICE_LISTEN_S``."""

    sent_at: float
    grace_s: float
    watching: bool = False

    @classmethod
    def send(cls, handle: StageHandle) -> "_Notice":
        handle.signal_ranks(STOP_NOTICE_SIGNAL)  # harmless to a job that does not watch: it is stopped anyway
        return cls(time.monotonic(), handle.plan.restart.stop_grace_s)

    def heard(self, state: StageState, events: RunEvents) -> bool:
        """Whether to wait for the ranks: some rank's job watches the notice, or may still say so."""
        if not self.watching and any(b.watches_stop for b in state.beacons.values()):
            self.watching = True
            events.message(f"stop notice sent to every rank: {self.grace_s:g}s to save a checkpoint and return (again to stop at once)")
        return self.watching or time.monotonic() - self.sent_at < NOTICE_LISTEN_S

    def expired(self) -> bool:
        return time.monotonic() > self.sent_at + self.grace_s


def _diagnose_hang(handle: StageHandle, state: StageState, stall: Stall, events: RunEvents) -> HangDiagnosis:
    """While the stalled ranks still run: every rank's evidence through the engine's channel,
    kept in ``world<N>/hang/`` on this machine, and the diagnosis."""
    events.message(stall.describe())
    started = time.monotonic()
    evidence = handle.gather_evidence()
    gather_s = time.monotonic() - started
    for e in evidence:
        state.note_phases(e.rank, e.phases)  # the start-up phases of ranks that will write no report
    folder = handle.plan.paths.hang_dir
    folder.mkdir(parents=True, exist_ok=True)
    for e in evidence:
        if e.flight_record:  # beside the others' for torchfrtrace (here already, for this machine's ranks)
            handle.plan.paths.flight_record(e.rank).write_bytes(e.flight_record)
        write_json_atomic(folder / f"evidence_rank{e.rank}.json", replace(e, flight_record=b"").to_dict())
    (folder / "stacks.txt").write_text(stacks_text(evidence))
    diagnosis = diagnose(stall, evidence, handle.plan.ranks, gather_s=gather_s, evidence_dir=str(folder))
    write_json_atomic(folder / "diagnosis.json", diagnosis.to_dict())
    return diagnosis


def _store_beacons(plan: StagePlan, state: StageState) -> None:
    """Every rank's last beacon in the launching machine's stage directory, where the rank's own
    file is not here already (another host's, a Ray actor's on another node): the run's record
    of where each rank got to."""
    for rank, beacon in state.beacons.items():
        path = plan.paths.progress(rank)
        known = RankProgress.from_dict(read_json(path))
        if known.t is None or (beacon.t is not None and beacon.t > known.t):
            write_json_atomic(path, beacon.to_dict(), durable=False)


def _store_reports(plan: StagePlan, reports: list[RankReport]) -> list[RankReport]:
    """Every rank's report in the launching machine's stage directory (masked; a rank on this
    machine wrote its own there already, rewritten only where masking changed it), and each
    report's log where that file exists (result.json names only files that exist). Written a few
    at a time: a thousand durable writes one after the other hold a stage's end up for a second."""

    def store(report: RankReport) -> None:
        path = plan.paths.report(report.rank)
        data = report.to_dict()
        if read_json(path) != data:
            write_json_atomic(path, data)
        log = plan.paths.log(report.rank)
        report.log = str(log) if log.exists() else None

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(reports)))) as pool:
        list(pool.map(store, reports))
    return reports
