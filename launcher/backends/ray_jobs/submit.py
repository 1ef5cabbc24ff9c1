"""The Ray Jobs submitter: ``launch JOB.yaml --backend ray --address http://HOST:8265``.

The launcher submits itself as the Ray job: the job's directory (``workdir``: its regular files,
less what .gitignore and ``ray.excludes`` leave out, within ``ray.working_dir_max_mb``), plus the
effective spec, overrides applied, is the job's working dir, ``python -m
launcher.control.submitted ray SPEC RUN_ID`` the entrypoint, and the Ray engine inside connects to
that cluster instead of embedding one. The submission id is ``<job>-<run id>``, and the run
directory, here and on the cluster, is ``<job>/<run id>``: one id for the run everywhere
(``launch status/logs/stop`` take the run id too). Inside, the launcher writes the run's events
into a file of their own (the remote-run wire, ``launcher.stage.wire``, on its own channel:
``wirefile``), which this side streams through the dashboard and follows with the wire's one
follow loop: the console and ``/metrics`` here show every rank of the cluster live, while the
job's log keeps to what people read. At the end the launcher inside sends the run directory back
as a bundle at the end of that file (``bundle``), unpacked under the user's ``--out``. What Ray's
client says while submitting goes to the run directory's ``ray-submit.log``, not the console.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from launcher.backends.ray_jobs import inside
from launcher.backends.ray_jobs.bundle import LEFT_FILE, BundleLines
from launcher.backends.ray_jobs.client import (
    RAY_LOG_FILE, TERMINAL, LogTail, check_address, client, one_line, ray_logs_into, status, stop_and_wait,
)  # fmt: skip
from launcher.backends.ray_jobs.wirefile import WireTail
from launcher.backends.ray_jobs.workdir import Shipment, materialize, select
from launcher.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_JOB_FAILED, LauncherError, PlanError
from launcher.procutil import handling_stop_signals
from launcher.protocol import ENV_RAY_CONNECT
from launcher.records import SubmittedRun
from launcher.stage.engine import JobInfo, LaunchRequest, RunJob, Submission, Submitter
from launcher.stage.plan import NodeTarget
from launcher.stage.wire import RemoteRun, WireReader, follow, readable

if TYPE_CHECKING:
    from launcher.spec.model import LoadedJob
    from launcher.stage.watch import RunEvents

SPEC_FILE = "_gpulaunch_job.yaml"
ENTRYPOINT_MODULE = "launcher.control.submitted"
STOP_WAIT_S = 30.0  # how long an interrupted launch waits for its Ray job to stop


class RayJobsSubmitter(Submitter):
    name = "ray"
    takes_address = True  # the cluster's dashboard: --address, or the spec's ray.address
    address_kind = "a Ray cluster"
    needs = ("ray",)
    usage = inside.USAGE

    @classmethod
    def claims(cls, job_id: str, address: str | None) -> bool:
        return address is not None or not job_id.isdigit()  # a bare number is a Slurm job

    @classmethod
    def address_of(cls, job: LoadedJob) -> str | None:
        return job.spec.ray.address

    @classmethod
    def takes_run(cls, job: LoadedJob, address: str | None, env: Mapping[str, str]) -> bool:
        return address is not None  # without one, the Ray engine runs the job here (or inside the Ray job)

    @classmethod
    def run_inside(cls, argv: Sequence[str], run_job: RunJob) -> int | None:
        return inside.run_inside(argv, run_job)

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
        try:
            notes.append(shipment(job, submission.out).describe())
        except LauncherError as exc:
            notes.append(f"would not be submitted: {exc}")
        return requests, notes

    def submit_run(self, submission: Submission, *, events: RunEvents, stop: object | None, detach: bool) -> SubmittedRun:
        """Submit, follow the job's log to its end, bring its run directory back under ``out``;
        with ``detach``, return once submitted (``launch attach RUN --address URL`` follows it)."""
        job, address = submission.job, check_address(self.address)
        jobs = client(address)
        job_id = submission_id(job.spec.name, submission.run_id)
        shipped = shipment(job, submission.out)  # an oversized working directory is refused here, before anything is submitted
        run_dir = Path(submission.out).resolve() / job.spec.name / submission.run_id
        signals: list[str] = []
        with ray_logs_into(run_dir / RAY_LOG_FILE):
            with handling_stop_signals(lambda signum, _frame: signals.append(signal.Signals(signum).name)):
                job_id = _submit(jobs, job, job_id, submission.run_id, address, shipped)
                events.message(f"submitted Ray job {job_id} to {address}  (dashboard: {address}/#/jobs/{job_id})")
                events.note(shipped.describe())
                if detach:
                    hint = (f"run {submission.run_id} (Ray job {job_id}) goes on on the cluster; follow it: launch attach {submission.run_id} "
                            f"--address {address}  (Ctrl-C leaves it running)\n  launch status|logs|stop {submission.run_id} --address {address}")  # fmt: skip
                    return SubmittedRun(self.name, job.spec.name, submission.run_id, run_dir, job_id=job_id, scheduler_address=address, pending_hint=hint)
                run = self.follow(job_id, Path(submission.out), events, on_interrupt="stop", signals=signals, stop=stop)
                assert run is not None  # "stop": an interrupt stops the job, and its record comes back
                return run

    def attach_run(self, run_or_job_id: str, *, out: Path, events: RunEvents) -> SubmittedRun | None:
        """Follow a submitted job (its run id or its submission id) as a foreground ``--address``
        run does after submitting, from its start; SIGINT or SIGTERM leave it running (None)."""
        address = check_address(self.address)
        job_id = self.status(run_or_job_id).job_id  # a clear error for an unknown run
        signals: list[str] = []
        with handling_stop_signals(lambda signum, _frame: signals.append(signal.Signals(signum).name)):
            events.message(f"attached to Ray job {job_id} at {address}  (dashboard: {address}/#/jobs/{job_id})")
            return self.follow(job_id, out, events, on_interrupt="detach", signals=signals)

    def follow(
        self, job_id: str, out: Path, events: RunEvents, *, on_interrupt: str, signals: list[str], stop: object | None = None
    ) -> SubmittedRun | None:
        """The job's wire, followed to its end, its run directory brought back under ``out``: its
        record. Interrupted (a signal in ``signals``, or ``stop``): ``on_interrupt`` "stop" stops
        the job and waits for it (its record); "detach" leaves it running (None)."""
        address = check_address(self.address)
        jobs = client(address)
        run = RayJobRun(jobs, job_id)
        try:
            reader = WireReader(events, "ray")
            state = follow(run, reader, interrupted=lambda: bool(signals) or bool(stop))
            reader.close()  # the live line goes before anything else is said (an interrupt)
            if state is None:
                if on_interrupt == "detach":
                    run_id = (_metadata(jobs, job_id).get("run_id") or job_id)
                    events.message(f"detached: Ray job {job_id} goes on (launch attach {run_id} --address {address} follows it again, "
                                   f"launch stop {run_id} --address {address} stops it)")  # fmt: skip
                    return None
                state = _stop_after_interrupt(jobs, job_id, signals[0] if signals else "stop request", events, signals, run, reader)
            return _brought_back(job_id, state, run, out, address, events)
        finally:
            run.close()

    def without_result(self, run: SubmittedRun) -> LauncherError:
        """One line (never a traceback) with the job's own exit code when no result came back whole."""
        jobs = client(check_address(self.address))
        said = run.said_error or _said_error(job_log_lines(jobs, run.job_id))  # an error before the wire was open: in the job's log
        why = f": {said}" if said else ""
        return LauncherError(
            f"Ray job {run.job_id} ended {run.state} without sending its result back{why} (see: launch logs {run.job_id} --address {run.scheduler_address})",
            exit_code=EXIT_INTERRUPTED if run.state == "STOPPED" else _exit_code(jobs, run.job_id),
        )

    def status(self, job_id: str) -> JobInfo:
        jobs = client(self.address)
        job_id = _job_of(jobs, job_id)
        try:
            info = jobs.get_job_info(job_id)
        except Exception as exc:  # noqa: BLE001
            raise LauncherError(f"no Ray job {job_id!r} at {check_address(self.address)}: {one_line(exc)}", exit_code=EXIT_BAD_INPUT) from None
        state = str(getattr(info.status, "value", info.status))
        return JobInfo(job_id, state, state in TERMINAL, info.message or "", dict(info.metadata or {}), info.entrypoint)

    def logs(self, job_id: str, *, follow: bool, echo: Callable[[str, str], None]) -> None:
        """The job's log, which is for people (the wire has a file of its own)."""
        job_id = self.status(job_id).job_id  # a clear error for an unknown job; a run id names its job
        jobs = client(self.address)
        if not follow:
            for line in str(jobs.get_job_logs(job_id)).splitlines():
                _echo(line, echo)
            return
        tail = LogTail(jobs, job_id)
        while True:
            for line in tail.lines():
                _echo(line, echo)
            if status(jobs, job_id) in TERMINAL:
                break
            time.sleep(0.5)
        for line in tail.lines(final=True):
            _echo(line, echo)

    def stop(self, job_id: str) -> JobInfo:
        job_id = self.status(job_id).job_id
        stop_and_wait(client(self.address), job_id)
        return self.status(job_id)


