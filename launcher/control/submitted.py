"""The entrypoint of a run submitted to a cluster: ``python -m launcher.control.submitted ray SPEC
RUN_ID`` inside a Ray job, or ``python -m launcher.control.submitted slurm RUN_DIR`` inside a Slurm
batch job.

On the cluster this module runs the same ``run_job`` with the engine connected to that cluster,
and every event of the run goes over the remote-run wire (``launcher.stage.wire``: rank lines,
and every rank's progress as tagged lines) to the launch that submitted it. A Slurm job writes the
wire into its output. A Ray job writes it into a file of its own beside its log
(``launcher.backends.ray_jobs.wirefile``), and its log for people (rank lines, the launcher's
words, no tagged line); it then sends its run directory back as a bundle at the end of the wire.

A Slurm job that Slurm started again (requeued: its warning before the time limit, preemption, a
lost node, ``scontrol requeue``) resumes its run in the same run directory: the stages that
succeeded are kept, the unfinished one's job loads its last checkpoint. Interrupted with progress
saved, the launcher exits EXIT_RESUMABLE, which the batch script reads (and turns into 130).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from launcher.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, LauncherError

# what the launcher needs on the cluster, checked before anything else is imported there
NEEDED = ("yaml", "pydantic", "rich", "matplotlib", "psutil", "prometheus_client", "torch")
# the launcher's run directories on a Ray cluster's head: a run whose large files stay there
# (checkpoints: not sent back through the job's log) keeps its directory; others are removed
CLUSTER_RUNS = Path("~/gpulaunch-runs")


def missing_dependencies(extra: Sequence[str] = ()) -> list[str]:
    return [name for name in (*NEEDED, *extra) if importlib.util.find_spec(name) is None]


def _lacking(extra: Sequence[str]) -> int | None:
    """One line, and exit 2, when this interpreter cannot run the launcher."""
    missing = missing_dependencies(extra)
    if not missing:
        return None
    print(
        f"error: the cluster's Python ({sys.executable}) lacks {', '.join(missing)}: install gpulaunch's "
        "dependencies there (pip install 'gpulaunch[ray]' with the nodes' torch build), then submit again",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_BAD_INPUT


def inside_ray(spec: str, run_id: str | None = None) -> int:
    """Run the launcher on this Ray cluster, then send the run directory back."""
    lacking = _lacking(("ray",))
    if lacking is not None:
        return lacking
    from launcher.backends.ray_jobs.bundle import emit_bundle
    from launcher.backends.ray_jobs.wirefile import JobLogEvents, open_wire
    from launcher.control.api import run_job
    from launcher.spec.model import load_job
    from launcher.stage.watch import RunEvents, TeeEvents
    from launcher.stage.wire import WireEvents

    out = CLUSTER_RUNS.expanduser()
    wire = open_wire()  # None: no Ray job log to put it beside; the wire goes into the output

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        if wire is not None:
            print(line, file=wire, flush=True)

    events: RunEvents = TeeEvents(WireEvents(wire), JobLogEvents()) if wire is not None else WireEvents()
    try:
        try:
            # no endpoint of its own: the submitting launch serves /metrics from the wire, and the rank
            # actors export theirs to Ray's dashboard (the head's 127.0.0.1 is not the user's)
            job = load_job(spec)
            run_dir = out / job.spec.name / run_id if run_id else None
            result = run_job(job, backend="ray", out=out, events=events, metrics=False, run_dir=run_dir)
            code, run_dir = result.exit_code, result.run_dir
        except LauncherError as exc:
            for line in str(exc).splitlines() or ["failed"]:
                say(f"error: {line}")
            return exc.exit_code
        sys.stdout.flush()
        left = emit_bundle(run_dir, write=print if wire is None else (lambda line: print(line, file=wire)))
        sys.stdout.flush()
    finally:
        if wire is not None:
            wire.close()
    if not left:
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def inside_slurm(run_dir: str) -> int:
    """Run the launcher inside this Slurm batch job, into the run directory the submitting
    launcher made on the shared filesystem (it follows the job's output and that directory). A
    job Slurm started again (``SLURM_RESTART_COUNT``), or a run directory whose last result is
    interrupted, resumes the run there."""
    lacking = _lacking(())
    if lacking is not None:
        return lacking
    from launcher.backends.slurm.script import EXIT_RESUMABLE, SPEC_FILE
    from launcher.control.api import run_job
    from launcher.procutil import read_json
    from launcher.records import RunStatus
    from launcher.results.store import RESULT_FILE
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


def main(argv: Sequence[str]) -> int:
    if len(argv) in (2, 3) and argv[0] == "ray":
        return inside_ray(*argv[1:])
    if len(argv) == 2 and argv[0] == "slurm":
        return inside_slurm(argv[1])
    print("usage: python -m launcher.control.submitted ray SPEC.yaml [RUN_ID] | slurm RUN_DIR", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
