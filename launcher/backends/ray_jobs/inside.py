"""The inside half of a run submitted through the Ray Jobs API: ``python -m
launcher.control.submitted ray SPEC [RUN_ID]``, the job's entrypoint on the cluster.

It runs the same ``run_job`` (the control side's, passed in) with the Ray engine connected to that
cluster, and every event of the run goes over the remote-run wire (``launcher.stage.wire``) to the
launch that submitted it: into a file of its own beside the Ray job's log
(``launcher.backends.ray_jobs.wirefile``), the log itself for people (rank lines, the launcher's
words, no tagged line); it then sends its run directory back as a bundle at the end of the wire.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Sequence

from launcher.errors import LauncherError
from launcher.stage.engine import RunJob

# the launcher's run directories on a Ray cluster's head: a run whose large files stay there
# (checkpoints: not sent back through the job's log) keeps its directory; others are removed
CLUSTER_RUNS = Path("~/gpulaunch-runs")
USAGE = "SPEC.yaml [RUN_ID]"


def run_inside(argv: Sequence[str], run_job: RunJob) -> int | None:
    """Run the launcher on this Ray cluster, then send the run directory back (None: not its arguments)."""
    if len(argv) not in (1, 2):
        return None
    return inside_ray(run_job, *argv)


def inside_ray(run_job: RunJob, spec: str, run_id: str | None = None) -> int:
    from launcher.backends.ray_jobs.bundle import emit_bundle
    from launcher.backends.ray_jobs.wirefile import JobLogEvents, open_wire
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
