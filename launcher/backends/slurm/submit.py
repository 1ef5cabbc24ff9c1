"""The Slurm submitter: ``launch JOB.yaml --backend slurm`` as one batch job, followed to its end.

Before anything is submitted, ``sinfo`` says whether the partition exists and can ever hold the
request, and the allocation is decided (once: the same value sizes the plans, the sbatch script
and the dry run). Then the run directory (on the filesystem the cluster shares) gets the
effective spec and ``job.sbatch``, and ``sbatch --parsable`` submits it. Inside the job the
launcher runs the stages with the srun engine and writes the run's events into ``slurm-<id>.out``
(the remote-run wire, ``launcher.stage.wire``); this side follows that file and ``squeue`` with the
wire's one follow loop, so the console and ``/metrics`` here show every rank live. A job Slurm requeues
(its warning before the time limit, preemption, ``scontrol requeue``) is followed on through the
queue to its next allocation, whose launcher resumes the run, and so on to the end. When the job has
ended, ``result.json`` is the one the launcher inside wrote, or, if it could not write one (its
node was lost, the job was cancelled before it ran), one the results layer makes from the job's
final state (the record ``outcome.ended_run`` hands back).
Ctrl-C or SIGTERM cancel the job: first SIGTERM to the launcher inside, through its batch script
(it stops its steps and writes its result; the script then cancels the job, so that Slurm's own
record says CANCELLED), then ``scancel`` if it has not ended within ``STOP_GRACE_S``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import yaml

from launcher.backends.slurm import commands, inside
from launcher.backends.slurm.backend import check_no_cluster_file
from launcher.backends.slurm.jobs import (
    ACTIVE_NOT_STARTED, OutputTail, cancel_and_wait, job_info, job_logs, job_of_run, locate, stop_job, wait_ended,
)  # fmt: skip
from launcher.backends.slurm.outcome import ended_run
from launcher.backends.slurm.script import (
    RECORD_FILE, SCRIPT_FILE, SPEC_FILE, Allocation, allocation_for, check_paths, fitting_nodes, output_path, planned_nodes, sbatch_script,
    srun_argv,
)  # fmt: skip
from launcher.backends.torchrun import agent_argv
from launcher.errors import EXIT_BAD_INPUT, LauncherError
from launcher.masking import mask_env
from launcher.procutil import handling_stop_signals, read_json, write_json_atomic
from launcher.protocol import ENV_SLURM_INSIDE, RankProgress, StagePaths
from launcher.records import SubmittedRun
from launcher.stage.engine import JobInfo, LaunchRequest, RunJob, Submission, Submitter
from launcher.stage.plan import NodeTarget, StagePlan
from launcher.stage.wire import RemoteRun, WireReader, follow

if TYPE_CHECKING:
    from launcher.spec.model import LoadedJob
    from launcher.stage.watch import RunEvents

POLL_S = 0.5
# The batch host's ranks' beacons standing still this long get its slurmd asked whether it is
# there: the launcher inside runs on it, and Slurm notices a lost node only after SlurmdTimeout.
SILENT_S = 4.0
COMPLETING_WAIT_S = 2.0  # once the launcher inside has ended, how long the job may stay COMPLETING
RESTARTS_EVERY_S = 1.0  # once the launcher inside has ended, how often to ask whether Slurm requeued the job
DRY_RUN_PROBE_S = 5.0  # a dry run asks sinfo this long: a client with no controller to reach says so in seconds


class SlurmSubmitter(Submitter):
    name = "slurm"
    usage = inside.USAGE

    def __init__(self, address: str | None = None) -> None:
        super().__init__(address)
        self.alloc: Allocation | None = None  # decided once, by target_nodes
        self.partition: commands.Partition | None = None  # None in a dry run that could not ask Slurm
        self.notes: list[str] = []

    @classmethod
    def claims(cls, job_id: str, address: str | None) -> bool:
        return address is None and job_id.isdigit()

    @classmethod
    def takes_run(cls, job: LoadedJob, address: str | None, env: Mapping[str, str]) -> bool:
        return env.get(ENV_SLURM_INSIDE) != "1"  # inside its batch job, the srun engine runs the stages

    @classmethod
    def run_inside(cls, argv: Sequence[str], run_job: RunJob) -> int | None:
        return inside.run_inside(argv, run_job)

    @classmethod
    def resume_refusal(cls, run_dir: Path) -> str | None:
        if not (run_dir / RECORD_FILE).is_file():  # a run submitted to Slurm has its job's record: not a run of this machine's
            return None
        return ("a Slurm run; Slurm continues it: its job requeues itself after a preemption warning, "
                f"or `scontrol requeue JOBID` while Slurm remembers the job, or `sbatch {run_dir / SCRIPT_FILE}`")  # fmt: skip

    def check_job(self, job: LoadedJob, cluster: str | None = None) -> None:
        check_no_cluster_file(job, cluster)

    def target_nodes(self, job: LoadedJob, *, dry_run: bool = False) -> list[NodeTarget] | None:
        """The partition's first nodes that fit the allocation (their addresses as Slurm has
        them), so that a world size the allocation cannot hold fails before anything is submitted.
        A dry run without a reachable controller plans on placeholder nodes, and says so."""
        try:
            self.partition = commands.partition(job.spec.slurm.partition, timeout_s=DRY_RUN_PROBE_S if dry_run else commands.TIMEOUT_S)
        except commands.SlurmUnreachable as exc:
            if not dry_run:
                raise
            return self._unchecked_nodes(job, str(exc))
        self.alloc = allocation_for(job, self.partition)  # a request the partition can never hold: refused here
        names = fitting_nodes(self.alloc, self.partition)
        addresses = {name: rec.get("NodeAddr", name) for name, rec in commands.node_records(names).items()}
        return planned_nodes(self.alloc, names, addresses)

    def _unchecked_nodes(self, job: LoadedJob, why: str) -> list[NodeTarget]:
        self.partition = None
        self.alloc = allocation_for(job, None)
        names = [f"NODE{i + 1}" for i in range(self.alloc.nodes)]
        self.notes.append(f"could not reach Slurm ({why}): the partition and its nodes were not checked; the nodes shown are placeholders")
        res = job.spec.resources
        if res.device != "cpu" and not isinstance(res.gpus_per_node, int):
            shown = "as 1" if res.device == "cuda" else "on the CPU (resources.cpu_workers)"
            self.notes.append(f"resources.gpus_per_node: auto is the partition's GPUs per node, unknown without Slurm: shown {shown}")
        return planned_nodes(self.alloc, names, {})

    def dry_run(self, submission: Submission) -> tuple[list[LaunchRequest], list[str]]:
        """The sbatch script exactly as it would be submitted, and each stage's srun lines as the
        launcher inside would run them."""
        assert self.alloc is not None, "target_nodes decides the allocation first"
        job = submission.job
        run_dir = submission.out.resolve() / job.spec.name / "<run-id>"
        script = sbatch_script(job, self.alloc, run_dir, python=sys.executable, cwd=Path.cwd())
        requests = []
        for i, plan in enumerate(submission.plans):
            steps = [f"[{node.host}] $ {_srun_line(plan, node)}" for node in plan.nodes]
            submitted = [f"$ sbatch --parsable {run_dir / SCRIPT_FILE}", *script.rstrip("\n").splitlines(), ""] if i == 0 else []
            inside = f"inside the job, world size {plan.world_size}: one srun step per node"
            requests.append(LaunchRequest("slurm", (*submitted, inside + ":", *steps)))
        first = submission.plans[0].nodes[0].host if submission.plans else "the first node"
        notes = [f"allocation: {self.alloc.describe()}"]
        if self.partition is not None:
            notes.append(f"the nodes shown are partition {self.partition.name}'s first that fit; inside the job they are the ones Slurm "
                         f"grants, the first of them ({first} here) the rendezvous, on a port chosen there")  # fmt: skip
        notes += self.notes
        return requests, notes

    def submit_run(self, submission: Submission, *, events: RunEvents, stop: object | None, detach: bool) -> SubmittedRun:
        assert self.alloc is not None, "target_nodes decides the allocation first"
        job = submission.job
        run_dir = submission.out.resolve() / job.spec.name / submission.run_id
        cwd = Path.cwd()
        check_paths(run_dir, cwd)
        _write_run_dir(job, run_dir, self.alloc, cwd, submission.out)
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
            events.message(f"submitted Slurm job {job_id}: {self.alloc.describe()}")
            events.message(f"run directory: {run_dir}")
            if detach:
                hint = (f"Slurm job {job_id}: launch status {job_id} | launch logs {job_id} -f | launch stop {job_id}; "
                        f"follow it: launch attach {job_id} (Ctrl-C leaves it running); once it ended: launch report {run_dir}")  # fmt: skip
                return SubmittedRun("slurm", job.spec.name, submission.run_id, run_dir, job_id=job_id, pending_hint=hint)
            ended = _follow_job(job, job_id, run_dir, events, signals, stop, pending_after_s=job.spec.timeouts.rendezvous_s)
            assert ended is not None  # an interrupt cancels the job: its record
            return ended

    def attach_run(self, run_or_job_id: str, *, out: Path, events: RunEvents) -> SubmittedRun | None:
        """Follow a submitted job (its job id, or its run id while Slurm remembers its job) as a
        foreground run follows its own, from the start of its output to its end; SIGINT or SIGTERM
        leave it running (None). Its run directory is where the job writes it (a filesystem the
        cluster shares), not under ``out``."""
        job_id = job_of_run(run_or_job_id)
        state, record, run_dir = locate(job_id)
        if run_dir is None:
            raise LauncherError(f"Slurm job {job_id} is not a gpulaunch run (no {RECORD_FILE} beside its output {record.get('StdOut', '?')})",
                                exit_code=EXIT_BAD_INPUT)  # fmt: skip
        spec = yaml.safe_load((run_dir / SPEC_FILE).read_text()) if (run_dir / SPEC_FILE).is_file() else {}
        pending_after_s = float(((spec or {}).get("timeouts") or {}).get("rendezvous_s") or _default_rendezvous_s())
        signals: list[str] = []
        with handling_stop_signals(lambda signum, _frame: signals.append(signal.Signals(signum).name)):
            events.message(f"attached to Slurm job {job_id} ({state.state}); run directory: {run_dir}")
            return _follow_job(None, job_id, run_dir, events, signals, None, detach_on_interrupt=True, pending_after_s=pending_after_s,
                               restarts=commands.restarts_of(record) or 0)  # fmt: skip

    def status(self, job_id: str) -> JobInfo:
        return job_info(job_id)

    def logs(self, job_id: str, *, follow: bool, echo: Callable[[str, str], None]) -> None:
        job_logs(job_id, follow=follow, echo=echo)

    def stop(self, job_id: str) -> JobInfo:
        stop_job(job_id)
        return job_info(job_id)


def _srun_line(plan: StagePlan, node: Any) -> str:
    argv = srun_argv(node, plan.job, agent_argv(plan, node))
    return shlex.join(a if a != "--master-port=0" else "--master-port=<free port on the first node>" for a in argv)


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


def _default_rendezvous_s() -> float:
    """``timeouts.rendezvous_s`` as the spec's model states it (a run whose spec.yaml lacks it)."""
    from launcher.spec.model import Timeouts

    return float(Timeouts.model_fields["rendezvous_s"].default)


