"""The Ray Jobs submitter: ``launch JOB.yaml --backend ray --address http://HOST:8265``.

The launcher submits itself as the Ray job: a copy of the job's directory (plus the effective
spec, overrides applied) is the job's working dir, ``python -m launcher.control.submitted ray SPEC
RUN_ID`` the entrypoint, and the Ray engine inside connects to that cluster instead of embedding
one. The submission id is ``<job>-<run id>``, and the run directory, here and on the cluster, is
``<job>/<run id>``: one id for the run everywhere. Inside, the launcher writes the run's events
into the job's log (the remote-run wire, ``launcher.stage.wire``), which this side streams and
follows with the wire's one follow loop: the console and ``/metrics`` here show every rank of the
cluster live. At the end the launcher inside sends the run directory back as a bundle in the
log's last lines (``bundle``), unpacked under the user's ``--out``.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from launcher.backends.ray_jobs.bundle import LEFT_FILE, BundleLines
from launcher.backends.ray_jobs.client import TERMINAL, LogTail, check_address, client, one_line, status, stop_and_wait
from launcher.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_JOB_FAILED, LauncherError, PlanError
from launcher.procutil import handling_stop_signals
from launcher.protocol import ENV_RAY_CONNECT
from launcher.results.store import RunResult, load_result, write_result
from launcher.stage.engine import JobInfo, LaunchRequest, Submission, Submitter
from launcher.stage.plan import NodeTarget
from launcher.stage.wire import RemoteRun, WireReader, follow, readable

if TYPE_CHECKING:
    from launcher.spec.model import LoadedJob
    from launcher.stage.watch import RunEvents

SPEC_FILE = "_gpulaunch_job.yaml"
ENTRYPOINT_MODULE = "launcher.control.submitted"
STOP_WAIT_S = 30.0  # how long an interrupted launch waits for its Ray job to stop
MAX_WORKING_DIR = 50 * 1024**2
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".git", ".venv", "runs", "*.egg-info")
_RESULT_KEYS = ("job", "status", "stages", "ranks")  # what a result.json that came back whole has


class RayJobsSubmitter(Submitter):
    name = "ray"

    @classmethod
    def claims(cls, job_id: str, address: str | None) -> bool:
        return address is not None or not job_id.isdigit()  # a bare number is a Slurm job

    def check_job(self, job: LoadedJob, cluster: str | None = None) -> None:
        from launcher.backends.ray import RayEngine

        RayEngine().check_job(job, cluster)  # a Ray-specific message for resources.nodes > 1, before submitting
        check_address(self.address)

    def target_nodes(self, job: LoadedJob, *, dry_run: bool = False) -> list[NodeTarget] | None:
        """The cluster's alive nodes, read from its dashboard (nothing is started): for the dry
        run. A real run plans inside the job, on what the cluster has then (it may autoscale)."""
        if not dry_run:
            return None
        from launcher.backends.ray import pool_node

        jobs = client(self.address)
        try:
            nodes = _dashboard_nodes(jobs)
        except Exception as exc:  # noqa: BLE001 - any failure to read the node list: say so, plan nothing
            raise PlanError(f"--dry-run --address {self.address}: cannot read the cluster's nodes: {one_line(exc)}") from None
        return [pool_node(nodes, check_address(self.address).split("//", 1)[1].rsplit(":", 1)[0])]

    def dry_run(self, submission: Submission) -> tuple[list[LaunchRequest], list[str]]:
        from launcher.backends.ray import RayEngine

        job = submission.job
        submit = (f"$ ray job submit --address {check_address(self.address)} --submission-id {job.spec.name}-<run-id> "
                  f"--working-dir {job.base_dir} -- python -m {ENTRYPOINT_MODULE} ray {SPEC_FILE} <run-id>")  # fmt: skip
        engine = RayEngine()
        requests = [engine.launch_request(plan) for plan in submission.plans]
        if requests:  # one request per plan: the submission comes first, with the first stage's
            requests[0] = LaunchRequest("ray", (submit, "inside the job:", *requests[0].commands), requests[0].notes)
        notes = [f"planned on the cluster's nodes as its dashboard lists them now ({len(submission.plans)} stage(s)); "
                 "inside the job the plan is made again on what the cluster has then"]  # fmt: skip
        return requests, notes

    def submit(self, submission: Submission, *, events: RunEvents, stop: object | None, detach: bool) -> RunResult:
        """Submit, follow the job's log to its end, bring its run directory back under ``out``."""
        if detach:
            raise LauncherError("--detach: only the slurm backend submits and returns; a Ray job is followed to its end", exit_code=EXIT_BAD_INPUT)
        job, address = submission.job, check_address(self.address)
        jobs = client(address)
        job_id = f"{job.spec.name}-{submission.run_id}"
        signals: list[str] = []
        with handling_stop_signals(lambda signum, _frame: signals.append(signal.Signals(signum).name)):
            job_id = _submit(jobs, job, job_id, submission.run_id, address)
            events.message(f"submitted Ray job {job_id} to {address}  (dashboard: {address}/#/jobs/{job_id})")
            run = RayJobRun(jobs, job_id)
            reader = WireReader(events, "ray")
            state = follow(run, reader, interrupted=lambda: bool(signals) or bool(stop))
            reader.close()  # the live line goes before anything else is said (an interrupt)
            if state is None:
                state = _stop_after_interrupt(jobs, job_id, signals[0] if signals else "stop request", events, signals, run, reader)
        return _result(jobs, job_id, state, run, Path(submission.out), address, events)

    def status(self, job_id: str) -> JobInfo:
        jobs = client(self.address)
        try:
            info = jobs.get_job_info(job_id)
        except Exception as exc:  # noqa: BLE001
            raise LauncherError(f"no Ray job {job_id!r} at {check_address(self.address)}: {one_line(exc)}", exit_code=EXIT_BAD_INPUT) from None
        state = str(getattr(info.status, "value", info.status))
        return JobInfo(job_id, state, state in TERMINAL, info.message or "", dict(info.metadata or {}), info.entrypoint)

    def logs(self, job_id: str, *, follow: bool, echo: Callable[[str, str], None]) -> None:
        self.status(job_id)  # a clear error for an unknown job
        jobs = client(self.address)
        if not follow:
            for line in str(jobs.get_job_logs(job_id)).splitlines():
                _echo(line, echo)
            return
        run = RayJobRun(jobs, job_id)
        while True:
            for line in run.new_lines():
                _echo(line, echo)
            if status(jobs, job_id) in TERMINAL:
                break
            time.sleep(0.5)
        for line in run.new_lines(final=True):
            _echo(line, echo)

    def stop(self, job_id: str) -> JobInfo:
        self.status(job_id)
        stop_and_wait(client(self.address), job_id)
        return self.status(job_id)


