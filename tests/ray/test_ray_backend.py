"""The Ray backend end to end: embedded Ray, a real head on 127.0.0.1 through the Jobs API,
failures, and that no process of a run is left behind (checked by pid)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ray.conftest import REPO, descendants, launch, wait_no_orphans

pytestmark = pytest.mark.slow

SMALL = ["--set", "params.sizes=[64]", "--set", "params.iters=3", "--set", "params.warmup=1"]


def _result(out: Path, job: str) -> dict:
    found = sorted(out.glob(f"{job}/*/result.json"))
    assert len(found) == 1, found
    return json.loads(found[0].read_text())


def _shape(value: object) -> object:
    """The schema of a JSON document: keys and value types, not the values."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items() if k not in ("timeline_s", "phases", "spec", "log", "metrics", "result")}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__ if value is not None else None


def _faulty_job(tmp_path: Path, fault: str, **params: object) -> Path:
    spec = tmp_path / f"faulty_{fault}.yaml"
    extra = "".join(f", {k}: {v}" for k, v in params.items())
    spec.write_text(
        "name: faulty\nentrypoint: tests.integration.faulty:run\n"
        f"params: {{fault: {fault}{extra}}}\nbackend: ray\n"
        "resources: {cpu_workers: 2}\ntimeouts: {rendezvous_s: 60, run_s: 120}\n"
    )
    return spec


# --- embedded Ray ----------------------------------------------------------------------------------


def test_embedded_ray_runs_the_torchrun_job_with_the_same_result_schema(tmp_path: Path) -> None:
    baseline = descendants(os.getpid())
    ray_run = launch("jobs/matmul_scaling.yaml", "--backend", "ray", *SMALL, "--out", str(tmp_path / "ray"))
    assert ray_run.returncode == 0, ray_run.stderr[-3000:] + ray_run.stdout[-3000:]
    assert wait_no_orphans(baseline) == [], "a Ray process of the embedded run is still alive"
    assert "Ray dashboard: http://127.0.0.1:" in ray_run.stderr

    ray_result = _result(tmp_path / "ray", "matmul_scaling")
    assert ray_result["schema_version"] == 1
    assert ray_result["backend"] == "ray" and ray_result["status"] == "succeeded"
    assert ray_result["world_sizes"] == [1, 2]
    assert sorted((r["world_size"], r["rank"], r["status"], r["device"]) for r in ray_result["ranks"]) == [
        (1, 0, "ok", "cpu"), (2, 0, "ok", "cpu"), (2, 1, "ok", "cpu")
    ]
    steps = {r["metrics"]["steps"] for r in ray_result["ranks"]}
    assert len(steps) == 1 and steps.pop() > 0  # every rank counted the same steps
    assert ray_result["summary"]["scaling"], ray_result["summary"]
    run_dir = Path(ray_result["run_dir"])
    assert (run_dir / "world2" / "reports" / "rank1.json").is_file()

    torch_run = launch("jobs/matmul_scaling.yaml", "--backend", "torchrun", *SMALL, "--out", str(tmp_path / "tr"))
    assert torch_run.returncode == 0, torch_run.stderr[-3000:]
    torch_result = _result(tmp_path / "tr", "matmul_scaling")
    assert _shape(ray_result) == _shape(torch_result)
    assert {r["metrics"]["steps"] for r in torch_result["ranks"]} == {r["metrics"]["steps"] for r in ray_result["ranks"]}


def test_embedded_rank_that_raises_fails_the_job_with_its_rank_and_traceback(tmp_path: Path) -> None:
    baseline = descendants(os.getpid())
    run = launch(str(_faulty_job(tmp_path, "raise", rank=1)), "--out", str(tmp_path))
    assert run.returncode == 1, run.stderr[-3000:] + run.stdout[-3000:]
    assert wait_no_orphans(baseline) == []
    failure = _result(tmp_path, "faulty")["failure"]
    assert failure["root_cause"]["rank"] == 1
    assert "ValueError: injected failure on rank 1" in failure["root_cause"]["traceback"]
    assert failure["collateral_ranks"] == [0]
    assert "faulty: rank 1" in Path(_result(tmp_path, "faulty")["run_dir"], "world2", "logs", "rank1.log").read_text()


