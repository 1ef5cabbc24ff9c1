"""Runs that survive, for real (torchrun, gloo on the CPU): ddp_train saves through ctx.checkpoint
every epoch (4 steps); a rank SIGKILLed mid-run, a save cut short, a SIGTERM to ``launch``
followed by ``launch resume`` all end with the same model, bit for bit, as a run that was never
interrupted (same seed, deterministic on the CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, launch, pids_mentioning
from tests.jobs.conftest import TINY_TRAIN, JobRun, assert_succeeded, run_job

WRAPPER = "entrypoint=tests.jobs.killed_train:run"
EPOCHS = ["params.epochs=6", "scaling.workers=[2]", "params.in_place=false", *TINY_TRAIN]  # 4 steps an epoch: checkpoints at 4, 8, ... 24


def sha_of(run: JobRun) -> set[str]:
    return {r["result"]["model_sha256"] for r in run.ranks()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    out = tmp_path_factory.mktemp("baseline")
    run = run_job(out, "ddp_train", WRAPPER, *EPOCHS, "params.kill_at=-1", f"params.marker={out / 'unused'}")
    assert_succeeded(run, "ddp_train", [2])
    assert len(sha_of(run)) == 1 and run.result["restarts"] == 0
    return run


def test_a_rank_killed_mid_run_is_restarted_from_the_last_checkpoint_and_ends_with_the_same_model(tmp_path, uninterrupted) -> None:
    run = run_job(tmp_path, "ddp_train", WRAPPER, *EPOCHS, "params.kill_rank=1", "params.kill_at=10", f"params.marker={tmp_path / 'killed'}")
    assert_succeeded(run, "ddp_train", [2])
    assert (tmp_path / "killed").is_file()  # the first attempt did lose rank 1
    first, second = run.result["stages"][0]["attempts"]
    assert (first["failure_class"], first["restarted"], first["checkpoint_step"]) == ("rank_lost", True, 8), first
    assert first["cause"].startswith("rank 1 on ") and "killed by SIGKILL" in first["cause"]
    assert 0 <= first["lost_steps"] <= 2, first  # steps 9-10 were done after the checkpoint (as far as the beacons told)
    assert (second["resumed_step"], second["status"]) == (8, "succeeded")
    assert all(r["result"]["start_step"] == 8 and r["result"]["steps"] == 24 for r in run.ranks())
    assert sha_of(run) == sha_of(uninterrupted)  # bit for bit: parameters, optimizer moments and data order restored
    assert "the job resumes from the checkpoint of step 8" in run.stderr + run.stdout


def test_background_saves_are_published_before_each_rank_reports_and_a_resume_ends_with_the_same_model(tmp_path, uninterrupted) -> None:
    """checkpoint.async_save: rank 0's saves write on a thread while the job steps on. A rank
    killed at step 10 restarts the group from the newest checkpoint published by then (step 8's,
    or step 4's where 8's write was still in flight), and the model still ends bit for bit as the
    uninterrupted (synchronous) run's; the last save is published before rank 0 reports."""
    run = run_job(tmp_path, "ddp_train", WRAPPER, *EPOCHS, "checkpoint.async_save=true", "params.kill_rank=1", "params.kill_at=10",
                  f"params.marker={tmp_path / 'killed'}")  # fmt: skip
    assert_succeeded(run, "ddp_train", [2])
    first, second = run.result["stages"][0]["attempts"]
    assert first["failure_class"] == "rank_lost" and first["checkpoint_step"] in (4, 8), first
    assert second["status"] == "succeeded" and first["checkpoint_step"] <= second["resumed_step"] <= 8, second
    assert sha_of(run) == sha_of(uninterrupted)
    writer = next(r for r in run.ranks() if r["rank"] == 0)
    assert writer["checkpoint"]["last_step"] == 24 and writer["checkpoint"]["write_s"] > 0, writer["checkpoint"]
    checkpoints = run.run_dir / "world2" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000000020", "step-000000024"]  # published, keep: 2, no partial


def test_a_checkpoint_cut_short_is_never_loaded(tmp_path, uninterrupted) -> None:
    # rank 0 (the writer) dies inside the save of step 12, after its first bytes
    run = run_job(tmp_path, "ddp_train", WRAPPER, *EPOCHS, "params.kill_rank=0", "params.kill_at=12", "params.kill_in_save=true",
                  f"params.marker={tmp_path / 'killed'}")  # fmt: skip
    assert_succeeded(run, "ddp_train", [2])
    first, second = run.result["stages"][0]["attempts"]
    assert first["failure_class"] == "rank_lost" and first["checkpoint_step"] == 8
    assert second["resumed_step"] == 8  # not 12: that one was never complete
    checkpoints = run.run_dir / "world2" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000000020", "step-000000024"]  # keep: 2, no partial left
    assert sha_of(run) == sha_of(uninterrupted)