def _echo(line: str, echo: Callable[[str, str], None]) -> None:
    """A line of the job's log as ``launch logs`` shows it: the wire's and the bundle's lines left out."""
    if BundleLines().take(line):
        return
    shown = readable(line)
    if shown is not None:
        echo(*shown)


NODES_WAIT_S = 5.0  # a head that has just started lists its nodes a moment later


def _dashboard_nodes(jobs: Any) -> list[dict[str, Any]]:
    """The cluster's alive nodes from the dashboard's state API, as ``ray.nodes()`` would list
    them; an error when it lists none (a dry run says it could not plan, it never plans on nothing)."""
    import requests

    deadline = time.monotonic() + NODES_WAIT_S
    while True:
        answer = requests.get(f"{jobs._address}/api/v0/nodes?limit=10000", headers=jobs._headers, cookies=jobs._cookies, timeout=10)  # noqa: SLF001
        answer.raise_for_status()
        found = [n for n in answer.json()["data"]["result"]["result"] if n.get("state") == "ALIVE"]
        if found:
            return [{"Alive": True, "Resources": n.get("resources_total") or {}} for n in found]
        if time.monotonic() > deadline:
            raise RuntimeError(f"its dashboard lists no alive node (after {NODES_WAIT_S:g} s)")
        time.sleep(0.5)


class RayJobRun(RemoteRun):
    """A submitted Ray job as the follow loop sees it: its log, streamed, and its status."""

    def __init__(self, jobs: Any, job_id: str) -> None:
        self.jobs, self.job_id = jobs, job_id
        self.tail = LogTail(jobs, job_id)
        self.bundle = BundleLines()
        self.said_error: str | None = None  # the launcher inside's last "error: ..." line

    def new_lines(self, final: bool = False) -> list[str]:
        out = []
        for line in self.tail.lines(final):
            if self.bundle.take(line):
                continue
            if line.startswith("error: "):
                self.said_error = line[len("error: ") :]
            out.append(line)
        return out

    def ended(self, reader: WireReader) -> str | None:
        state = status(self.jobs, self.job_id)
        return state if state in TERMINAL else None


def _effective_spec(job: LoadedJob) -> dict[str, Any]:
    data = job.spec.model_dump(mode="json")
    data["backend"] = "ray"
    data["extends"] = None  # merged already
    data["cluster"] = None  # hosts come from the Ray cluster
    data["ray"]["address"] = None  # inside the job the engine connects; it must not submit again
    return data