def test_embedded_actor_that_dies_fails_the_job_with_its_rank(tmp_path: Path) -> None:
    baseline = descendants(os.getpid())
    run = launch(str(_faulty_job(tmp_path, "exit", rank=1)), "--out", str(tmp_path))
    assert run.returncode == 1, run.stderr[-3000:] + run.stdout[-3000:]
    assert wait_no_orphans(baseline) == []
    failure = _result(tmp_path, "faulty")["failure"]
    assert failure["root_cause"]["rank"] == 1, failure["summary"]
    assert failure["root_cause"]["type"] == "ActorDied"
    assert failure["root_cause"]["traceback"]  # Ray's account of the death


def test_exposing_the_dashboard_needs_an_explicit_flag(tmp_path: Path) -> None:
    baseline = descendants(os.getpid())
    run = launch("jobs/matmul_scaling.yaml", "--backend", "ray", "--set", "ray.dashboard_host=0.0.0.0", "--out", str(tmp_path))
    assert run.returncode == 2
    assert "ray.expose_dashboard" in run.stderr and "Traceback" not in run.stderr
    assert wait_no_orphans(baseline) == []


# --- a running cluster, through the Jobs API ----------------------------------------------------------


def _jobs(head) -> list[dict]:  # noqa: ANN001
    return head.rest("/api/jobs/")


def test_submit_to_a_running_cluster_round_trips_result_and_metadata(ray_head, tmp_path: Path) -> None:  # noqa: ANN001
    run = launch("jobs/matmul_scaling.yaml", "--backend", "ray", "--address", ray_head.address, *SMALL,
                 "--out", str(tmp_path), env=ray_head.env)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    result = _result(tmp_path, "matmul_scaling")
    assert result["status"] == "succeeded" and result["backend"] == "ray" and result["world_sizes"] == [1, 2]
    assert "world size 2 on cpu (ray)" in run.stdout  # the job's logs streamed to the console

    [job] = [j for j in _jobs(ray_head) if (j.get("submission_id") or "").startswith("matmul_scaling-")]
    assert job["status"] == "SUCCEEDED"
    assert job["metadata"]["job_name"] == "matmul_scaling"
    assert job["metadata"]["world_size"] == "2"
    assert job["metadata"]["spec_hash"] == result["spec_hash"]
    job_id = job["submission_id"]

    # Ray's own client agrees
    ray_cli = subprocess.run([str(Path(sys.executable).parent / "ray"), "job", "status", job_id, "--address", ray_head.address],
                             env=ray_head.env, capture_output=True, text=True, timeout=60)
    assert ray_cli.returncode == 0 and "succeeded" in (ray_cli.stdout + ray_cli.stderr).lower()

    status = launch("status", job_id, "--address", ray_head.address, "--json", env=ray_head.env)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["status"] == "SUCCEEDED"
    logs = launch("logs", job_id, "--address", ray_head.address, env=ray_head.env)
    assert logs.returncode == 0 and "matmul_scaling: world size 2" in logs.stdout
    assert "@gpulaunch-bundle" not in logs.stdout


def test_on_a_cluster_the_world_size_comes_from_the_cluster_not_this_machine(ray_head, tmp_path: Path) -> None:  # noqa: ANN001
    # the head offers 4 CPUs whatever this machine has; cpu_workers: auto means all of them
    run = launch("jobs/matmul_scaling.yaml", "--backend", "ray", "--address", ray_head.address, *SMALL,
                 "--set", "resources.cpu_workers=auto", "--set", "scaling=null", "--out", str(tmp_path), env=ray_head.env)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    result = _result(tmp_path, "matmul_scaling")
    assert result["world_sizes"] == [4]
    assert sorted(r["rank"] for r in result["ranks"]) == [0, 1, 2, 3]


