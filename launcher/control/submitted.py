"""The entrypoint of a run submitted to a cluster: ``python -m launcher.control.submitted ray SPEC``,
or inside a Slurm batch job ``python -m launcher.control.submitted slurm RUN_DIR``.

The launcher submits itself (a Ray job through the Jobs API): on the cluster this module runs the
same ``run_job`` with the backend connected to that cluster, the ranks' output going to the job's
log, and at the end sends the run directory back as a tagged bundle in the log's last lines.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from launcher.backends.ray_jobs import emit_bundle
from launcher.control.api import run_job
from launcher.control.events import PlainEvents
from launcher.errors import EXIT_BAD_INPUT, LauncherError
from launcher.results.store import RunResult


class _JobLogEvents(PlainEvents):
    """Rank lines into the job's log; the summary is the client's to show."""

    def finished(self, result: RunResult) -> None:
        """Nothing: the cluster-side run directory is temporary (the client unpacks the bundle)."""


def inside_ray(spec: str) -> int:
    """Run the launcher on this Ray cluster, then send the run directory back."""
    out = Path(tempfile.mkdtemp(prefix="gpulaunch-job-"))
    try:
        try:
            code = run_job(spec, backend="ray", out=out, events=_JobLogEvents()).exit_code
        except LauncherError as exc:
            for line in str(exc).splitlines() or ["failed"]:
                print(f"error: {line}", file=sys.stderr, flush=True)
            code = exc.exit_code
        sys.stdout.flush()
        runs = sorted(out.glob("*/*/result.json"))
        if runs:
            emit_bundle(runs[-1].parent)
        sys.stdout.flush()
        return code
    finally:
        shutil.rmtree(out, ignore_errors=True)


def inside_slurm(run_dir: str) -> int:
    """Run the launcher inside this Slurm batch job, into the run directory the submitting
    launcher made on the shared filesystem (it follows the job's output and that directory)."""
    from launcher.backends.slurm.events import SlurmJobEvents
    from launcher.backends.slurm.script import SPEC_FILE
    from launcher.spec.model import load_job

    try:
        job = load_job(Path(run_dir) / SPEC_FILE)
        return run_job(job, backend="slurm", run_dir=run_dir, events=SlurmJobEvents(), metrics=False).exit_code
    except LauncherError as exc:
        for line in str(exc).splitlines() or ["failed"]:
            print(f"error: {line}", file=sys.stderr, flush=True)
        return exc.exit_code


def main(argv: Sequence[str]) -> int:
    if len(argv) == 2 and argv[0] == "ray":
        return inside_ray(argv[1])
    if len(argv) == 2 and argv[0] == "slurm":
        return inside_slurm(argv[1])
    print("usage: python -m launcher.control.submitted ray SPEC.yaml | slurm RUN_DIR", file=sys.stderr)
    return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
