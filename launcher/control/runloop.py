"""The one run loop, shared by every backend, and the only place that decides a stage's fate.

start -> watch -> on the first failure, a timeout or a signal: stop everything -> collect
reports -> explain the root cause. Restarts (``max_restarts``) and rendezvous-port retries happen
here too, so every backend gets the same semantics.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from launcher.backends.base import Backend, BackendStatus
from launcher.control.diagnosis import explain_failure
from launcher.control.events import RankLive, RunEvents, StageProgress
from launcher.control.logrouting import LogRouter
from launcher.control.planning import StagePlan
from launcher.control.stragglers import StragglerWatch
from launcher.masking import redact_document, scrub_files, secret_values
from launcher.procutil import read_json, write_json_atomic
from launcher.protocol import RankError, RankProgress, RankReport, RankStatus, is_peer_loss
from launcher.records import FailureReason, RunStatus, StageOutcome

POLL_S = 0.05
PROGRESS_EVERY_S = 0.5
# After the first rank's error report, how long the process layer may take to end by itself
# (an agent notices its dead worker and reports its exit code or signal) before we stop it all.
FAILURE_GRACE_S = 2.0
STACK_DUMP_WAIT_S = 1.0
# Tries on a freshly chosen rendezvous port when another process took the one we chose before
# the agent bound it (not restarts: nothing of the job ran).
PORT_RETRIES = 3


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
    backend_cls: type[Backend],
    *,
    stop: StopRequest,
    events: RunEvents | None = None,
) -> StageOutcome:
    """Run one stage to its end, restarting the group up to ``max_restarts`` times."""
    events = events or RunEvents()
    attempt = port_retries = 0
    started, load_at_start = time.time(), load_average()
    while True:
        plan = make_plan(attempt)  # a freshly chosen rendezvous port every time
        outcome = _run_attempt(plan, backend_cls, stop=stop, events=events, restarts=attempt)
        outcome.started_at, outcome.restarts = started, attempt
        if outcome.rendezvous_port_in_use and port_retries < PORT_RETRIES and not stop:
            port_retries += 1
            _archive_attempt(plan, f"port-retry{port_retries}")
            events.message(f"rendezvous port {plan.rendezvous.port} was taken before the agent bound it; trying another")
            continue
        if outcome.ok or outcome.status != RunStatus.FAILED or attempt >= plan.max_restarts or stop:
            outcome.load_avg = {"start": load_at_start, "end": load_average()}
            return outcome
        attempt += 1
        _archive_attempt(plan, f"attempt{attempt - 1}")
        events.message(f"restarting the group (restart {attempt} of {plan.max_restarts})")


def _archive_attempt(plan: StagePlan, folder: str) -> None:
    archive = plan.stage_dir / folder
    archive.mkdir(parents=True, exist_ok=True)  # a rename, not a copy of the logs
    for src in (plan.paths.reports, plan.paths.progress_dir, plan.paths.logs):
        if src.exists():
            shutil.move(str(src), str(archive / src.name))


@dataclass
class _Watch:
    """What one attempt's watch ended with."""

    fate: RunStatus
    status: BackendStatus | None = None


def _run_attempt(plan: StagePlan, backend_cls: type[Backend], *, stop: StopRequest, events: RunEvents, restarts: int) -> StageOutcome:
    plan.paths.reports.mkdir(parents=True, exist_ok=True)
    plan.paths.worker_config.write_text(plan.worker.to_json())
    secrets = secret_values(plan.spec_env)
    logs = LogRouter(plan.paths.logs, events.rank_output, secrets=secrets)
    backend = backend_cls(plan, logs)
    t0 = time.time()
    stragglers = StragglerWatch(plan.ranks, plan.stragglers)
    try:
        backend.start()
        watch = _watch(plan, backend, stop=stop, events=events, t0=t0, restarts=restarts, stragglers=stragglers)
    finally:
        backend.stop()
        backend.collect()
        logs.close()
    status = watch.status if watch.status is not None and watch.status.done else backend.poll()
    scrub_files(plan.paths.torchelastic, secrets)  # torchrun's raw copies of the logs
    reports = load_reports(plan, secrets)
    fate = watch.fate
    if fate == RunStatus.SUCCEEDED and any(not r.ok for r in reports):
        fate = RunStatus.FAILED
    outcome = StageOutcome(plan.world_size, fate, t0, time.time(), script=plan.script_mode, reports=reports, stragglers=stragglers.flagged)
    if fate != RunStatus.SUCCEEDED:
        reason = {RunStatus.TIMEOUT: FailureReason.TIMEOUT, RunStatus.INTERRUPTED: FailureReason.INTERRUPTED}.get(fate, FailureReason.FAILED)
        outcome.failure = explain_failure(
            reason, reports, status.rank_exits, detail=status.detail, run_timeout_s=plan.run_timeout_s, stop_reason=stop.reason
        )
        outcome.rendezvous_port_in_use = status.rendezvous_port_in_use
    return outcome