def test_dry_run_shows_the_gang_and_the_actors_and_starts_no_ray(tmp_path: Path) -> None:
    baseline = descendants(os.getpid())
    run = launch("jobs/matmul_scaling.yaml", "--backend", "ray", "--dry-run", "--set", "ray.placement=spread", "--out", str(tmp_path))
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())
    assert "placement group matmul_scaling-world2: 2 x {'CPU': 1.0}, strategy SPREAD" in text
    assert "ray actor matmul_scaling-rank1" in text and "nothing was started" in text
    assert not any(tmp_path.iterdir()) and wait_no_orphans(baseline) == []


def test_cluster_without_the_resources_fails_with_a_gang_scheduling_message(ray_head, tmp_path: Path) -> None:  # noqa: ANN001
    run = launch("jobs/matmul_scaling.yaml", "--backend", "ray", "--address", ray_head.address, *SMALL,
                 "--set", "resources.cpu_workers=8", "--set", "scaling.workers=[8]", "--set", "timeouts.rendezvous_s=2",
                 "--out", str(tmp_path), env=ray_head.env)
    assert run.returncode == 1, run.stderr[-3000:] + run.stdout[-3000:]
    assert "gang scheduling timed out" in run.stdout
    assert _result(tmp_path, "matmul_scaling")["status"] == "failed"
    [job] = [j for j in _jobs(ray_head) if (j.get("metadata") or {}).get("world_size") == "8"]
    assert job["status"] == "FAILED"


def test_launch_stop_ends_a_running_cluster_job(ray_head, tmp_path: Path) -> None:  # noqa: ANN001
    # the job's own code lives in its directory (the working dir Ray ships), as a user's would
    shutil.copy(REPO / "tests" / "integration" / "faulty.py", tmp_path / "faulty_job.py")
    spec = _faulty_job(tmp_path, "sleep", sleep_s=300)
    spec.write_text(spec.read_text().replace("tests.integration.faulty:run", "faulty_job:run"))
    before = {j["submission_id"] for j in _jobs(ray_head)}
    env = {**ray_head.env, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    proc = subprocess.Popen([sys.executable, "-m", "launcher", str(spec), "--address", ray_head.address, "--set", "scaling.workers=[1]",
                             "--out", str(tmp_path / "out")], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, job_id, logs = time.monotonic() + 90, None, ""
        while time.monotonic() < deadline and "faulty: rank 0" not in logs:
            new = [j for j in _jobs(ray_head) if j["submission_id"] not in before]
            if new:
                job_id = new[0]["submission_id"]
                assert new[0]["status"] in ("PENDING", "RUNNING"), new[0].get("message")
                logs = launch("logs", job_id, "--address", ray_head.address, env=ray_head.env).stdout
            time.sleep(0.5)
        assert job_id is not None and "faulty: rank 0" in logs, "the job never ran"
        stop = launch("stop", job_id, "--address", ray_head.address, env=ray_head.env)
        assert stop.returncode == 0, stop.stderr
        assert "STOPPED" in stop.stdout
        assert proc.wait(60) != 0
        assert [j["status"] for j in _jobs(ray_head) if j["submission_id"] == job_id] == ["STOPPED"]
        assert not ray_head.live_actors("faulty-rank")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_unreachable_address_is_one_line_exit_2(tmp_path: Path) -> None:
    from launcher.procutil import free_port

    address = f"http://127.0.0.1:{free_port()}"
    for argv in (["jobs/matmul_scaling.yaml", "--backend", "ray", "--address", address], ["status", "x", "--address", address],
                 ["jobs/matmul_scaling.yaml", "--address", "127.0.0.1:8265"]):
        run = launch(*argv, "--out", str(tmp_path)) if argv[0].endswith(".yaml") else launch(*argv)
        assert run.returncode == 2, run.stderr
        assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: ") and "Traceback" not in run.stderr


def test_embedded_group_restarts_within_max_restarts(tmp_path: Path) -> None:
    baseline = descendants(os.getpid())
    spec = _faulty_job(tmp_path, "flaky", rank=1, marker=str(tmp_path / "marker"))
    run = launch(str(spec), "--set", "max_restarts=1", "--out", str(tmp_path / "out"), "--quiet")
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    result = _result(tmp_path / "out", "faulty")
    assert result["status"] == "succeeded" and result["restarts"] == 1
    assert wait_no_orphans(baseline) == []
