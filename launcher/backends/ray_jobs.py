"""Run a job on an existing Ray cluster through the Ray Jobs API, and ``launch status|logs|stop``.

``launch JOB.yaml --backend ray --address http://HOST:8265`` submits the launcher itself as the
Ray job: a copy of the job's directory (plus the effective spec, overrides applied) is the job's
working dir, ``python -m launcher.control.submitted ray SPEC`` the entrypoint, and the Ray backend inside
connects to that cluster instead of embedding one. The job's logs stream to the console; at the
end the cluster-side launcher prints its run directory as a tagged, checksummed bundle in its last
log lines, which is unpacked under the user's ``--out`` so ``result.json`` is where it would be
after a local run. While it runs, the launcher inside also writes tagged event lines (a stage starts,
its progress about once a second, it ends), which the submitting side turns back into the run's
events (the console's live line) and never shows as the job's output. Token auth (``RAY_AUTH_TOKEN`` / ``~/.ray/auth_token``) is honoured, never
switched off.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import tarfile
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TextIO, Union

from launcher.control.events import PlainEvents, RankLive, RunEvents, StageProgress
from launcher.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_JOB_FAILED, LauncherError
from launcher.procutil import handling_stop_signals
from launcher.protocol import ENV_RAY_CONNECT as CONNECT_ENV
from launcher.records import new_run_id
from launcher.results.store import RunResult, load_result, write_result

if TYPE_CHECKING:
    from launcher.control.planning import StagePlan
    from launcher.spec.model import LoadedJob

SPEC_FILE = "_gpulaunch_job.yaml"
BUNDLE_TAG = "@gpulaunch-bundle "
BUNDLE_END = "@gpulaunch-bundle-end "
EVENT_TAG = "@gpulaunch-event "  # the launcher inside the job: a stage starts, its progress, it ends (JSON)
# The job's log is fetched whole at every poll and kept by Ray: a progress line a second during a
# stage's first minute (start-up is when a user watches), then one every LOG_PROGRESS_LATER_S.
LOG_PROGRESS_EVERY_S = 1.0
LOG_PROGRESS_LATER_S = 10.0
LOG_PROGRESS_FAST_FOR_S = 60.0
CHUNK = 16_000
MAX_BUNDLED_FILE = 1024**2  # larger files (checkpoints) stay on the cluster instead of flooding the job's log
LEFT_FILE = "left_on_cluster.json"
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
POLL_S = 0.5
STOP_WAIT_S = 30.0  # how long an interrupted launch waits for its Ray job to stop
MAX_WORKING_DIR = 50 * 1024**2
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".git", ".venv", "runs", "*.egg-info")


def honour_token_auth() -> None:
    """Use Ray's token if the user has one and did not choose a mode (the launcher never disables it)."""
    if "RAY_AUTH_MODE" in os.environ:
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def _check_address(address: str | None) -> str:
    address = address or os.environ.get("RAY_API_SERVER_ADDRESS") or ""
    if not address.startswith(("http://", "https://")):
        shown = repr(address) if address else "nothing"
        raise LauncherError(
            f"--address: expected the Ray dashboard's http://HOST:8265 address (Ray Jobs API), got {shown}", exit_code=EXIT_BAD_INPUT
        )
    return address.rstrip("/")


def client(address: str | None) -> Any:
    """A JobSubmissionClient, or a one-line error (exit 2) when the cluster cannot be reached."""
    address = _check_address(address)
    honour_token_auth()
    import logging

    logging.getLogger("ray").setLevel(logging.ERROR)
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise LauncherError("--address needs Ray: pip install 'gpulaunch[ray]'", exit_code=EXIT_BAD_INPUT) from None
    try:
        return JobSubmissionClient(address)
    except Exception as exc:  # noqa: BLE001 - connection, auth and version errors all end here
        raise LauncherError(f"cannot use the Ray cluster at {address}: {_one_line(exc)}", exit_code=EXIT_BAD_INPUT) from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if "401" in text or "Unauthorized" in text or "authentication" in text.lower():
        return "authentication failed (set RAY_AUTH_TOKEN or ~/.ray/auth_token to the cluster's token)"
    if "Connection refused" in text or "Failed to connect" in text or "ConnectionError" in type(exc).__name__:
        return "connection refused (is the Ray head running and the dashboard on that port?)"
    return (text or type(exc).__name__)[:300]


