"""A run submitted through the Ray Jobs API shows the same live progress on the submitting console
as a local run: the launcher inside the job writes its stages' progress over the remote-run wire
(a file of its own beside the job's log, streamed through the dashboard), the submitting side
turns it back into progress events (and serves them on its own /metrics, under the run's id), and
neither its printed output, nor ``launch logs``, nor the job's log itself ever holds the wire's lines.

The run is submitted in-process (``launcher.run_job(..., address=)``) with a console that records
what it was told, so the test sees the progress readings themselves; the console prints to a pipe,
where the live line is never drawn."""

from __future__ import annotations

import io
import os
import re
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from rich.console import Console

from launcher.stage.watch import StageProgress
from launcher.ui.console import RunUI
from tests.ray.conftest import RayHead, launch

pytestmark = pytest.mark.slow

STEPPER = '''
import time


def run(ctx):
    """params.steps steps, one every 50 ms at the most, saying so once a second. A count, not a
    time budget, and from a barrier on: both ranks step side by side for at least steps x 50 ms
    (several progress readings) however late a loaded machine starts either of them."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    said, n = 0.0, 0
    for n in range(1, int(ctx.param("steps")) + 1):
        time.sleep(0.05)
        ctx.metrics.step()
        if time.monotonic() - said >= 1.0:
            said = time.monotonic()
            print(f"stepper: rank {ctx.rank} step {n}", flush=True)
    return {"steps": n}
'''


class RecordingUI(RunUI):
    """The CLI's console on a pipe, keeping every progress reading it was given."""

    def __init__(self) -> None:
        self.out = io.StringIO()
        super().__init__(Console(file=self.out, force_terminal=False, width=200))
        self.readings: list[StageProgress] = []
        self.stages: list[tuple[str, int]] = []
        self.metrics_url: str | None = None
        self.metrics_run_ids: set[str] = set()  # the run_id labels /metrics served while the ranks ran

    def message(self, text: str) -> None:
        if text.startswith("metrics: "):
            self.metrics_url = text.split()[1]
        super().message(text)

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        self.stages.append(("started", world_size))
        super().stage_started(job, world_size, device_type, backend)

    def progress(self, progress: StageProgress) -> None:
        self.readings.append(progress)
        super().progress(progress)
        if self.metrics_url and not self.metrics_run_ids:  # the endpoint has the readings before this one
            with urllib.request.urlopen(self.metrics_url, timeout=10) as answer:
                self.metrics_run_ids = set(re.findall(r'run_id="([^"]*)"', answer.read().decode()))

    def stage_finished(self) -> None:
        self.stages.append(("finished", 0))
        super().stage_finished()


@pytest.fixture
def head_token(ray_head: RayHead) -> Iterator[RayHead]:
    """This process uses the head's token, as a user's shell would (Ray caches the token it read)."""
    from ray._private import authentication_test_utils as auth

    keys = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    saved = {k: os.environ.get(k) for k in keys}
    auth.set_auth_mode("token")
    auth.set_env_auth_token(ray_head.env["RAY_AUTH_TOKEN"])
    auth.reset_auth_token_state()
    try:
        yield ray_head
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        auth.reset_auth_token_state()