def _follow_job(
    job: LoadedJob | None, job_id: str, run_dir: Path, events: RunEvents, signals: list[str], stop: object | None, *,
    pending_after_s: float, detach_on_interrupt: bool = False, restarts: int = 0,
) -> SubmittedRun | None:
    """Follow the job over the wire until it has ended (or cancel it on a signal), then its
    record. ``detach_on_interrupt`` (``launch attach``): a signal stops the following only (None)."""
    run = SlurmRun(job, job_id, run_dir, events, pending_after_s=pending_after_s)
    if restarts:  # requeued before this follower came: not news, and the run it follows is the last allocation's
        run.restarts, run.rerun_since = restarts, 0.0
    reader = WireReader(events, "slurm")
    state_name = follow(run, reader, interrupted=lambda: bool(signals) or bool(stop), poll_s=POLL_S)
    if state_name is None and detach_on_interrupt:
        reader.close()
        events.message(f"detached: Slurm job {job_id} goes on (launch attach {job_id} follows it again, launch stop {job_id} stops it)")
        return None
    state = run.state
    interrupted = signals[0] if signals else ("stop request" if stop else None)
    if interrupted and state_name is None:
        events.message(f"interrupted ({interrupted}): cancelling Slurm job {job_id}")
        state = cancel_and_wait(job_id, hurry=lambda: len(signals) > 1, pump=lambda: reader.feed(run.new_lines()))
    reader.feed(run.new_lines(final=True))
    reader.close()
    try:
        state = commands.state_of(job_id) or state  # with its exit code, once it has ended
    except commands.SlurmError:
        pass
    waiting = run.restarts > 0 and run.rerun_since is None  # requeued, and stopped before it ran again
    return ended_run(run_dir, job_id, state, interrupted, lost=run.lost, written_after=run.rerun_since, requeued=waiting)