def submission_id(job: str, run_id: str) -> str:
    """The Ray job of a run: ``<job>-<run id>`` (the run directory is ``<job>/<run id>``)."""
    return f"{job}-{run_id}"


def _metadata(jobs: Any, job_id: str) -> dict[str, str]:
    try:
        return dict(jobs.get_job_info(job_id).metadata or {})
    except Exception:  # noqa: BLE001 - the head is gone: no metadata
        return {}


def _job_of(jobs: Any, given: str) -> str:
    """The submission id ``given`` names: itself, or the job of the run whose id it is."""
    try:
        jobs.get_job_info(given)
        return given
    except Exception:  # noqa: BLE001 - not a submission id: perhaps a run id
        pass
    try:
        found = {j.submission_id for j in jobs.list_jobs() if j.submission_id and (j.metadata or {}).get("run_id") == given}
    except Exception:  # noqa: BLE001 - the caller says the job is unknown
        return given
    return found.pop() if len(found) == 1 else given


def _echo(line: str, echo: Callable[[str, str], None]) -> None:
    """A line of the job's log as ``launch logs`` shows it (a job whose wire went into its log,
    having no file for it: the wire's and the bundle's lines left out)."""
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
    """A submitted Ray job as the follow loop sees it: its wire file, streamed, and its status.
    A job that wrote no wire file (its driver's output was not a Ray job log) wrote its wire into
    its log: read whole once it has ended."""

    def __init__(self, jobs: Any, job_id: str) -> None:
        self.jobs, self.job_id = jobs, job_id
        self.wire = WireTail(jobs, job_id)
        self.bundle = BundleLines()
        self.said_error: str | None = None  # the launcher inside's last "error: ..." line
        self._read_log = False

    def new_lines(self, final: bool = False) -> list[str]:
        lines = self.wire.lines(final)
        if final and not self.wire.found and not self._read_log:
            self._read_log = True
            lines += job_log_lines(self.jobs, self.job_id)
        out = []
        for line in lines:
            if self.bundle.take(line):
                continue
            if line.startswith("error: "):
                self.said_error = line[len("error: ") :]
            out.append(line)
        return out

    def ended(self, reader: WireReader) -> str | None:
        state = status(self.jobs, self.job_id)
        return state if state in TERMINAL else None

    def close(self) -> None:
        self.wire.close()


