"""The inside half of a Slurm batch job: ``python -m launcher.control.submitted slurm RUN_DIR``.

The launcher runs inside the job (the control side's ``run_job``, passed in), into the run
directory the submitting launcher made on the shared filesystem (it follows the job's output and
that directory); the wire goes into the job's output. A Slurm job that Slurm started again
(requeued: its warning before the time limit, preemption, a lost node, ``scontrol requeue``)
resumes its run in the same run directory: the stages that succeeded are kept, the unfinished
one's job loads its last checkpoint. Interrupted with progress saved, the launcher exits
EXIT_RESUMABLE, which the batch script reads (and turns into 130).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from launcher.errors import EXIT_INTERRUPTED, LauncherError
from launcher.stage.engine import RunJob

USAGE = "RUN_DIR"


def run_inside(argv: Sequence[str], run_job: RunJob) -> int | None:
    """Run the launcher inside this Slurm batch job (None: not its arguments)."""
    if len(argv) != 1:
        return None
    return inside_slurm(run_job, argv[0])


def inside_slurm(run_job: RunJob, run_dir: str) -> int:
    """A job Slurm started again (``SLURM_RESTART_COUNT``), or a run directory whose last result
    is interrupted, resumes the run there."""
    from launcher.backends.slurm.script import EXIT_RESUMABLE, SPEC_FILE
    from launcher.procutil import read_json
    from launcher.records import RESULT_FILE, RunStatus
    from launcher.spec.model import load_job
    from launcher.stage.wire import WireEvents

    folder = Path(run_dir)
    restarts = restart_count(os.environ)
    last = read_json(folder / RESULT_FILE)
    last = last if isinstance(last, dict) else None
    resume = restarts > 0 or (last is not None and last.get("status") == RunStatus.INTERRUPTED.value)
    events = WireEvents()
    try:
        job = load_job(folder / SPEC_FILE)
        if resume:
            again = f"Slurm started job {os.environ.get('SLURM_JOB_ID', '?')} again (restart {restarts})" if restarts else "run again"
            events.message(f"{again}: resuming the run in {folder} (its finished stages kept, the others from their last checkpoints)")
        result = run_job(job, backend="slurm", run_dir=run_dir, events=events, metrics=False, resume=resume)
    except LauncherError as exc:
        for line in str(exc).splitlines() or ["failed"]:
            print(f"error: {line}", file=sys.stderr, flush=True)
        return exc.exit_code
    if result.exit_code == EXIT_INTERRUPTED and saved_progress(last if resume else None, result.data):
        return EXIT_RESUMABLE
    return result.exit_code


def restart_count(env: Mapping[str, str]) -> int:
    """How many times Slurm has started this job again (0 on its first run)."""
    value = env.get("SLURM_RESTART_COUNT", "")
    return int(value) if value.isdigit() else 0


def saved_progress(before: Mapping[str, Any] | None, after: Mapping[str, Any]) -> bool:
    """Whether an interrupted run moved on in this allocation, so that a requeue continues it
    rather than starting the same work over (and over): another stage succeeded, or the stage it
    stopped in has a complete checkpoint newer than the one it started from. ``before``: the
    run's last result when this allocation began (None: a fresh run)."""
    if after.get("status") != "interrupted":
        return False

    def succeeded(result: Mapping[str, Any] | None) -> int:
        return sum(1 for stage in (result or {}).get("stages") or [] if stage.get("status") == "succeeded")

    if succeeded(after) > succeeded(before):
        return True
    stages = after.get("stages") or []
    if not stages or stages[-1].get("status") == "succeeded":
        return False
    attempts = stages[-1].get("attempts") or []
    if not attempts:
        return False
    started, saved = attempts[0].get("resumed_step"), attempts[-1].get("checkpoint_step")
    return saved is not None and (started is None or saved > started)