# --- submit and wait ---------------------------------------------------------------------------------


def _effective_spec(job: LoadedJob) -> dict[str, Any]:
    data = job.spec.model_dump(mode="json")
    data["backend"] = "ray"
    data["extends"] = None  # merged already
    data["cluster"] = None  # hosts come from the Ray cluster
    data["ray"]["address"] = None  # inside the job the backend connects; it must not submit again
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


def submit_and_wait(job: LoadedJob, *, address: str, out: str | Path, events: RunEvents) -> RunResult:
    """Submit ``job`` to the cluster, stream its logs, bring its run directory back under ``out``.
    Raises LauncherError when the job ended without sending its result back."""
    from launcher.backends.ray import check_single_pool, job_metadata
    from launcher.spec.model import JobSpec

    check_single_pool(job)  # a Ray-specific message for resources.nodes > 1, before submitting
    jobs = client(address)
    address = _check_address(address)
    job_id = f"{job.spec.name}-{new_run_id()}"
    metadata = job_metadata(JobSpec.model_validate(_effective_spec(job)))  # the spec run inside
    try:
        with _signals_interrupt():
            job_id = _submit(jobs, job, job_id, metadata, address)
            events.message(f"submitted Ray job {job_id} to {address}  (dashboard: {address}/#/jobs/{job_id})")
            replay = LogReplay(events)
            try:
                status, logs = _follow(jobs, job_id, feed=replay.feed)
            finally:
                replay.close()  # the live line goes before anything else is said (an interrupt)
    except _Interrupted as exc:
        _stop_after_interrupt(jobs, job_id, exc.signame, events)
        status, logs = _status(jobs, job_id), jobs.get_job_logs(job_id)
    run_dir = unpack_bundle(logs, Path(out))
    if run_dir is None:
        said = [ln[len("error: "):] for ln in job_log_lines(logs) if ln.startswith("error: ")]
        why = f": {said[-1]}" if said else ""
        raise LauncherError(
            f"Ray job {job_id} ended {status} without sending its result back{why} (see: launch logs {job_id} --address {address})",
            exit_code=EXIT_INTERRUPTED if status == "STOPPED" else _exit_code(jobs.get_job_info(job_id)),
        )
    data = load_result(run_dir) or {}
    data["run_dir"] = str(run_dir)  # where it is now, not the cluster's directory
    write_result(run_dir, data)
    _say_what_stayed(run_dir, events)
    result = RunResult(data, run_dir, tuple(str(run_dir / p) for p in data.get("plots", [])))
    events.finished(result)
    return result


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


def _submit(jobs: Any, job: LoadedJob, submission_id: str, metadata: dict[str, str], address: str) -> str:
    import launcher

    work = _working_dir(job)
    try:
        return jobs.submit_job(
            entrypoint=f"python -m launcher.control.submitted ray {SPEC_FILE}",
            submission_id=submission_id,
            metadata=metadata,
            runtime_env={
                "working_dir": str(work),
                "py_modules": [str(Path(launcher.__file__).parent)],
                "excludes": ["__pycache__", "*.pyc"],
                "env_vars": {CONNECT_ENV: "1", "PYTHONUNBUFFERED": "1"},
            },
        )
    except Exception as exc:  # noqa: BLE001
        raise LauncherError(f"cannot submit to {address}: {_one_line(exc)}", exit_code=EXIT_JOB_FAILED) from None
    finally:
        shutil.rmtree(work.parent, ignore_errors=True)


