"""``launch JOB.yaml --backend slurm``: submit the run as one batch job and follow it to its end.

Before anything is submitted, ``sinfo`` says whether the partition exists and can ever hold the
request. Then the run directory (on the filesystem the cluster shares) gets the effective spec
and ``job.sbatch``, and ``sbatch --parsable`` submits it. While the job runs, the launcher inside
writes rank lines and its events into ``slurm-<id>.out`` and each rank its progress beacon; this
side replays both on the console and polls ``squeue``. When the job has ended, ``result.json`` is
the one the launcher inside wrote, or, if it could not write one (its node was lost, the job was
cancelled before it ran), one written here from the job's final state. Ctrl-C or SIGTERM cancel
the job: first SIGTERM to the launcher inside (it stops its steps and writes its result), then
``scancel`` if it has not ended within ``STOP_GRACE_S``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from launcher.backends.base import LaunchRequest
from launcher.backends.slurm import commands
from launcher.backends.slurm.events import replay
from launcher.backends.slurm.outcome import finish
from launcher.backends.slurm.script import (
    RECORD_FILE, SCRIPT_FILE, SPEC_FILE, Allocation, allocation_for, check_paths, fitting_nodes, output_path, planned_nodes, sbatch_script,
    srun_argv,
)  # fmt: skip
from launcher.backends.torchrun import agent_argv
from launcher.control.events import RankLive, RunEvents, StageProgress
from launcher.control.planning import StagePlan, make_plans
from launcher.errors import EXIT_BAD_INPUT, LauncherError
from launcher.masking import mask_env
from launcher.procutil import handling_stop_signals, read_json, write_json_atomic
from launcher.protocol import RankProgress, StagePaths
from launcher.records import new_run_id
from launcher.results.store import RunResult

if TYPE_CHECKING:
    from launcher.spec.model import LoadedJob

POLL_S = 0.5
PROGRESS_EVERY_S = 0.5
STOP_GRACE_S = 15.0  # after SIGTERM, for the launcher inside to stop its steps and write its result
KILL_WAIT_S = 60.0  # after scancel, for Slurm to end every step (KillWait, then SIGKILL)
# The batch host's ranks' beacons standing still this long get its slurmd asked whether it is
# there: the launcher inside runs on it, and Slurm notices a lost node only after SlurmdTimeout.
SILENT_S = 4.0
COMPLETING_WAIT_S = 2.0  # once the launcher inside has ended, how long the job may stay COMPLETING
ACTIVE_NOT_STARTED = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESV_DEL_HOLD")


def plan_submission(job: LoadedJob, *, out: Path) -> tuple[list[StagePlan], list[LaunchRequest], list[str]]:
    """The dry run: the sbatch script exactly as it would be submitted, and each stage's srun
    lines as the launcher inside would run them, on the partition's first nodes that fit."""
    partition = commands.partition(job.spec.slurm.partition)
    alloc = allocation_for(job, partition)
    run_dir = out.resolve() / job.spec.name / "<run-id>"
    plans = _plans(job, alloc, partition, run_dir)
    script = sbatch_script(job, alloc, run_dir, python=sys.executable, cwd=Path.cwd())
    requests = []
    for i, plan in enumerate(plans):
        steps = [f"[{node.host}] $ {_srun_line(plan, node)}" for node in plan.nodes]
        submitted = [f"$ sbatch --parsable {run_dir / SCRIPT_FILE}", *script.rstrip("\n").splitlines(), ""] if i == 0 else []
        inside = f"inside the job, world size {plan.world_size}: one srun step per node"
        requests.append(LaunchRequest("slurm", (*submitted, inside + ":", *steps)))
    first = plans[0].nodes[0].host if plans else "the first node"
    notes = [
        f"allocation: {alloc.describe()}",
        f"the nodes shown are partition {partition.name}'s first that fit; inside the job they are the ones Slurm grants, "
        f"the first of them ({first} here) the rendezvous, on a port chosen there",
    ]
    return plans, requests, notes


