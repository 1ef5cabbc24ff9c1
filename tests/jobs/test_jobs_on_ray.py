"""Every job of the suite runs unchanged on the Ray backend: the same result.json, table and plots
as under torchrun, its ranks Ray actors.

One embedded Ray serves the five runs, started the way the launcher starts it
(``launcher.backends.ray.ray_session``: 127.0.0.1 only, token auth, shut down completely at the
end), and each run is ``run_job`` in this process, as in a notebook that started Ray itself: the
runs find Ray up and keep it. Starting and stopping an embedded Ray per run, and the ``launch``
command line around it, are tested in tests/ray; five Ray start-ups here would add a minute of
CPU to the suite and test nothing more."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, pids_mentioning
from tests.jobs.conftest import TINY_TRAIN, JobRun, assert_succeeded

ray_backend = pytest.importorskip("launcher.backends.ray")

RAY_SETS = {
    "cpu_vs_gpu": ["params.sizes=[8,32]", "params.work_gflop=0.0001", "params.max_iters=20", "params.warmup=1"],
    "sync_logging": ["params.steps=40", "params.n=16", "params.repeats=2"],
    "transfer": ["params.sizes_mb=[0.25,1]", "params.repeats=2"],
    "ddp_train": [*TINY_TRAIN, "params.epochs=1"],
    "matmul_scaling": ["params.sizes=[64]", "params.iters=3", "params.warmup=1"],
}
COMMON = ["scaling.workers=[2]", "resources.cpu_workers=2"]


@pytest.fixture(scope="module")
def embedded_ray():
    from launcher.spec.model import load_job

    job = load_job(REPO / "jobs" / "matmul_scaling.yaml", [*COMMON, "backend=ray"])
    with ray_backend.ray_session(job):
        yield
    import ray

    assert not ray.is_initialized()


@pytest.mark.slow
@pytest.mark.parametrize("job", sorted(RAY_SETS))
def test_every_job_runs_unchanged_on_the_ray_backend(job, tmp_path, embedded_ray):
    from launcher.control.api import run_job
    from launcher.stage.watch import RunEvents

    result = run_job(REPO / "jobs" / f"{job}.yaml", overrides=[*COMMON, *RAY_SETS[job]], backend="ray", out=tmp_path,
                     events=RunEvents(), metrics=False)
    run_dir = Path(result.run_dir)
    run = JobRun(result.exit_code, "", "", run_dir, json.loads((run_dir / "result.json").read_text()))
    assert_succeeded(run, job, [2])
    assert run.result["backend"] == "ray"
    assert run.result["plots"] and run.summary.get("rows"), "the job's table and plots come out of a Ray run too"
    assert {r["device"] for r in run.result["ranks"]} == {"cpu"}
    assert pids_mentioning(str(run_dir)) == [], "actors of the run are still alive"