class _Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM while a submitted job runs: the launcher stops that job before exiting."""

    def __init__(self, signame: str) -> None:
        super().__init__(signame)
        self.signame = signame


def _signals_interrupt() -> contextlib.AbstractContextManager[None]:
    """Within this block SIGINT and SIGTERM raise ``_Interrupted`` (SIGTERM would otherwise end the
    launcher at once and leave its Ray job running on the cluster)."""

    def handler(signum: int, _frame: Any) -> None:
        raise _Interrupted(signal.Signals(signum).name)

    return handling_stop_signals(handler)


def _stop_after_interrupt(jobs: Any, job_id: str, signame: str, events: RunEvents) -> None:
    """Stop the submitted job and wait up to STOP_WAIT_S for it to end; a second signal stops the
    waiting (not the stop request, which has been sent)."""
    events.message(f"interrupted ({signame}): stopping Ray job {job_id}")
    try:
        with _signals_interrupt():
            status = _stop_and_wait(jobs, job_id, STOP_WAIT_S)
    except _Interrupted:
        events.message(f"interrupted again: not waiting for Ray job {job_id} to stop (see: launch status {job_id})")
        return
    except LauncherError as exc:  # e.g. interrupted before the submission reached the cluster
        events.message(f"error: {exc}")
        return
    if status in TERMINAL:
        events.message(f"Ray job {job_id}: {status}")
    else:
        events.message(f"warning: Ray job {job_id} is still {status} after {STOP_WAIT_S:g}s (see: launch status {job_id})")


def _exit_code(info: Any) -> int:
    code = getattr(info, "driver_exit_code", None)
    return code if code in (EXIT_JOB_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED) else EXIT_JOB_FAILED


def _follow(jobs: Any, job_id: str, *, feed: Callable[[str], None]) -> tuple[str, str]:
    """Pass the log's new whole lines to ``feed`` until the job ends; return its final status and complete log."""
    shown = 0
    while True:
        status = _status(jobs, job_id)
        logs = jobs.get_job_logs(job_id)
        complete = logs[: logs.rfind("\n") + 1]  # whole lines only; the rest comes next time
        feed(complete[shown:])
        shown = len(complete)
        if status in TERMINAL:
            logs = jobs.get_job_logs(job_id)
            feed(logs[shown:])
            return status, logs
        time.sleep(POLL_S)


def _status(jobs: Any, job_id: str) -> str:
    status = jobs.get_job_status(job_id)
    return str(getattr(status, "value", status))


def job_log_lines(text: str) -> list[str]:
    """The job's log lines a person reads: the result bundle's and the event lines left out, but
    a stage's start shown as its title line."""
    out = []
    for line in text.splitlines():
        if line.startswith(EVENT_TAG):
            event = parse_event(line)
            if isinstance(event, StageStart):
                out.append(event.title)
        elif not line.startswith((BUNDLE_TAG, BUNDLE_END)):
            out.append(line)
    return out


def _echo_lines(text: str, echo: Callable[[str, str], None]) -> None:
    for line in job_log_lines(text):
        _echo_line(line, echo)


def _echo_line(line: str, echo: Callable[[str, str], None]) -> None:
    source, sep, rest = line.partition(" ")
    if sep and ":" in source:  # "host:rank text", as the launcher inside printed it
        echo(source, rest)
    else:
        echo("", line)  # the launcher's own lines inside the job


def _stop_and_wait(jobs: Any, job_id: str, timeout_s: float = 60.0) -> str:
    try:
        jobs.stop_job(job_id)
    except Exception as exc:  # noqa: BLE001
        raise LauncherError(f"cannot stop Ray job {job_id}: {_one_line(exc)}") from None
    deadline = time.monotonic() + timeout_s
    status = _status(jobs, job_id)
    while status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(POLL_S)
        status = _status(jobs, job_id)
    return status


# --- the run's events through the job's log: cluster side and client side --------------------------


@dataclass(frozen=True)
class StageStart:
    """A stage starts inside the job: the arguments of ``RunEvents.stage_started``."""

    job: str
    world_size: int
    device_type: str
    backend: str

    @property
    def title(self) -> str:
        return f"{self.job}: world size {self.world_size} on {self.device_type} ({self.backend})"


@dataclass(frozen=True)
class StageEnd:
    """The stage inside the job ended."""


JobEvent = Union[StageStart, StageProgress, StageEnd]