def test_a_jobs_api_run_shows_live_progress_and_never_its_tagged_lines(
    head_token: RayHead, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import launcher

    job_dir = tmp_path / "job"  # the job's own code beside its spec, as a user's would be (Ray ships the directory)
    job_dir.mkdir()
    monkeypatch.syspath_prepend(str(job_dir))  # here, as PYTHONPATH would: the spec's entrypoint is checked before submitting
    (job_dir / "stepper_job.py").write_text(STEPPER)
    (job_dir / "stepper.yaml").write_text(
        "name: stepper\nentrypoint: stepper_job:run\nparams: {steps: 100}\nbackend: ray\n"
        "resources: {cpu_workers: 2}\ntimeouts: {rendezvous_s: 60, run_s: 300}\n"
    )
    ui = RecordingUI()
    result = launcher.run_job(job_dir / "stepper.yaml", address=head_token.address, out=tmp_path / "out", events=ui)
    assert result.status == "succeeded", ui.out.getvalue()[-3000:]

    assert ui.stages == [("started", 2), ("finished", 0)]
    running = [p for p in ui.readings if all(r.phase == "running" for r in p.ranks)]
    assert len(running) >= 2, [(p.elapsed_s, [(r.phase, r.steps) for r in p.ranks]) for p in ui.readings]
    assert all(p.world_size == 2 and sorted(r.rank for r in p.ranks) == [0, 1] for p in ui.readings)
    for rank in (0, 1):
        steps = [next(r.steps for r in p.ranks if r.rank == rank) for p in running]
        assert steps == sorted(steps) and steps[-1] > steps[0], (rank, steps)  # growing as the rank steps
    elapsed = [p.elapsed_s for p in ui.readings]
    assert elapsed == sorted(elapsed) and min(b - a for a, b in zip(elapsed, elapsed[1:])) >= 0.9  # at most one a second

    printed = ui.out.getvalue()
    assert "@gpulaunch" not in printed, printed[-3000:]
    assert "▶ stepper: world size 2 on cpu (ray)" in printed and "stepper: rank 1 step" in printed
    assert "world 2 ·" not in printed  # a pipe gets no live line

    [job_id] = [line.split()[4] for line in printed.splitlines() if line.startswith("launcher: submitted Ray job ")]
    logs = launch("logs", job_id, "--address", head_token.address, env=head_token.env)
    assert logs.returncode == 0, logs.stderr
    assert "@gpulaunch" not in logs.stdout, logs.stdout[-3000:]
    assert "stepper: world size 2 on cpu (ray)" in logs.stdout and "stepper: rank 0 step" in logs.stdout
    raw = head_token.rest(f"/api/jobs/{job_id}/logs")["logs"]  # the dashboard's Logs pane: for people only
    assert "@gpulaunch" not in raw and "stepper: rank 1 step" in raw and "stepper: succeeded" in raw, raw[-3000:]

    # one id: the Ray job, the run directory, result.json and the /metrics labels
    run_id = result.data["run_id"]
    assert job_id == f"stepper-{run_id}" and result.run_dir.name == run_id and result.run_dir.parent.name == "stepper"
    assert ui.metrics_run_ids == {run_id}, (ui.metrics_url, ui.metrics_run_ids)


LOGGER = '''
import torch


def run(ctx):
    """Logs a loss at every one of params.steps steps: a long series, as a real training run has."""
    loss = torch.zeros(())
    for step in range(int(ctx.param("steps"))):
        loss = loss * 0.999 + 1.0
        ctx.metrics.log("loss", loss)
        ctx.metrics.step()
    return {"steps": int(ctx.param("steps"))}
'''


def test_a_result_over_a_mebibyte_comes_back_whole(head_token: RayHead, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose result.json and rank reports pass 1 MiB (thousands of logged steps) used to
    succeed on the cluster while ``launch`` failed with a KeyError: only artifacts may stay behind;
    the run's own record always travels."""
    import json

    import launcher

    job_dir = tmp_path / "job"
    job_dir.mkdir()
    monkeypatch.syspath_prepend(str(job_dir))
    (job_dir / "logger_job.py").write_text(LOGGER)
    (job_dir / "logger.yaml").write_text(
        "name: logger\nentrypoint: logger_job:run\nparams: {steps: 30000}\nbackend: ray\n"
        "resources: {cpu_workers: 2}\ntimeouts: {rendezvous_s: 60, run_s: 300}\n"
    )
    result = launcher.run_job(job_dir / "logger.yaml", address=head_token.address, out=tmp_path / "out", events=launcher.RunEvents(), metrics=False)
    assert result.status == "succeeded", result.data.get("failure")
    assert result.path.stat().st_size > 1024**2
    back = json.loads(result.path.read_text())
    assert [s["world_size"] for s in back["stages"]] == [2] and len(back["ranks"]) == 2
    for rank in (0, 1):
        report = json.loads((result.run_dir / "world2" / "reports" / f"rank{rank}.json").read_text())
        assert report["metrics"]["steps"] == 30000
    # what stayed on the cluster, if anything, are artifacts: the run's record all came back
    listed = json.loads((result.run_dir / "left_on_cluster.json").read_text())["files"] if (result.run_dir / "left_on_cluster.json").exists() else []
    assert all("/tensorboard/" in f["path"] for f in listed), listed
    # one id for the run: the Ray job is <job>-<run id>, the run directory <job>/<run id>
    assert result.data["run_id"] == result.run_dir.name
