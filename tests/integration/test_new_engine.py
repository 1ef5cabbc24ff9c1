"""A new engine is one module and one registry entry: ``tests/integration/subprocess_engine.py``
(every rank a plain subprocess), registered through ``launcher.backends.register_engine``, with no
change under ``launcher/``, runs a job to the same result, live progress and failure reports as the
built-in engines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import psutil
import pytest

import launcher
from launcher import backends
from launcher.stage.watch import StageProgress
from tests.conftest import REPO
from tests.integration.subprocess_engine import SubprocessEngine

pytestmark = pytest.mark.slow


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(backends, "_ENGINES", dict(backends._ENGINES))  # put back as it was after the test
    backends.register_engine("subprocess", SubprocessEngine)
    yield "subprocess"


class Watch(launcher.RunEvents):
    def __init__(self) -> None:
        self.readings: list[StageProgress] = []

    def progress(self, progress: StageProgress) -> None:
        self.readings.append(progress)


SEAM_JOB = """
import time


def run(ctx):
    print(f"seam: rank {ctx.rank} of {ctx.world_size} on {ctx.device}", flush=True)
    end, n = time.monotonic() + float(ctx.param("seconds")), 0
    while time.monotonic() < end:
        time.sleep(0.02)
        ctx.metrics.step()
        n += 1
    return {"steps": n}
"""


def _spec(tmp_path: Path, entrypoint: str, params: str) -> Path:
    (tmp_path / "seam_job.py").write_text(SEAM_JOB)
    path = tmp_path / "job.yaml"
    path.write_text(f"name: seam\nentrypoint: {entrypoint}\nparams: {params}\nresources: {{cpu_workers: 2}}\nenv: {{PYTHONPATH: '{REPO}:{tmp_path}'}}\n")
    return path


def test_a_registered_engine_runs_a_job_live_to_the_usual_result(registered: str, tmp_path: Path) -> None:
    watch = Watch()
    spec = _spec(tmp_path, "seam_job:run", "{seconds: 3}")
    result = launcher.run_job(spec, backend=registered, out=tmp_path / "runs", events=watch, metrics=False)
    assert result.status == "succeeded", result.data.get("failure")
    assert result.data["backend"] == "subprocess" and result.data["world_sizes"] == [2]
    ranks = sorted(result.data["ranks"], key=lambda r: r["rank"])
    assert [(r["rank"], r["status"]) for r in ranks] == [(0, "ok"), (1, "ok")] and all(r["metrics"]["steps"] > 10 for r in ranks)
    # live: readings with both ranks running and their steps growing, through the engine's channel
    running = [p for p in watch.readings if [r.phase for r in p.ranks] == ["running", "running"]]
    assert len(running) >= 2 and running[-1].steps_min > running[0].steps_min, [(p.elapsed_s, p.steps_min) for p in watch.readings]
    world = result.run_dir / "world2"
    assert json.loads((world / "reports" / "rank1.json").read_text())["status"] == "ok"
    assert [(world / "logs" / f"rank{k}.log").read_text() for k in (0, 1)] == [f"seam: rank {k} of 2 on cpu\n" for k in (0, 1)]
    pids = [r["pid"] for r in ranks]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_a_rank_that_raises_is_the_root_cause_through_a_registered_engine(registered: str, tmp_path: Path) -> None:
    spec = _spec(tmp_path, "tests.integration.faulty:run", "{fault: raise, rank: 1}")
    result = launcher.run_job(spec, backend=registered, out=tmp_path / "runs", events=launcher.RunEvents(), metrics=False)
    assert result.status == "failed"
    root = result.data["failure"]["root_cause"]
    assert (root["rank"], root["type"]) == (1, "ValueError") and "injected failure on rank 1" in root["message"]
    assert result.data["failure"]["collateral_ranks"] == [0]


def test_a_dry_run_prints_the_registered_engines_own_commands(registered: str, tmp_path: Path) -> None:
    job = launcher.load_job(_spec(tmp_path, "tests.monitoring.stepper_job:run", "{seconds: 1}"))
    dry = launcher.dry_run(job, backend=registered, out=tmp_path / "runs")
    (request,) = dry.requests
    assert request.backend == "subprocess" and len(request.commands) == 2 and "launcher.runtime.worker" in request.commands[1]
    assert not (tmp_path / "runs").exists()


def test_an_unknown_engine_name_is_refused_with_the_registered_ones(tmp_path: Path) -> None:
    with pytest.raises(launcher.LauncherError, match=r"unknown backend 'subprocess' \(expected one of: torchrun, ray, slurm\)"):
        launcher.run_job(_spec(tmp_path, "tests.monitoring.stepper_job:run", "{seconds: 1}"), backend="subprocess", out=tmp_path / "runs")