def _watch(
    plan: StagePlan, backend: Backend, *, stop: StopRequest, events: RunEvents, t0: float, restarts: int, stragglers: StragglerWatch
) -> _Watch:
    """Poll until the group ends, a rank fails, the run times out or a stop is asked for."""
    deadline = time.monotonic() + plan.run_timeout_s
    failed_at: float | None = None
    next_progress = 0.0
    while True:
        status = backend.poll()
        if status.done:
            return _Watch(RunStatus.SUCCEEDED if status.ok else RunStatus.FAILED, status)
        errors = rank_errors(plan)
        if any(not is_peer_loss(e) for e in errors):
            return _Watch(RunStatus.FAILED)  # fail fast: do not wait for the others' collective timeouts
        if errors and failed_at is None:
            # only "a peer is gone" so far: let the process layer report which rank died, and how
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
            return _Watch(RunStatus.FAILED)
        if stop:
            return _Watch(RunStatus.INTERRUPTED)
        if time.monotonic() > deadline:
            backend.signal_ranks(signal.SIGUSR1)  # every live rank dumps its stacks into its log
            time.sleep(STACK_DUMP_WAIT_S)
            return _Watch(RunStatus.TIMEOUT)
        if time.monotonic() >= next_progress:
            progress, changes = stragglers.update(stage_progress(plan, t0, restarts))
            for change in changes:
                events.message(change.describe())
            events.progress(plan, progress)
            next_progress = time.monotonic() + PROGRESS_EVERY_S
        time.sleep(POLL_S)


def rank_errors(plan: StagePlan) -> list[RankError]:
    """The errors of the ranks that have reported a failure so far."""
    errors = []
    for path in plan.paths.reports.glob("rank*.json"):
        data = read_json(path)
        if isinstance(data, dict) and data.get("status") == RankStatus.FAILED.value:
            errors.append(RankError.from_dict(data.get("error") or {}))
    return errors


def stage_progress(plan: StagePlan, t0: float, restarts: int = 0) -> StageProgress:
    ranks = []
    phases: dict[str, int] = {}
    for slot in plan.ranks:
        beacon = RankProgress.from_dict(read_json(plan.paths.progress(slot.rank)))
        phases[beacon.phase] = phases.get(beacon.phase, 0) + 1
        ranks.append(RankLive(slot.rank, slot.host, beacon.phase, beacon.steps, beacon.t, beacon.work_s))
    return StageProgress(plan.world_size, time.time() - t0, tuple(ranks), restarts, phases)


def load_reports(plan: StagePlan, secrets: tuple[str, ...] = ()) -> list[RankReport]:
    """Every rank's report (masked on disk too when its text holds a secret); a rank that wrote
    none is ``stopped``, with the phase its beacon last showed."""
    reports = []
    for slot in plan.ranks:
        path = plan.paths.report(slot.rank)
        data = read_json(path)
        if isinstance(data, dict):
            masked = redact_document(data, secrets)
            if masked is not data:
                write_json_atomic(path, masked)
            report = RankReport.from_dict(masked)
        else:
            beacon = RankProgress.from_dict(read_json(plan.paths.progress(slot.rank)))
            report = RankReport(
                rank=slot.rank,
                local_rank=slot.local_rank,
                node_rank=slot.node_rank,
                world_size=plan.world_size,
                host=slot.host,
                device=slot.device,
                status=RankStatus.STOPPED,
                last_phase=beacon.phase,
            )
        log = plan.paths.log(slot.rank)
        report.log = str(log) if log.exists() else None  # result.json names only files that exist
        reports.append(report)
    return reports