def encode_event(event: JobEvent) -> str:
    """One tagged line of the job's log for ``event`` (compact JSON: it is fetched again at every poll)."""
    if isinstance(event, StageStart):
        data: dict[str, Any] = {"event": "stage", "job": event.job, "world_size": event.world_size,
                                "device_type": event.device_type, "backend": event.backend}  # fmt: skip
    elif isinstance(event, StageProgress):
        data = _progress_payload(event)
    else:
        data = {"event": "stage_end"}
    return EVENT_TAG + json.dumps(data, separators=(",", ":"))


def _progress_payload(progress: StageProgress) -> dict[str, Any]:
    # each host once; a rank names its host by index: [rank, host, phase, steps, beacon_t, work_s, straggler]
    hosts: dict[str, int] = {}
    ranks = [
        [r.rank, hosts.setdefault(r.host, len(hosts)), r.phase, r.steps, _rounded(r.beacon_t, 3), _rounded(r.work_s, 6), int(r.straggler)]
        for r in progress.ranks
    ]
    return {"event": "progress", "world_size": progress.world_size, "elapsed_s": round(progress.elapsed_s, 2),
            "restarts": progress.restarts, "hosts": list(hosts), "ranks": ranks}  # fmt: skip


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def parse_event(line: str) -> JobEvent | None:
    """The event a tagged line stands for; None for any other line, and for a tagged line that
    does not parse (cut short): it is bookkeeping either way, never the job's output."""
    if not line.startswith(EVENT_TAG):
        return None
    try:
        data = json.loads(line[len(EVENT_TAG) :])
        kind = data["event"]
        if kind == "stage":
            return StageStart(str(data["job"]), int(data["world_size"]), str(data["device_type"]), str(data["backend"]))
        if kind == "progress":
            return _progress_of(data)
        return StageEnd() if kind == "stage_end" else None
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def _progress_of(data: dict[str, Any]) -> StageProgress:
    hosts = [str(h) for h in data["hosts"]]
    ranks = tuple(
        RankLive(int(rank), hosts[host], str(phase), int(steps), _float(beacon_t), _float(work_s), bool(straggler))
        for rank, host, phase, steps, beacon_t, work_s, straggler in data["ranks"]
    )
    phases: dict[str, int] = {}
    for r in ranks:  # as the run loop counts them: derived, so the line need not carry them
        phases[r.phase] = phases.get(r.phase, 0) + 1
    return StageProgress(int(data["world_size"]), float(data["elapsed_s"]), ranks, int(data["restarts"]), phases)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


class JobLogEvents(PlainEvents):
    """The launcher inside a Ray job: rank lines into the job's log as ``host:rank text``, a stage's
    start, progress (every LOG_PROGRESS_EVERY_S, later every LOG_PROGRESS_LATER_S) and end as tagged lines for the submitting
    side; the summary is the client's to show, from the bundle."""

    def __init__(self, stream: TextIO | None = None, *, every_s: float = LOG_PROGRESS_EVERY_S) -> None:
        super().__init__(stream)
        self.every_s = every_s
        self._next_progress = 0.0

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        self._next_progress = 0.0  # the new stage's first reading goes out at once
        self._print(encode_event(StageStart(job, world_size, device_type, backend)))

    def progress(self, plan: StagePlan, progress: StageProgress) -> None:
        if time.monotonic() < self._next_progress:
            return
        later = progress.elapsed_s > LOG_PROGRESS_FAST_FOR_S and self.every_s == LOG_PROGRESS_EVERY_S
        self._next_progress = time.monotonic() + (LOG_PROGRESS_LATER_S if later else self.every_s)
        self._print(encode_event(progress))

    def stage_finished(self) -> None:
        self._print(encode_event(StageEnd()))

    def finished(self, result: RunResult) -> None:
        """Nothing: the client shows the run from the bundle, under its own --out."""