def _working_dir(job: LoadedJob) -> Path:
    import yaml

    root = Path(tempfile.mkdtemp(prefix="gpulaunch-submit-"))
    work = root / "job"
    shutil.copytree(job.base_dir, work, ignore=_IGNORE, symlinks=False)
    size = sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
    if size > MAX_WORKING_DIR:
        shutil.rmtree(root, ignore_errors=True)
        raise LauncherError(f"{job.base_dir}: the job's directory is {size >> 20} MiB; keep it under {MAX_WORKING_DIR >> 20} MiB to submit it", exit_code=EXIT_BAD_INPUT)
    (work / SPEC_FILE).write_text(yaml.safe_dump(_effective_spec(job), sort_keys=False))
    return work


def _submit(jobs: Any, job: LoadedJob, submission_id: str, run_id: str, address: str) -> str:
    import launcher
    from launcher.backends.ray import job_metadata
    from launcher.spec.model import JobSpec

    metadata = {**job_metadata(JobSpec.model_validate(_effective_spec(job))), "run_id": run_id}  # the spec run inside
    work = _working_dir(job)
    try:
        return jobs.submit_job(
            entrypoint=f"python -m {ENTRYPOINT_MODULE} ray {SPEC_FILE} {run_id}",
            submission_id=submission_id,
            metadata=metadata,
            runtime_env={
                "working_dir": str(work),
                "py_modules": [str(Path(launcher.__file__).parent)],
                "excludes": ["__pycache__", "*.pyc"],
                "env_vars": {ENV_RAY_CONNECT: "1", "PYTHONUNBUFFERED": "1"},
            },
        )
    except Exception as exc:  # noqa: BLE001
        raise LauncherError(f"cannot submit to {address}: {one_line(exc)}", exit_code=EXIT_JOB_FAILED) from None
    finally:
        shutil.rmtree(work.parent, ignore_errors=True)


def _stop_after_interrupt(jobs: Any, job_id: str, signame: str, events: RunEvents, signals: list[str], run: RayJobRun, reader: WireReader) -> str:
    """Stop the submitted job and wait up to STOP_WAIT_S for it to end; a second signal stops the
    waiting (not the stop request, which has been sent)."""
    events.message(f"interrupted ({signame}): stopping Ray job {job_id}")
    told = len(signals)
    try:
        jobs.stop_job(job_id)
    except Exception as exc:  # noqa: BLE001
        events.message(f"error: cannot stop Ray job {job_id}: {one_line(exc)}")
        return "STOPPED"
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        if len(signals) > told:
            events.message(f"interrupted again: not waiting for Ray job {job_id} to stop (see: launch status {job_id})")
            return "STOPPED"
        state = status(jobs, job_id)
        if state in TERMINAL:
            events.message(f"Ray job {job_id}: {state}")
            return state
        time.sleep(0.5)
    events.message(f"warning: Ray job {job_id} is still running after {STOP_WAIT_S:g}s (see: launch status {job_id})")
    return "STOPPED"


def _result(jobs: Any, job_id: str, state: str, run: RayJobRun, out: Path, address: str, events: RunEvents) -> RunResult:
    """The run directory the job sent back, under ``out``; one line (never a traceback) with the
    job's own exit code when none came back whole."""
    if state != "STOPPED":
        run.new_lines(final=True)  # the bundle is the log's last lines
    run_dir = run.bundle.unpack(out)
    data = load_result(run_dir) if run_dir is not None else None
    if run_dir is None or not isinstance(data, dict) or any(k not in data for k in _RESULT_KEYS):
        why = f": {run.said_error}" if run.said_error else ""
        raise LauncherError(
            f"Ray job {job_id} ended {state} without sending its result back{why} (see: launch logs {job_id} --address {address})",
            exit_code=EXIT_INTERRUPTED if state == "STOPPED" else _exit_code(jobs, job_id),
        )
    data = {**data, "run_dir": str(run_dir)}  # where it is now, not the cluster's directory
    write_result(run_dir, data)
    _say_what_stayed(run_dir, events)
    result = RunResult(data, run_dir, tuple(str(run_dir / p) for p in data.get("plots", [])))
    events.finished(result)
    return result


def _exit_code(jobs: Any, job_id: str) -> int:
    try:
        code = getattr(jobs.get_job_info(job_id), "driver_exit_code", None)
    except Exception:  # noqa: BLE001
        return EXIT_JOB_FAILED
    return code if code in (EXIT_JOB_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED) else EXIT_JOB_FAILED


def _say_what_stayed(run_dir: Path, events: RunEvents) -> None:
    listing_file = run_dir / LEFT_FILE
    if not listing_file.is_file():
        return
    listing = json.loads(listing_file.read_text())
    files = listing.get("files", [])
    total = sum(f.get("bytes", 0) for f in files) / 1024**2
    where = str(Path(files[0]["path"]).parent) if files else "?"
    events.message(
        f"{len(files)} large file(s), {total:.1f} MiB, stayed on the cluster ({listing.get('host')}:{where}; "
        f"{LEFT_FILE} lists them): copy them with scp or rsync from the head"
    )

