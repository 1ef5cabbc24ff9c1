"""A stage engine defined outside the launcher, plugged in through the public seam alone.

Every rank of a StagePlan is a plain local subprocess, ``python -m launcher.runtime.worker
STAGE/worker.json``, started with the environment torchrun would give it (``StagePlan.rank_env``);
rank 0 hosts the rendezvous store itself (``env://``, as without an agent). Its output goes to the
stage's LogRouter line by line, as ``host:rank``. Its channel for the ranks' events is this
machine's disk: the runtime's own ``RankForwarder`` runs here, in the launcher, reads the ranks'
beacon and report files and hands its lines to the LogRouter, which turns them into events, exactly
as it does for an agent's output. poll(): done when every rank has exited (ok when all exited 0),
a non-zero exit reported as ``RankExited``. stop(): SIGTERM, then SIGKILL, by pid.

Its settings block, ``subprocess: {env: {...}, grace_s: ...}`` in the spec (``SubprocessSettings``,
validated by the spec loader at file:line like any field): variables added to every rank's
environment, and how long ``stop`` waits before SIGKILL. With ``submit: true`` a run is handed to
its submitter (``SubprocessSubmitter``): a detached local process stands in for a scheduler's job,
runs the launcher inside (``python -m launcher.control.submitted subprocess RUN_DIR``'s
equivalent, after registering this engine there too) and is followed over the remote-run wire
(``launcher.stage.wire``) in its output file; ``launch status|logs|stop local:RUN_DIR`` reach it.

Registered from a test with one call, ``register()``; nothing under ``launcher/`` knows it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, ContextManager, Mapping, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field

from launcher import backends
from launcher.errors import EXIT_BAD_INPUT, LauncherError
from launcher.protocol import StagePaths
from launcher.masking import mask_env
from launcher.procutil import read_json
from launcher.records import RESULT_FILE, AsSubmitted, Failure, FailureReason, RankExit, SubmittedRun
from launcher.runtime.forwarder import RankForwarder
from launcher.spec.model import LoadedJob
from launcher.stage.engine import HandleStatus, JobInfo, LaunchRequest, RunJob, StageEngine, StageHandle, Submission, Submitter
from launcher.stage.events import RankExited
from launcher.stage.logrouting import LogRouter
from launcher.stage.plan import RankSlot, StagePlan
from launcher.stage.watch import RunEvents
from launcher.stage.wire import RemoteRun, WireEvents, WireReader, follow, readable

NAME = "subprocess"
WORKER = ("-m", "launcher.runtime.worker")
INSIDE = "GPULAUNCH_SUBPROCESS_INSIDE"  # set for the launcher inside a submitted run: it is not submitted again
REPO = Path(__file__).resolve().parents[2]


def register() -> None:
    """The one registry entry: the engine, its settings block and its submitter."""
    backends.register_engine(NAME, SubprocessEngine, settings=SubprocessSettings, submitter=SubprocessSubmitter)


class SubprocessSettings(BaseModel):
    """The spec's ``subprocess:`` block."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    env: dict[str, str] = Field(default_factory=dict)  # added to every rank's environment
    grace_s: float = Field(5.0, gt=0, le=60)  # stop: SIGTERM, this long, then SIGKILL
    submit: bool = False  # hand the run to the submitter (a detached local process runs the launcher)


def settings_of(job: LoadedJob) -> SubprocessSettings:
    settings = job.spec.engine_settings(NAME)
    return settings if isinstance(settings, SubprocessSettings) else SubprocessSettings()  # registered without its block


class SubprocessEngine(StageEngine):
    name = NAME

    def __init__(self) -> None:
        self.settings = SubprocessSettings()

    def check_job(self, job: LoadedJob, cluster: str | None) -> None:
        if cluster is not None or job.spec.cluster is not None:
            raise LauncherError(f"{NAME}: runs every rank on this machine; drop the cluster file", exit_code=EXIT_BAD_INPUT)
        self.settings = settings_of(job)

    def session(self, job: LoadedJob) -> ContextManager[None]:
        self.settings = settings_of(job)
        return contextlib.nullcontext()

    def launch_request(self, plan: StagePlan) -> LaunchRequest:
        env = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(self.settings.env.items()))
        commands = tuple(f"[{r.host}] $ {env}RANK={r.rank} {shlex.join([sys.executable, *WORKER, str(plan.paths.worker_config)])}" for r in plan.ranks)
        return LaunchRequest(self.name, commands, ("each rank a plain subprocess; rank 0 hosts the rendezvous store",))

    def start(self, plan: StagePlan, logs: LogRouter) -> StageHandle:
        stage = SubprocessStage(plan, logs, self.settings)
        stage.start()
        return stage