def test_sigterm_saves_at_the_next_step_and_launch_resume_finishes_the_same_run(tmp_path, uninterrupted) -> None:
    args = ["jobs/ddp_train.yaml", "--out", str(tmp_path), "--quiet"]
    for item in (WRAPPER, *EPOCHS, "params.kill_at=-1", f"params.marker={tmp_path / 'unused'}", "params.step_sleep_s=0.15"):
        args += ["--set", item]
    proc = subprocess.Popen([sys.executable, "-m", "launcher", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "COLUMNS": "80"})  # fmt: skip
    try:
        beacon = _wait_for_steps(tmp_path, 6)
        os.kill(proc.pid, signal.SIGTERM)  # a spot VM's notice, a scheduler's stop
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, out
    run_dir = beacon.parents[2]
    result = json.loads((run_dir / "result.json").read_text())
    failure = result["failure"]
    assert result["status"] == "interrupted" and failure["failure_class"] == "preempted", failure
    (attempt,) = result["stages"][0]["attempts"]
    saved = attempt["checkpoint_step"]
    assert 6 <= saved < 24 and attempt["lost_steps"] == 0, attempt  # saved where it stopped: nothing lost
    assert f"its last checkpoint is step {saved}; continue with: launch resume {run_dir}" in failure["summary"]
    assert "stop notice sent to every rank" in out
    assert f"continue with: launch resume {run_dir}" in out.splitlines(), out  # printed at 80 columns, piped: one whole line
    assert all(r["result"]["stopped_early"] for r in result["ranks"])
    assert pids_mentioning(str(run_dir)) == []

    done = launch("resume", str(run_dir), "--quiet")
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = json.loads((run_dir / "result.json").read_text())
    assert resumed["status"] == "succeeded" and resumed["run_id"] == result["run_id"]
    stopped, finished = resumed["stages"][0]["attempts"]  # append-only: the stopped attempt kept, the resumed one after it
    assert stopped == attempt and (finished["attempt"], finished["status"], finished["resumed_step"]) == (1, "succeeded", saved), finished
    first_part, second_part = resumed["parts"]
    assert first_part["wall_s"] == result["wall_s"] and second_part["gap_s"] >= 0 and resumed["started_at"] == result["started_at"]
    assert resumed["wall_s"] == round(first_part["wall_s"] + second_part["wall_s"], 4) > result["wall_s"]  # both launches, the gap not
    assert resumed["stages"][0]["wall_s"] >= (stopped["ended_at"] - stopped["started_at"]) + (finished["ended_at"] - finished["started_at"]) - 0.01
    per_rank = {r["rank"]: r["metrics"]["steps"] for r in resumed["ranks"]}
    assert resumed["summary"]["steps_per_rank"] == stopped["steps"] + sorted(per_rank.values())[0] and finished["steps"] + saved == 24, per_rank
    assert {r["result"]["model_sha256"] for r in resumed["ranks"]} == sha_of(uninterrupted)
    assert (run_dir / "world2" / "resumed1" / "reports" / "rank0.json").is_file()  # the stopped attempt's, set aside

    # a run that succeeded has nothing to resume: its record stays as it is, byte for byte
    before = (run_dir / "result.json").read_bytes()
    again = launch("resume", str(run_dir))
    assert again.returncode == 0 and "nothing to resume; the run succeeded" in again.stdout + again.stderr, again.stdout + again.stderr
    assert "resumes from it" not in again.stdout + again.stderr and (run_dir / "result.json").read_bytes() == before
    listed = launch("runs", "--out", str(tmp_path))
    assert f"{resumed['wall_s']:.1f} s, 24 steps/rank" in " ".join(listed.stdout.split()), listed.stdout  # the whole run's


