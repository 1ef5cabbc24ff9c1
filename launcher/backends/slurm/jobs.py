"""``launch status|logs|stop JOB_ID`` for a Slurm job id (the Ray Jobs API's commands, for Slurm).

The job's state comes from ``squeue`` (any state slurmctld still remembers), then ``sacct`` where
the cluster keeps accounting; its run directory from ``scontrol show job`` (its output file is
there). A gpulaunch job that has ended without a ``result.json`` (its batch host was lost, it was
cancelled before it ran) gets one written here, so ``launch report RUN_DIR`` renders it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from launcher.backends.slurm import commands
from launcher.backends.slurm.outcome import settle
from launcher.backends.slurm.script import RECORD_FILE, STOP_SIGNAL
from launcher.errors import EXIT_BAD_INPUT, LauncherError
from launcher.stage.engine import JobInfo
from launcher.stage.wire import readable

STOP_GRACE_S = 15.0  # after STOP_SIGNAL, for the launcher inside to stop its steps and write its result
KILL_WAIT_S = 60.0  # after scancel, for Slurm to end every step (KillWait, then SIGKILL)
ACTIVE_NOT_STARTED = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESV_DEL_HOLD")


class OutputTail:
    """The job's output file, read a whole line at a time as the job writes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pos = 0
        self._partial = b""

    def lines(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as handle:
                if os.fstat(handle.fileno()).st_size < self._pos:  # truncated: a requeued job's output (--open-mode=truncate)
                    self._pos, self._partial = 0, b""
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



def job_of_run(given: str) -> str:
    """The Slurm job ``given`` names: a job id, or a run id (the job is named ``<job>-<run id>``)
    while slurmctld remembers its job."""
    if given.isdigit():
        return given
    done = commands.run(["squeue", "-h", "-t", "all", "-o", "%i|%j"])
    if done.returncode != 0:
        raise commands.SlurmError(f"squeue failed: {commands.one_line(done.stderr or done.stdout)}")
    found = sorted({i for i, _, name in (line.partition("|") for line in done.stdout.splitlines()) if name.endswith(f"-{given}")})
    if len(found) != 1:
        why = "no Slurm job" if not found else f"{len(found)} Slurm jobs ({', '.join(found)})"
        raise LauncherError(f"{given!r}: {why} of that run id in squeue (a Slurm job id is a number)", exit_code=EXIT_BAD_INPUT)
    return found[0]


def locate(job_id: str) -> tuple[commands.JobState, dict[str, str], Path | None]:
    """The job's state, its ``scontrol`` record and its run directory (None: not a gpulaunch run)."""
    return _locate(job_id)


def _locate(job_id: str) -> tuple[commands.JobState, dict[str, str], Path | None]:
    if not job_id.isdigit():
        raise LauncherError(f"{job_id!r}: a Slurm job id is a number", exit_code=EXIT_BAD_INPUT)
    record = commands.job_record(job_id) or {}
    state = commands.state_of(job_id)
    if state is None:
        raise LauncherError(
            f"no Slurm job {job_id}: slurmctld does not know it (it forgets a job MinJobAge after it ends) and "
            "there is no accounting to ask; its run directory has its result (launch report RUN_DIR)",
            exit_code=EXIT_BAD_INPUT,
        )
    out = record.get("StdOut", "")
    run_dir = Path(out).parent if out and (Path(out).parent / RECORD_FILE).is_file() else None
    return state, record, run_dir


def job_info(job_id: str) -> JobInfo:
    state, record, run_dir = _locate(job_id)
    if state.state in ("PENDING", "CONFIGURING"):
        message = f"waiting: {state.reason}"
    elif not state.terminal:
        message = f"on {state.nodes}"
    else:
        message = f"exit code {state.exit_code or '?'}"
    restarts = commands.restarts_of(record)
    if restarts:
        message += f"; requeued {restarts} time(s), each run resuming the last"
    metadata = {"job_name": record.get("JobName", ""), "partition": record.get("Partition", ""), "nodes": state.nodes}
    if run_dir is not None:
        metadata["run_dir"] = str(run_dir)
        if state.terminal:
            data = settle(run_dir, job_id, state)
            metadata["result"] = str(data.get("status"))
            message += f"; run {data.get('status')}" + (f": {data['failure']['summary']}" if data.get("failure") else "")
    return JobInfo(job_id, state.state, state.terminal, message, {k: v for k, v in metadata.items() if v}, record.get("Command", ""))


def job_logs(job_id: str, *, follow: bool, echo: Callable[[str, str], None]) -> None:
    """The job's output as the run showed it (``host:rank text``, the launcher's lines)."""
    state, record, _ = _locate(job_id)
    out = record.get("StdOut")
    if not out:
        raise LauncherError(f"Slurm job {job_id}: slurmctld does not say where its output is", exit_code=EXIT_BAD_INPUT)
    tail = OutputTail(Path(out))
    while True:
        for line in tail.lines():
            shown = readable(line)
            if shown is not None:
                echo(*shown)
        if not follow or state.terminal:
            break
        time.sleep(0.5)
        now = commands.squeue_state(job_id)
        if now is None:  # slurmctld has forgotten it (MinJobAge): it has ended
            break
        state = now
    for line in tail.lines(final=True):
        shown = readable(line)
        if shown is not None:
            echo(*shown)


def stop_job(job_id: str) -> str:
    """Cancel the job, wait until every step of it is gone; its final state."""
    state, record, run_dir = _locate(job_id)
    # requeued and waiting to run again: the run directory's result is the allocation before's
    requeued = state.state in ACTIVE_NOT_STARTED and bool(commands.restarts_of(record))
    if not state.terminal:
        state = cancel_and_wait(job_id) or state
        state = commands.state_of(job_id) or state
    if run_dir is not None and state.terminal:
        settle(run_dir, job_id, state, interrupted=f"launch stop {job_id}", requeued=requeued)
    return state.state


def cancel_and_wait(job_id: str, *, hurry: Any = lambda: False, pump: Any = lambda: None) -> commands.JobState | None:
    """Cancel a job and wait until it has left every active state (its steps are gone): a
    running one's batch script first gets STOP_SIGNAL (the launcher inside gets SIGTERM, stops its
    steps and writes its result, then the script cancels the job: Slurm records CANCELLED), then
    ``scancel`` after STOP_GRACE_S (at once when ``hurry()`` turns true). A job being requeued
    (COMPLETING, then pending again) is cancelled once it pends."""
    try:
        state = commands.squeue_state(job_id)
    except commands.SlurmError:  # slurmctld does not answer: ask for the cancel all the same
        commands.cancel(job_id)
        return wait_ended(job_id, STOP_GRACE_S, hurry, pump)
    if state is None or state.terminal:
        return state
    if state.state == "COMPLETING":
        state = wait_ended(job_id, KILL_WAIT_S, hurry, pump, until=lambda s: s.state != "COMPLETING")
        if state is None or state.terminal or state.state == "COMPLETING":
            return state
    if state.state in ACTIVE_NOT_STARTED:
        commands.cancel(job_id)
    else:
        commands.cancel(job_id, batch_signal=STOP_SIGNAL)
        state = wait_ended(job_id, STOP_GRACE_S, hurry, pump)
        if state is None or state.terminal:
            return state
        commands.cancel(job_id)
    return wait_ended(job_id, KILL_WAIT_S, lambda: False, pump)


def wait_ended(
    job_id: str, timeout_s: float, hurry: Any, pump: Any, *, until: Callable[[commands.JobState], bool] = lambda _s: False
) -> commands.JobState | None:
    """Until the job has ended (or ``until(state)``), ``timeout_s`` at most, or ``hurry()``."""
    deadline = time.monotonic() + timeout_s
    state = None
    while True:
        try:
            state = commands.squeue_state(job_id)
        except commands.SlurmError:
            pass  # slurmctld did not answer this time: ask again until the deadline
        else:
            if state is None or state.terminal or until(state):
                return state
        pump()
        if time.monotonic() > deadline or hurry():
            return state
        time.sleep(0.2)