class LogReplay:
    """The submitting side of a job's log, fed its new whole lines: rank lines to
    ``events.rank_output``, the tagged lines back into the events they stand for (the console's
    live line), the bundle's lines to nobody."""

    def __init__(self, events: RunEvents) -> None:
        self.events = events
        self._in_stage = False

    def feed(self, text: str) -> None:
        for line in text.splitlines():
            if line.startswith(EVENT_TAG):
                self._replay(parse_event(line))
            elif not line.startswith((BUNDLE_TAG, BUNDLE_END)):
                _echo_line(line, self.events.rank_output)

    def _replay(self, event: JobEvent | None) -> None:
        if isinstance(event, StageStart):
            self.close()
            self.events.stage_started(event.job, event.world_size, event.device_type, event.backend)
            self._in_stage = True
        elif isinstance(event, StageProgress) and self._in_stage:
            self.events.remote_progress(event)
        elif isinstance(event, StageEnd):
            self.close()

    def close(self) -> None:
        """End a stage the job's log left open (the job was stopped or died inside it)."""
        if self._in_stage:
            self._in_stage = False
            self.events.stage_finished()


# --- the result bundle: cluster side and client side -------------------------------------------------


def emit_bundle(run_dir: Path, write: Any = print, max_file: int = MAX_BUNDLED_FILE) -> list[str]:
    """Print ``run_dir`` (result.json, reports, logs, plots) as tagged base64 lines. Files larger
    than ``max_file`` (checkpoints) stay on the cluster, listed in ``left_on_cluster.json``; the
    paths of those left behind are returned."""
    left = sorted(str(p) for p in run_dir.rglob("*") if p.is_file() and p.stat().st_size > max_file)
    if left:
        listing = {"host": socket.gethostname(), "files": [{"path": f, "bytes": Path(f).stat().st_size} for f in left]}
        (run_dir / LEFT_FILE).write_text(json.dumps(listing, indent=2))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        tar.add(run_dir, arcname=f"{run_dir.parent.name}/{run_dir.name}", filter=lambda info: None if info.isfile() and info.size > max_file else info)
    data = base64.b64encode(buf.getvalue()).decode()
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [""]
    for i, chunk in enumerate(chunks):
        write(f"{BUNDLE_TAG}{i}/{len(chunks)} {chunk}")
    write(f"{BUNDLE_END}{hashlib.sha256(data.encode()).hexdigest()}")
    return left


def unpack_bundle(logs: str, out: Path) -> Path | None:
    """The run directory unpacked under ``out`` from a job's logs, or None if none came back whole."""
    chunks: dict[int, str] = {}
    digest = None
    for line in logs.splitlines():
        if line.startswith(BUNDLE_TAG):
            pos, _, chunk = line[len(BUNDLE_TAG) :].partition(" ")
            chunks[int(pos.partition("/")[0])] = chunk
        elif line.startswith(BUNDLE_END):
            digest = line[len(BUNDLE_END) :].strip()
    data = "".join(chunks[i] for i in sorted(chunks))
    if not chunks or digest != hashlib.sha256(data.encode()).hexdigest():
        return None
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(data)), mode="r:gz") as tar:
        names = tar.getnames()
        tar.extractall(out.resolve(), filter="data")
    top = Path(names[0].split("/")[0]) / names[0].split("/")[1]
    return (out / top).resolve()


# --- launch status | logs | stop ----------------------------------------------------------------------


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    status: str
    message: str
    metadata: dict[str, str]
    entrypoint: str


def job_info(job_id: str, address: str | None) -> JobInfo:
    jobs = client(address)
    try:
        info = jobs.get_job_info(job_id)
    except Exception as exc:  # noqa: BLE001
        raise LauncherError(f"no Ray job {job_id!r} at {_check_address(address)}: {_one_line(exc)}", exit_code=EXIT_BAD_INPUT) from None
    status = str(getattr(info.status, "value", info.status))
    return JobInfo(job_id, status, info.message or "", dict(info.metadata or {}), info.entrypoint)


def job_logs(job_id: str, address: str | None, *, follow: bool, echo: Callable[[str, str], None]) -> None:
    job_info(job_id, address)  # a clear error for an unknown job
    jobs = client(address)
    if follow:
        _follow(jobs, job_id, feed=lambda text: _echo_lines(text, echo))
    else:
        _echo_lines(jobs.get_job_logs(job_id), echo)


def stop_job(job_id: str, address: str | None) -> str:
    """Stop a submitted job and wait for it to end; its final status."""
    job_info(job_id, address)
    return _stop_and_wait(client(address), job_id)