class SubprocessStage(StageHandle):
    def __init__(self, plan: StagePlan, logs: LogRouter, settings: SubprocessSettings | None = None) -> None:
        super().__init__(plan, logs)
        self.settings = settings or SubprocessSettings()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.readers: list[threading.Thread] = []
        self.forwarder = RankForwarder(StagePaths(plan.stage_dir), [r.rank for r in plan.ranks], lambda line: logs.route(line, "disk"))
        self.told: set[int] = set()

    def start(self) -> None:
        for slot in self.plan.ranks:
            env = {**os.environ, **self.settings.env, **self.plan.rank_env(slot), "TORCHELASTIC_RESTART_COUNT": "0", "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen(
                [sys.executable, *WORKER, str(self.plan.paths.worker_config)],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            self.procs[slot.rank] = proc
            assert proc.stdout is not None
            reader = threading.Thread(target=self._pump, args=(slot, proc.stdout), daemon=True)
            reader.start()
            self.readers.append(reader)
        self.forwarder.start()

    def _pump(self, slot: RankSlot, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            self.logs.write_rank_line(slot.rank, slot.host, raw.decode(errors="replace").rstrip("\n"))
        stream.close()

    def poll(self) -> HandleStatus:
        codes = {rank: proc.poll() for rank, proc in self.procs.items()}
        for rank, code in codes.items():
            if code not in (None, 0) and rank not in self.told:
                self.told.add(rank)
                signame = signal.Signals(-code).name if code < 0 else None
                self.emit(RankExited(RankExit(rank, None if signame else code, signame, host=self.plan.ranks[rank].host)))
        if any(code is None for code in codes.values()):
            return HandleStatus(done=False)
        for reader in self.readers:
            reader.join(timeout=5)
        self.forwarder.stop()  # its last sweep: every report the ranks wrote on their way out
        ok = all(code == 0 for code in codes.values())
        return HandleStatus(done=True, ok=ok, detail="" if ok else f"rank exits {codes}")

    def stop(self, grace_s: float = 5.0) -> None:
        live = [p for p in self.procs.values() if p.poll() is None]
        for sig, wait in ((signal.SIGTERM, min(grace_s, self.settings.grace_s)), (signal.SIGKILL, 5.0)):
            for proc in live:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
            for proc in live:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=wait)
            live = [p for p in live if p.poll() is None]
        self.forwarder.stop()

    def signal_ranks(self, signum: int) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signum)


# --- the submit path: a whole run handed to a "scheduler" (a detached local process) ----------------

OUTPUT = "job.out"  # the job's output: the remote-run wire
JOB_FILE = "job.json"  # the job's pid, for status and stop
INSIDE_CODE = (
    "import sys; from tests.integration.subprocess_engine import register; register(); "
    "from launcher.control.submitted import main; sys.exit(main(sys.argv[1:]))"
)


def inside_argv(run_dir: Path) -> list[str]:
    """``python -m launcher.control.submitted subprocess RUN_DIR``, this engine registered first
    (the launcher inside is a fresh interpreter: an engine from outside launcher/ registers itself there)."""
    return [sys.executable, "-c", INSIDE_CODE, NAME, str(run_dir)]