def job_log_lines(jobs: Any, job_id: str) -> list[str]:
    try:
        return str(jobs.get_job_logs(job_id)).splitlines()
    except Exception:  # noqa: BLE001 - the head is gone: nothing more to read
        return []


def _effective_spec(job: LoadedJob, script: str | None = None) -> dict[str, Any]:
    data = job.spec.model_dump(mode="json")
    data["backend"] = "ray"
    data["extends"] = None  # merged already
    data["cluster"] = None  # hosts come from the Ray cluster
    data["ray"]["address"] = None  # inside the job the engine connects; it must not submit again
    if script is not None:
        data["script"] = script  # where it is in the working dir the job runs in
    return data


def shipment(job: LoadedJob, out: Path | str | None) -> Shipment:
    """What the Ray job's working directory will hold (``workdir``): refused (exit 2, one line)
    when over ``ray.working_dir_max_mb``, or when it would not hold the spec's ``script``."""
    settings = job.spec.ray
    root = job.base_dir / settings.working_dir if settings.working_dir else job.base_dir
    shipped = select(root, excludes=settings.excludes, out=Path(out) if out else None, cap_bytes=int(settings.working_dir_max_mb * 1024**2), label=str(job.path))
    script = job.script_path()
    if script is not None and not shipped.has(script):
        raise LauncherError(
            f"{job.path}: script: {job.spec.script} would not be in the Ray job's working directory {root} (outside it, or left out "
            "by a .gitignore or ray.excludes); set ray.working_dir to a directory that holds it; nothing was submitted",
            exit_code=EXIT_BAD_INPUT,
        )
    return shipped


