"""A new engine is one module and one registry entry: ``tests/integration/subprocess_engine.py``
(every rank a plain subprocess), registered through ``launcher.backends.register_engine`` with its
settings block and its submitter, with no change under ``launcher/``, runs a job to the same
result, live progress and failure reports as the built-in engines; its ``subprocess:`` block is
validated by the spec loader at file:line, and a run handed to its submitter is followed over the
remote-run wire to the same result."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import psutil
import pytest
import yaml

import launcher
from launcher import backends
from launcher.stage.watch import StageProgress
from tests.conftest import REPO
from tests.integration import subprocess_engine

pytestmark = pytest.mark.slow


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for table in ("_ENGINES", "_SUBMITTERS", "_SETTINGS"):  # put back as they were after the test
        monkeypatch.setattr(backends, table, dict(getattr(backends, table)))
    subprocess_engine.register()  # the one registry entry: engine, settings block, submitter
    yield "subprocess"


class Watch(launcher.RunEvents):
    def __init__(self) -> None:
        self.readings: list[StageProgress] = []

    def progress(self, progress: StageProgress) -> None:
        self.readings.append(progress)


SEAM_JOB = """
import os
import time


def run(ctx):
    # a count of steps, not a time budget: at least steps x 0.02 s (several progress readings),
    # and the same count however loaded the machine is
    print(f"seam: rank {ctx.rank} of {ctx.world_size} on {ctx.device}", flush=True)
    if os.environ.get("SEAM_WORD"):
        print(f"seam word: {os.environ['SEAM_WORD']}", flush=True)
    n = 0
    for n in range(1, int(ctx.param("steps")) + 1):
        time.sleep(0.02)
        ctx.metrics.step()
    return {"steps": n}
"""


def _spec(tmp_path: Path, entrypoint: str, params: str, more: str = "") -> Path:
    (tmp_path / "seam_job.py").write_text(SEAM_JOB)
    path = tmp_path / "job.yaml"
    path.write_text(f"name: seam\nentrypoint: {entrypoint}\nparams: {params}\nresources: {{cpu_workers: 2}}\nenv: {{PYTHONPATH: '{REPO}:{tmp_path}'}}\n{more}")
    return path


def test_a_registered_engine_runs_a_job_live_to_the_usual_result(registered: str, tmp_path: Path) -> None:
    watch = Watch()
    spec = _spec(tmp_path, "seam_job:run", "{steps: 150}")
    result = launcher.run_job(spec, backend=registered, out=tmp_path / "runs", events=watch, metrics=False)
    assert result.status == "succeeded", result.data.get("failure")
    assert result.data["backend"] == "subprocess" and result.data["world_sizes"] == [2]
    ranks = sorted(result.data["ranks"], key=lambda r: r["rank"])
    assert [(r["rank"], r["status"]) for r in ranks] == [(0, "ok"), (1, "ok")] and all(r["metrics"]["steps"] == 150 for r in ranks)
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


def test_the_engines_settings_block_reaches_its_ranks_and_its_dry_run(registered: str, tmp_path: Path) -> None:
    spec = _spec(tmp_path, "seam_job:run", "{steps: 5}", "backend: subprocess\nsubprocess: {env: {SEAM_WORD: hello}, grace_s: 2}\n")
    job = launcher.load_job(spec)
    settings = subprocess_engine.SubprocessSettings(env={"SEAM_WORD": "hello"}, grace_s=2)
    assert job.spec.backend == "subprocess" and job.spec.engine_settings("subprocess") == settings
    (request,) = launcher.dry_run(job, out=tmp_path / "runs").requests
    assert "SEAM_WORD=hello RANK=1" in request.commands[1]
    result = launcher.run_job(job, out=tmp_path / "runs", events=launcher.RunEvents(), metrics=False)
    assert result.status == "succeeded" and result.data["backend"] == "subprocess", result.data.get("failure")
    assert (result.run_dir / "world2" / "logs" / "rank1.log").read_text().splitlines()[1] == "seam word: hello"
    assert yaml.safe_load((result.run_dir / "spec.yaml").read_text())["subprocess"]["env"] == {"SEAM_WORD": "hello"}  # stored with the run


def test_a_bad_settings_block_or_backend_is_one_line_at_its_file_and_line(registered: str, tmp_path: Path) -> None:
    spec = _spec(tmp_path, "seam_job:run", "{steps: 5}", "backend: subproces\nsubprocess: {evn: {A: b}, grace_s: 0}\n")
    with pytest.raises(launcher.SpecError) as caught:
        launcher.load_job(spec)
    assert sorted(caught.value.problems) == sorted([
        f"{spec}:6: backend: expected 'torchrun', 'ray', 'slurm' or 'subprocess', did you mean 'subprocess'? (got 'subproces')",
        f"{spec}:7: subprocess.evn: unknown key, did you mean 'env'?",
        f"{spec}:7: subprocess.grace_s: expected greater than 0 (got 0)",
    ])  # fmt: skip
    assert caught.value.exit_code == 2


def test_a_run_handed_to_the_engines_submitter_comes_back_over_the_wire(registered: str, tmp_path: Path) -> None:
    """The submit path: the run goes to a detached process (the "scheduler's job") that runs the
    launcher inside through ``launcher.control.submitted``; followed over the wire to its record."""
    watch = Watch()
    spec = _spec(tmp_path, "seam_job:run", "{steps: 100}", "backend: subprocess\nsubprocess: {submit: true, env: {SEAM_WORD: inside}}\n")
    dry = launcher.dry_run(launcher.load_job(spec), out=tmp_path / "runs")
    assert "launcher.control.submitted" in dry.requests[0].commands[0]
    result = launcher.run_job(spec, out=tmp_path / "runs", events=watch, metrics=False)
    assert result.status == "succeeded" and result.data["backend"] == "subprocess", result.data.get("failure")
    assert [r["status"] for r in result.data["ranks"]] == ["ok", "ok"]
    assert "seam word: inside" in (result.run_dir / "world2" / "logs" / "rank0.log").read_text()
    assert watch.readings and watch.readings[-1].ranks, "no live progress over the wire"
    job_id = f"local:{result.run_dir}"
    info = backends.submitter_for_id(job_id, None).status(job_id)
    assert (info.status, info.terminal) == ("SUCCEEDED", True)
    shown: list[tuple[str, str]] = []
    backends.submitter_for_id(job_id, None).logs(job_id, follow=False, echo=lambda source, text: shown.append((source, text)))
    assert "seam word: inside" in [text for _, text in shown], shown[:20]


def test_nothing_under_launcher_knows_the_new_engine() -> None:
    assert subprocess_engine.SubprocessEngine.__module__.startswith("tests.")
    named = [p for p in (REPO / "launcher").rglob("*.py") if "subprocess_engine" in p.read_text() or "SubprocessSettings" in p.read_text()]
    assert named == []