def _plans(job: LoadedJob, alloc: Allocation, partition: commands.Partition, run_dir: Path) -> list[StagePlan]:
    """The stages planned on the partition's first nodes that fit (their addresses as Slurm has
    them), so a world size the allocation cannot hold fails before anything is submitted."""
    names = fitting_nodes(alloc, partition)
    addresses = {name: rec.get("NodeAddr", name) for name, rec in commands.node_records(names).items()}
    return make_plans(job, planned_nodes(alloc, names, addresses), run_dir=run_dir, master_port=0, backend="slurm")


def _srun_line(plan: StagePlan, node: Any) -> str:
    argv = srun_argv(node, plan.job, agent_argv(plan, node))
    return shlex.join(a if a != "--master-port=0" else "--master-port=<free port on the first node>" for a in argv)


def submit_run(job: LoadedJob, *, out: Path, events: RunEvents, stop: object | None, detach: bool) -> RunResult:
    partition = commands.partition(job.spec.slurm.partition)
    alloc = allocation_for(job, partition)  # a request the partition can never hold: refused here
    run_id = new_run_id()
    run_dir = out.resolve() / job.spec.name / run_id
    cwd = Path.cwd()
    check_paths(run_dir, cwd)
    # a world size the allocation cannot hold fails here too, before anything is submitted
    plans = _plans(job, alloc, partition, run_dir)
    _write_run_dir(job, run_dir, alloc, cwd, out)
    signals: list[str] = []  # from here on, SIGINT and SIGTERM cancel the job instead of ending launch

    def on_signal(signum: int, _frame: Any) -> None:
        signals.append(signal.Signals(signum).name)
        if len(signals) > 2:  # the first cancels the job, the second hurries that, a third gives up on it
            job_id = (read_json(run_dir / RECORD_FILE) or {}).get("job_id", "JOB_ID")
            print(f"gpulaunch: not waiting any longer; the Slurm job may still run (launch stop {job_id})", file=sys.stderr, flush=True)
            raise KeyboardInterrupt

    with handling_stop_signals(on_signal):
        try:
            job_id = commands.submit(str(run_dir / SCRIPT_FILE))
        except LauncherError:
            shutil.rmtree(run_dir, ignore_errors=True)  # nothing was submitted: no run to keep
            raise
        record = read_json(run_dir / RECORD_FILE) or {}
        write_json_atomic(run_dir / RECORD_FILE, {**record, "job_id": job_id, "submitted_at": time.time()})
        events.message(f"submitted Slurm job {job_id}: {alloc.describe()}")
        events.message(f"run directory: {run_dir}")
        if detach:
            data = {"job": job.spec.name, "run_id": run_id, "backend": "slurm", "status": "pending", "job_id": job_id, "run_dir": str(run_dir)}
            return RunResult(data, run_dir)
        return _Follow(job, job_id, run_dir, plans, events, signals).run(stop)