class SlurmRun(RemoteRun):
    """One submitted job, as the follow loop sees it: its output file, and ``squeue``; through
    every requeue (the same job id, the same output file, the run resumed) to its end."""

    def __init__(self, job: LoadedJob | None, job_id: str, run_dir: Path, events: RunEvents, *, pending_after_s: float) -> None:
        self.job, self.job_id, self.run_dir, self.events = job, job_id, run_dir, events
        # how long the job may pend before that is said: timeouts.rendezvous_s
        self.pending_after_s = pending_after_s
        self.tail = OutputTail(output_path(run_dir, job_id))
        self.state: commands.JobState | None = None
        self.lost: str | None = None  # the batch host, lost: "n1 (why)"
        self.restarts = 0  # times Slurm requeued the job, as seen here
        # when the job was seen running again after its last requeue (wall clock): a result
        # finished before then is an earlier allocation's (the old one has ended by then)
        self.rerun_since: float | None = None
        self._rerun_pending = False
        self._submitted = time.monotonic()
        self._running = self._pending_told = False
        self._completing_since: float | None = None
        self._quiet_until = 0.0
        self._ask_after = 0.0  # when Slurm's restart count may be asked again
        self._beacons: dict[int, tuple[float | None, float]] = {}  # rank -> (its beacon's t, when that was new)
        self._batch_host = ""  # where the launcher inside runs, as last seen running
        self._end_probed = False  # the batch host asked about once the batch script ended without a result

    def new_lines(self, final: bool = False) -> list[str]:
        return self.tail.lines(final)

    def ended(self, reader: WireReader) -> str | None:
        try:
            state = commands.squeue_state(self.job_id)
        except commands.SlurmError as exc:  # slurmctld restarting, busy: the job goes on meanwhile
            if time.monotonic() > self._quiet_until:
                self.events.message(f"{exc}; still following Slurm job {self.job_id}")
                self._quiet_until = time.monotonic() + 60
            return None
        self.state = state
        if state is None or state.terminal:
            if state is not None and state.state == "FAILED":  # not NODE_FAIL: Slurm names the node itself
                self._ended_without_result(state, reader)
            return state.state if state else "UNKNOWN"
        if self._requeued(state, reader):
            return None
        if state.state == "COMPLETING" and not reader.finished and self._ended_without_result(state, reader):
            # the batch script ended (killed with its node) before the launcher inside wrote its
            # result: Slurm keeps the job COMPLETING until it marks the node down; no need to wait
            commands.cancel(self.job_id)  # its steps elsewhere, if any are left
            self.state = wait_ended(self.job_id, COMPLETING_WAIT_S, lambda: False, lambda: reader.feed(self.new_lines()))
            return self.state.state if self.state else state.state
        if state.state == "COMPLETING" and reader.finished:
            # the launcher inside has written its result and ended; a lost node keeps the job
            # COMPLETING until Slurm marks it down (SlurmdTimeout): no need to wait for that
            self._completing_since = self._completing_since or time.monotonic()
            if time.monotonic() - self._completing_since > COMPLETING_WAIT_S:
                return state.state
        self._tell(state)
        if state.state == "RUNNING" and reader.in_stage and not reader.finished:
            why = self._batch_host_lost(state.batch_host, reader)
            if why:
                self.lost = f"{state.batch_host} ({why})"
                self.events.message(f"lost node {self.lost}, where the launcher inside ran: cancelling Slurm job {self.job_id}")
                commands.cancel(self.job_id)
                # its steps elsewhere end at once; the job stays COMPLETING until Slurm marks the node down
                self.state = wait_ended(self.job_id, COMPLETING_WAIT_S, lambda: False, lambda: reader.feed(self.new_lines()))
                return self.state.state if self.state else "CANCELLED"
        return None

    def _requeued(self, state: commands.JobState, reader: WireReader) -> bool:
        """Whether Slurm has requeued the job since it was last seen running: it pends again, or
        the launcher inside has ended and Slurm counts one more restart (asked only then). The
        run goes on: the next allocation's launcher resumes it, and its output follows."""
        again = state.state in ACTIVE_NOT_STARTED and self._running
        if not again and not (reader.finished and time.monotonic() >= self._ask_after):
            return False
        self._ask_after = time.monotonic() + RESTARTS_EVERY_S
        try:
            restarts = commands.restarts_of(commands.job_record(self.job_id) or {})
        except commands.SlurmError:
            restarts = None
        if restarts is None:
            restarts = self.restarts + 1 if again else self.restarts
        if restarts <= self.restarts:
            return False
        self.restarts, self._rerun_pending = restarts, True
        reader.close()  # a stage the last allocation left open
        reader.finished, reader.last_progress = None, None
        self._running = self._pending_told = False
        self._submitted, self._completing_since = time.monotonic(), None
        self._beacons.clear()
        self._end_probed, self._batch_host = False, ""
        self.events.message(
            f"Slurm job {self.job_id} was requeued (restart {restarts}): when it runs again, the launcher there resumes the run "
            f"from its last checkpoint (launch stop {self.job_id} or Ctrl-C cancels it)"
        )
        return True

    def _ended_without_result(self, state: commands.JobState | None, reader: WireReader) -> bool:
        """Whether the batch host was lost, asked once when the job's batch script has ended
        (COMPLETING, or ended) while the launcher inside, seen running, had not finished: a lost
        node's batch script may be reported ended (killed, exit code 0:9) a moment before its
        slurmstepd goes with the rest of the node, and the job ends FAILED instead of staying
        RUNNING until the beacons' silence shows the loss (``_batch_host_lost``). Named, the
        result says so, not "ended FAILED without a result"."""
        reader.feed(self.new_lines())  # what the launcher wrote before its script ended
        if self.lost or self._end_probed or reader.finished or not self._running:
            return False
        self._end_probed = True
        host = (state.batch_host if state else "") or self._batch_host
        why = commands.probe_nodes([host]).get(host) if host else None
        if not why:
            return False
        self.lost = f"{host} ({why})"
        self.events.message(f"lost node {self.lost}, where the launcher inside ran: Slurm job {self.job_id} ended there without its result")
        return True

    def _tell(self, state: commands.JobState) -> None:
        """That the job still pends (once, after timeouts.rendezvous_s), then that it runs."""
        waited = time.monotonic() - self._submitted
        if state.state in ACTIVE_NOT_STARTED:
            if not self._pending_told and waited > self.pending_after_s:
                self._pending_told = True
                self.events.message(
                    f"Slurm job {self.job_id} is still {state.state.lower()} after {waited:.0f}s (timeouts.rendezvous_s): "
                    f"{state.reason or 'no reason given'}; it stays queued (launch stop {self.job_id} or Ctrl-C cancels it)"
                )
        elif not self._running:
            self._running = True
            if self._rerun_pending:
                self.rerun_since, self._rerun_pending = time.time(), False
            self.events.message(f"Slurm job {self.job_id} is running on {state.nodes or '?'} (batch host {state.batch_host or '?'})")
        if state.state == "RUNNING" and state.batch_host:
            self._batch_host = state.batch_host

    def _batch_host_lost(self, batch_host: str, reader: WireReader) -> str | None:
        """Why the batch host is gone, once its ranks' beacons (on the shared filesystem: the
        launcher inside, which forwards them, runs there) have stood still for SILENT_S and its
        slurmd does not answer; None while it is there (asked again after another silence)."""
        progress = reader.last_progress
        if progress is None:
            return None
        paths = StagePaths.of(self.run_dir, progress.world_size)
        ranks = [r.rank for r in progress.ranks if r.host == batch_host]
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