def test_resume_refuses_a_spec_that_changed_and_a_directory_that_is_no_run(tmp_path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text((REPO / "jobs" / "ddp_train.yaml").read_text())
    run = run_job_from(spec, tmp_path / "runs", "scaling.workers=[1]", *TINY_TRAIN, "params.epochs=1")
    spec.write_text(spec.read_text().replace("lr: 0.002", "lr: 0.003"))
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    changed = launch("resume", str(run))
    assert changed.returncode == 2 and changed.stderr.startswith(f"error: launch resume {run}: {spec} changed since the run"), changed.stderr
    assert "Traceback" not in changed.stderr
    # refused before anything started: the run's directory is as it was (no new stage, attempt or log)
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before
    nothing = launch("resume", str(tmp_path))
    assert nothing.returncode == 2 and f"launch resume {tmp_path}: no readable launch.json there" in nothing.stderr
    (run / "slurm.json").write_text("{}")  # what a Slurm run's directory holds: Slurm continues it, not this machine
    slurm = launch("resume", str(run))
    assert slurm.returncode == 2 and slurm.stderr.startswith(f"error: launch resume {run}: a Slurm run; Slurm continues it"), slurm.stderr


def run_job_from(spec: Path, out: Path, *sets: str) -> Path:
    args = [str(spec), "--out", str(out), "--quiet"] + [a for s in sets for a in ("--set", s)]
    done = launch(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    (run_dir,) = (out / "ddp_train").iterdir()
    return run_dir


def _wait_for_steps(out: Path, steps: int, timeout_s: float = 120, pattern: str = "ddp_train/*/world2/progress/rank0.json") -> Path:
    """Rank 0's beacon once it counted ``steps`` (the run is well under way)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for beacon in out.glob(pattern):
            try:
                if json.loads(beacon.read_text()).get("steps", 0) >= steps:
                    return beacon
            except (OSError, ValueError):
                pass
        time.sleep(0.1)
    raise AssertionError(f"no beacon with {steps} steps under {out} after {timeout_s}s")


def test_the_matmul_job_resumes_past_the_sizes_it_had_measured(tmp_path) -> None:
    run = run_job(tmp_path, "matmul_scaling", "entrypoint=tests.jobs.killed_matmul:run", "scaling.workers=[2]", "params.sizes=[32,64,96]",
                  "params.iters=3", "params.trials=3", "max_restarts=1", f"params.marker={tmp_path / 'killed'}")  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "killed").is_file()
    first, second = run.result["stages"][0]["attempts"]
    assert first["failure_class"] == "rank_lost" and first["checkpoint_step"] == 1  # size 32 measured, then rank 1 died
    assert second["resumed_step"] == 1
    for rank in run.ranks():
        times = rank["metrics"]["times_ms"]
        # every size's three trials: 32's from the first attempt (restored), 64 and 96 from the second
        assert all(len(times[f"matmul/{n}"]) == 3 for n in (32, 64, 96)), times
    assert [row["size"] for row in run.summary["rows"]] == [32, 64, 96]  # the table has every size


def test_a_sharded_checkpoint_saves_each_ranks_part_and_loads_resharded_at_another_world_size(tmp_path) -> None:
    spec = tmp_path / "sharded.yaml"
    spec.write_text(f"name: sharded\nentrypoint: tests.jobs.sharded_job:run\nenv: {{PYTHONPATH: {REPO}}}\nresources: {{cpu_workers: 2}}\n")
    saved = launch(str(spec), "--out", str(tmp_path / "a"), "--quiet", "--set", "scaling.workers=[2]", "--json")
    assert saved.returncode == 0, saved.stderr
    result = json.loads(saved.stdout)
    r0, r1 = sorted(result["ranks"], key=lambda r: r["rank"])
    folder = Path(r0["result"]["saved_to"])
    assert r1["result"]["saved_to"] is None and r0["result"]["rows_held"] == r1["result"]["rows_held"] == [4, 6]  # half each
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == "dcp" and manifest["world_size"] == 2 and manifest["step"] == 7
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(manifest["files"]) and not any(folder.parent.glob(".partial-*"))

    # the same stage again finds it (a restart would), and world size 1 and 4 read it resharded
    for size, rows in ((2, 4), (1, 8), (4, 2)):
        loaded = launch(str(spec), "--out", str(tmp_path / f"b{size}"), "--quiet", "--set", f"scaling.workers=[{size}]",
                        "--set", f"resources.cpu_workers={size}", "--set", f"params.source={folder}", "--json")  # fmt: skip
        assert loaded.returncode == 0, loaded.stderr
        for rank in json.loads(loaded.stdout)["ranks"]:
            got = rank["result"]
            assert (got["loaded_step"], got["format"], got["saved_world_size"], got["step_value"]) == (7, "dcp", 2, 7), got
            assert got["equals_saved"] and got["rows_held"] == [rows, 6], (size, got)


def test_the_documented_job_survives_a_stop_and_a_resume(tmp_path) -> None:
    """The example of docs/fault-tolerance.md ("Runs that survive"), as written there: stopped by SIGTERM mid-run, it saves and returns;
    `launch resume` continues it from that step to the end."""
    page = (REPO / "docs" / "fault-tolerance.md").read_text()
    start = page.index("```python\nimport torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n\ndef main(ctx):")
    code = page[start + len("```python\n") : page.index("```", start + 10)]
    (tmp_path / "my_job.py").write_text(code)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"name: my_job\nentrypoint: my_job:main\nmax_restarts: 3\nenv: {{PYTHONPATH: {tmp_path}}}\nresources: {{cpu_workers: 2}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "launcher", str(spec), "--out", str(tmp_path / "runs"), "--quiet"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        beacon = _wait_for_steps(tmp_path / "runs", 200, pattern="my_job/*/world2/progress/rank0.json")
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run_dir = beacon.parents[2]
    stopped = json.loads((run_dir / "result.json").read_text())
    if stopped["status"] == "succeeded":
        pytest.skip("the run ended before the stop (a very fast machine): nothing to resume")
    assert proc.returncode == 130 and stopped["failure"]["failure_class"] == "preempted", out
    at = {r["result"]["stopped_at"] for r in stopped["ranks"]}
    assert len(at) == 1, at  # every rank stopped at the same step
    done = launch("resume", str(run_dir), "--quiet")
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = json.loads((run_dir / "result.json").read_text())
    assert {r["result"]["started_at"] for r in resumed["ranks"]} == at