def _write_run_dir(job: LoadedJob, run_dir: Path, alloc: Allocation, cwd: Path, out: Path) -> None:
    effective = job.spec.model_dump(mode="json")
    effective.update(backend="slurm", extends=None, cluster=None)
    if job.spec.script:
        effective["script"] = str(job.script_path())  # the job runs in this directory, not the spec's
    shown = {**effective, "env": mask_env(effective["env"])}
    try:
        run_dir.mkdir(parents=True, exist_ok=False)
        (run_dir / "spec.yaml").write_text(yaml.safe_dump(shown, sort_keys=False))
        fd = os.open(run_dir / SPEC_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # secrets unmasked: the user's only
        with os.fdopen(fd, "w") as handle:
            handle.write("# the effective spec this Slurm job runs (secrets unmasked: readable by you only)\n")
            handle.write(yaml.safe_dump(effective, sort_keys=False))
        (run_dir / SCRIPT_FILE).write_text(sbatch_script(job, alloc, run_dir, python=sys.executable, cwd=cwd))
    except OSError as exc:
        raise LauncherError(f"--out {out}: cannot create the run directory {run_dir}: {exc.strerror or exc}", exit_code=EXIT_BAD_INPUT) from None
    write_json_atomic(
        run_dir / RECORD_FILE,
        {"job": job.spec.name, "spec_hash": job.spec.fingerprint(), "params": dict(job.params), "allocation": alloc.__dict__},
    )


class OutputTail:
    """The job's output file, read a whole line at a time as the job writes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pos = 0
        self._partial = b""

    def lines(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._pos)
                data = handle.read()
        except OSError:
            return []
        self._pos += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        if final and self._partial:
            complete.append(self._partial)
            self._partial = b""
        return [line.decode("utf-8", errors="replace") for line in complete]


class _Follow:
    """One submitted run, watched from the submitting machine until its job has ended."""

    def __init__(self, job: LoadedJob, job_id: str, run_dir: Path, plans: list[StagePlan], events: RunEvents, signals: list[str]) -> None:
        self.job, self.job_id, self.run_dir, self.events = job, job_id, run_dir, events
        self.plans = {p.world_size: p for p in plans}
        self.tail = OutputTail(output_path(run_dir, job_id))
        self.stage: tuple[StagePlan, float] | None = None
        self.hosts: list[str] = []
        self.signals = signals  # SIGINT, SIGTERM as they arrive (the caller's handler appends them)
        self.finished = False  # the launcher inside has written its result
        self.lost: str | None = None  # the batch host, lost: "n1 (why)"
        self._beacons: dict[int, tuple[float | None, float]] = {}  # rank -> (its beacon's t, when that was new)

    def run(self, stop: object | None) -> RunResult:
        state = self._watch(stop)
        interrupted = self.signals[0] if self.signals else ("stop request" if stop else None)
        if interrupted and (state is None or not state.terminal):
            state = self._cancel(interrupted)
        self._pump(final=True)
        if self.stage is not None:
            self.events.stage_finished()
        try:
            state = commands.state_of(self.job_id) or state  # with its exit code, once it has ended
        except commands.SlurmError:
            pass
        return finish(self.run_dir, self.job_id, state, interrupted, self.events, lost=self.lost)

    def _watch(self, stop: object | None) -> commands.JobState | None:
        submitted, running, pending_told = time.monotonic(), False, False
        next_progress = 0.0
        completing_since: float | None = None
        quiet_until = 0.0
        while not self.signals and not stop:
            try:
                state = commands.squeue_state(self.job_id)
            except commands.SlurmError as exc:  # slurmctld restarting, busy: the job goes on meanwhile
                if not quiet_until or time.monotonic() > quiet_until:
                    self.events.message(f"{exc}; still following Slurm job {self.job_id}")
                    quiet_until = time.monotonic() + 60
                time.sleep(POLL_S * 4)
                continue
            self._pump()
            if state is None or state.terminal:
                return state
            if state.state == "COMPLETING" and self.finished:
                # the launcher inside has written its result and ended; a lost node keeps the job
                # COMPLETING until Slurm marks it down (SlurmdTimeout): no need to wait for that
                completing_since = completing_since or time.monotonic()
                if time.monotonic() - completing_since > COMPLETING_WAIT_S:
                    return state
            waited = time.monotonic() - submitted
            if state.state in ACTIVE_NOT_STARTED:
                if not pending_told and waited > self.job.spec.timeouts.rendezvous_s:
                    pending_told = True
                    self.events.message(
                        f"Slurm job {self.job_id} is still {state.state.lower()} after {waited:.0f}s (timeouts.rendezvous_s): "
                        f"{state.reason or 'no reason given'}; it stays queued (launch stop {self.job_id} or Ctrl-C cancels it)"
                    )
            elif not running:
                running = True
                self.events.message(f"Slurm job {self.job_id} is running on {state.nodes or '?'} (batch host {state.batch_host or '?'})")
            if state.state == "RUNNING" and self.stage is not None and not self.finished:
                why = self._batch_host_lost(state.batch_host)
                if why:
                    self.lost = f"{state.batch_host} ({why})"
                    self.events.message(f"lost node {self.lost}, where the launcher inside ran: cancelling Slurm job {self.job_id}")
                    commands.cancel(self.job_id)
                    # its steps elsewhere end at once; the job stays COMPLETING until Slurm marks the node down
                    return _wait_ended(self.job_id, COMPLETING_WAIT_S, lambda: bool(self.signals), self._pump)
            if self.stage is not None and time.monotonic() >= next_progress:
                self._progress()
                next_progress = time.monotonic() + PROGRESS_EVERY_S
            time.sleep(POLL_S)
        return None

    def _batch_host_lost(self, batch_host: str) -> str | None:
        """Why the batch host is gone, once its ranks' beacons have stood still for SILENT_S and
        its slurmd does not answer; None while it is there (asked again after another silence)."""
        assert self.stage is not None
        paths = StagePaths.of(self.run_dir, self.stage[0].world_size)
        ranks = [rank for rank, host in enumerate(self.hosts) if host == batch_host]
        now, quiet = time.monotonic(), bool(ranks)
        for rank in ranks:
            t = RankProgress.from_dict(read_json(paths.progress(rank))).t
            last, since = self._beacons.get(rank, (None, now))
            if t != last:
                self._beacons[rank] = (t, now)
                since = now
            quiet = quiet and t is not None and now - since > SILENT_S
        if not quiet:
            return None
        for rank in ranks:
            self._beacons[rank] = (self._beacons[rank][0], now)
        return commands.probe_nodes([batch_host]).get(batch_host)

    def _cancel(self, why: str) -> commands.JobState | None:
        self.events.message(f"interrupted ({why}): cancelling Slurm job {self.job_id}")
        return cancel_and_wait(self.job_id, hurry=lambda: len(self.signals) > 1, pump=self._pump)

    def _pump(self, final: bool = False) -> None:
        for line in self.tail.lines(final):
            replay(line, self.events, self._on_event)

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "stage":
            if self.stage is not None:
                self.events.stage_finished()
            size = int(event.get("world_size", 0))
            plan = self.plans.get(size) or replace(next(iter(self.plans.values())), world_size=size, paths=StagePaths.of(self.run_dir, size))
            self.stage, self.hosts = (plan, time.time()), []
            self.events.stage_started(str(event.get("job")), size, str(event.get("device_type")), "slurm")
        elif kind == "finished":
            self.finished = True
        elif kind == "hosts":
            self.hosts = [str(h) for h in event.get("hosts", [])]
        elif kind == "stage_end" and self.stage is not None:
            self.stage = None
            self.events.stage_finished()

    def _progress(self) -> None:
        assert self.stage is not None
        plan, started = self.stage
        paths = StagePaths.of(self.run_dir, plan.world_size)
        ranks, phases = [], {}
        for rank in range(plan.world_size):
            beacon = RankProgress.from_dict(read_json(paths.progress(rank)))
            phases[beacon.phase] = phases.get(beacon.phase, 0) + 1
            host = self.hosts[rank] if rank < len(self.hosts) else "?"
            ranks.append(RankLive(rank, host, beacon.phase, beacon.steps, beacon.t))
        self.events.progress(plan, StageProgress(plan.world_size, time.time() - started, tuple(ranks), 0, phases))


def cancel_and_wait(job_id: str, *, hurry: Any = lambda: False, pump: Any = lambda: None) -> commands.JobState | None:
    """Cancel a job and wait until it has left every active state (its steps are gone): a
    running one first gets SIGTERM in its batch script (the launcher inside stops its steps and
    writes its result), then ``scancel`` after STOP_GRACE_S (at once when ``hurry()`` turns true)."""
    try:
        state = commands.squeue_state(job_id)
    except commands.SlurmError:  # slurmctld does not answer: ask for the cancel all the same
        commands.cancel(job_id)
        return _wait_ended(job_id, STOP_GRACE_S, hurry, pump)
    if state is None or state.terminal:
        return state
    if state.state == "COMPLETING":
        return _wait_ended(job_id, KILL_WAIT_S, hurry, pump)
    if state.state in ACTIVE_NOT_STARTED:
        commands.cancel(job_id)
    else:
        commands.cancel(job_id, batch_signal="TERM")
        state = _wait_ended(job_id, STOP_GRACE_S, hurry, pump)
        if state is None or state.terminal:
            return state
        commands.cancel(job_id)
    return _wait_ended(job_id, KILL_WAIT_S, lambda: False, pump)


def _wait_ended(job_id: str, timeout_s: float, hurry: Any, pump: Any) -> commands.JobState | None:
    deadline = time.monotonic() + timeout_s
    state = None
    while True:
        try:
            state = commands.squeue_state(job_id)
        except commands.SlurmError:
            pass  # slurmctld did not answer this time: ask again until the deadline
        else:
            if state is None or state.terminal:
                return state
        pump()
        if time.monotonic() > deadline or hurry():
            return state
        time.sleep(0.2)