def _working_dir(job: LoadedJob, shipped: Shipment) -> Path:
    """A temporary folder with the shipment's files and the effective spec: what Ray uploads."""
    import yaml

    root = Path(tempfile.mkdtemp(prefix="gpulaunch-submit-"))
    work = root / "job"
    try:
        work.mkdir()
        materialize(shipped, work)
        script = job.script_path()
        relative = script.resolve().relative_to(shipped.root.resolve()).as_posix() if script is not None else None
        (work / SPEC_FILE).write_text(yaml.safe_dump(_effective_spec(job, relative), sort_keys=False))
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return work


def _submit(jobs: Any, job: LoadedJob, job_id: str, run_id: str, address: str, shipped: Shipment) -> str:
    import launcher
    from launcher.backends.ray import job_metadata
    from launcher.spec.model import JobSpec

    metadata = {**job_metadata(JobSpec.model_validate(_effective_spec(job))), "run_id": run_id}  # the spec run inside
    work = _working_dir(job, shipped)
    try:
        return jobs.submit_job(
            entrypoint=f"python -m {ENTRYPOINT_MODULE} ray {SPEC_FILE} {run_id}",
            submission_id=job_id,
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


def _brought_back(job_id: str, state: str, run: RayJobRun, out: Path, address: str, events: RunEvents) -> SubmittedRun:
    """The run directory the job sent back, unpacked under ``out`` (None: none came back whole),
    as the run's record; the results layer checks its result (``without_result`` when none came
    back whole)."""
    if state != "STOPPED":
        run.new_lines(final=True)  # the bundle is the log's last lines
    run_dir = run.bundle.unpack(out)
    if run_dir is not None:
        _say_what_stayed(run_dir, events)
    job, run_id = (run_dir.parent.name, run_dir.name) if run_dir is not None else ("", "")
    return SubmittedRun("ray", job, run_id, run_dir, job_id=job_id, scheduler_address=address, state=state, said_error=run.said_error, brought_back=True)


def _said_error(lines: list[str]) -> str | None:
    errors = [line[len("error: ") :] for line in lines if line.startswith("error: ")]
    return errors[-1] if errors else None


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