class SubprocessSubmitter(Submitter):
    name = NAME
    usage = "RUN_DIR"

    @classmethod
    def claims(cls, job_id: str, address: str | None) -> bool:
        return job_id.startswith("local:")

    @classmethod
    def takes_run(cls, job: LoadedJob, address: str | None, env: Mapping[str, str]) -> bool:
        return settings_of(job).submit and env.get(INSIDE) != "1"

    @classmethod
    def run_inside(cls, argv: Sequence[str], run_job: RunJob) -> int | None:
        if len(argv) != 1:
            return None
        from launcher.spec.model import load_job

        run_dir = Path(argv[0])
        try:
            result = run_job(load_job(run_dir / "spec.yaml"), backend=NAME, run_dir=run_dir, events=WireEvents(), metrics=False)
        except LauncherError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return exc.exit_code
        return result.exit_code

    def check_job(self, job: LoadedJob, cluster: str | None = None) -> None:
        SubprocessEngine().check_job(job, cluster)

    def dry_run(self, submission: Submission) -> tuple[list[LaunchRequest], list[str]]:
        run_dir = submission.out.resolve() / submission.job.spec.name / "<run-id>"
        request = LaunchRequest(NAME, (f"$ {shlex.join(inside_argv(run_dir))} > {run_dir / OUTPUT} &",))
        return [request], ["planned inside the job, on this machine"]

    def submit_run(self, submission: Submission, *, events: RunEvents, stop: object | None, detach: bool) -> SubmittedRun:
        job = submission.job
        run_dir = submission.out.resolve() / job.spec.name / submission.run_id
        run_dir.mkdir(parents=True)
        (run_dir / "spec.yaml").write_text(yaml.safe_dump(job.spec.model_dump(mode="json"), sort_keys=False))
        env = {**os.environ, INSIDE: "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        with open(run_dir / OUTPUT, "wb") as out:
            proc = subprocess.Popen(inside_argv(run_dir), env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=job.base_dir)  # fmt: skip
        (run_dir / JOB_FILE).write_text(json.dumps({"pid": proc.pid}))
        job_id = f"local:{run_dir}"
        events.message(f"submitted {job_id} (pid {proc.pid})")
        if detach:
            return SubmittedRun(NAME, job.spec.name, submission.run_id, run_dir, job_id=job_id, pending_hint=f"launch status|logs|stop {job_id}")
        reader = WireReader(events, NAME)
        state = follow(_OutputFile(run_dir, proc.poll), reader, interrupted=lambda: bool(stop), poll_s=0.1)
        if state is None:  # stopped here: the job too
            self.stop(job_id)
            reader.feed(_OutputFile(run_dir, proc.poll).new_lines(final=True))
        reader.close()
        proc.wait()
        # the run's record as the "scheduler" left it: the results layer reads the result the
        # launcher inside wrote, or makes one from why the job ended where it wrote none
        why = Failure(FailureReason.NOT_STARTED, f"{job_id} exited {proc.returncode} without the launcher inside writing a result")
        return SubmittedRun(NAME, job.spec.name, submission.run_id, run_dir, job_id=job_id, state=state or "STOPPED", ended_without=why,
                            submitted=AsSubmitted(_shown_spec(job), job.spec.fingerprint(), dict(job.params), None))  # fmt: skip

    def status(self, job_id: str) -> JobInfo:
        run_dir = _run_dir(job_id)
        alive = _alive(run_dir)
        result = read_json(run_dir / RESULT_FILE) or {}
        status = "RUNNING" if alive else str(result.get("status", "ENDED")).upper()
        return JobInfo(job_id, status, terminal=not alive, entrypoint=shlex.join(inside_argv(run_dir)))

    def logs(self, job_id: str, *, follow: bool, echo: Callable[[str, str], None]) -> None:
        run_dir = _run_dir(job_id)
        output = _OutputFile(run_dir, lambda: None if _alive(run_dir) else 0)
        while True:
            ended = output.ended(None) is not None
            for line in output.new_lines(final=ended):
                shown = readable(line)
                if shown is not None:
                    echo(*shown)
            if ended or not follow:
                return
            time.sleep(0.1)

    def stop(self, job_id: str) -> JobInfo:
        run_dir = _run_dir(job_id)
        pid = int(json.loads((run_dir / JOB_FILE).read_text())["pid"])
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)  # the launcher inside stops its ranks and writes its record
        deadline = time.monotonic() + 30
        while _alive(run_dir) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.status(job_id)


def _shown_spec(job: LoadedJob) -> dict[str, object]:
    spec = job.spec.model_dump(mode="json")
    return {**spec, "env": mask_env(spec["env"])}  # a result made here shows the spec as result.json does: secrets masked


def _run_dir(job_id: str) -> Path:
    run_dir = Path(job_id.removeprefix("local:"))
    if not (run_dir / JOB_FILE).is_file():
        raise LauncherError(f"{job_id}: no such {NAME} job", exit_code=EXIT_BAD_INPUT)
    return run_dir


def _alive(run_dir: Path) -> bool:
    pid = int(json.loads((run_dir / JOB_FILE).read_text())["pid"])
    try:
        os.waitpid(pid, os.WNOHANG)  # reaped where it is this process's child
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class _OutputFile(RemoteRun):
    """The job's output file, read as it grows; ended once the job's process has."""

    def __init__(self, run_dir: Path, poll: Callable[[], int | None]) -> None:
        self.path, self.poll, self.offset, self.partial = run_dir / OUTPUT, poll, 0, ""

    def new_lines(self, final: bool = False) -> list[str]:
        with open(self.path, encoding="utf-8", errors="replace") as f:
            f.seek(self.offset)
            text = self.partial + f.read()
            self.offset = f.tell()
        lines = text.split("\n")
        self.partial = "" if final else lines.pop()
        return [line for line in lines if line or not final]

    def ended(self, reader: WireReader | None) -> str | None:
        code = self.poll()
        return None if code is None else ("COMPLETED" if code == 0 else f"EXITED {code}")
