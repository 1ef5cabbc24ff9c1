"""The Ray backend end to end: embedded Ray, a real head on 127.0.0.1 through the Jobs API,
failures, and that no process of a run is left behind (checked by pid).

Starting a Ray costs 5-10 s here, so one test proves the embedded lifecycle through ``launch``
(Ray started, the job run, every Ray process gone afterwards); the tests of what the backend does
with a job (a rank that raises, an actor that dies, restarts within ``max_restarts``, the cluster's
world size) call ``launcher.run_job`` in this process, connected as a Ray driver to the session's
head (``ray_driver``, as a notebook's own ``ray.init``), and check that the run left no actor,
placement group or rank process behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import launcher
from launcher.protocol import ENV_RAY_CONNECT
from tests.ray.conftest import REPO, RayHead, assert_ray_run_left_nothing, descendants, launch, wait_no_orphans

pytestmark = pytest.mark.slow

SMALL_OVERRIDES = ["params.sizes=[64]", "params.iters=3", "params.warmup=1"]
SMALL = [arg for item in SMALL_OVERRIDES for arg in ("--set", item)]


def _result(out: Path, job: str) -> dict:
    found = sorted(out.glob(f"{job}/*/result.json"))
    assert len(found) == 1, found
    return json.loads(found[0].read_text())


def _shape(value: object) -> object:
    """The schema of a JSON document: its keys and how they nest, not the values. A leaf is a
    value whatever it holds: a figure the machine's load flags carries a note (a string) where a
    quiet run's is None, and the two runs here share two cores, so which one is noisy is chance."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items() if k not in ("timeline_s", "phases", "spec", "log", "metrics", "result")}
    if isinstance(value, list):
        return "list" if not value or not isinstance(value[0], (dict, list)) else [_shape(value[0])]
    return "value"


def _faulty_job(tmp_path: Path, fault: str, **params: object) -> Path:
    spec = tmp_path / f"faulty_{fault}.yaml"
    extra = "".join(f", {k}: {v}" for k, v in params.items())
    spec.write_text(
        "name: faulty\nentrypoint: tests.integration.faulty:run\n"
        f"params: {{fault: {fault}{extra}}}\nbackend: ray\n"
        "resources: {cpu_workers: 2}\ntimeouts: {rendezvous_s: 60, run_s: 120}\n"
    )
    return spec


def _run(spec: Path, out: Path, *overrides: str) -> launcher.RunResult:
    """``launcher.run_job`` in this process on the Ray it is connected to (``ray_driver``)."""
    return launcher.run_job(spec, overrides=list(overrides), backend="ray", out=out, events=launcher.RunEvents())


def _rank_pids(result: dict) -> list[int]:
    """The pids the ranks ran as: from their reports, and from the faulty job's first line (a rank
    whose actor died wrote no report)."""
    pids = [r["pid"] for r in result["ranks"] if isinstance(r.get("pid"), int)]
    for log in Path(result["run_dir"]).glob("world*/logs/rank*.log"):
        pids += [int(p) for p in re.findall(r"faulty: rank \d+ pid (\d+)", log.read_text())]
    return pids


# --- embedded Ray ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_ray_driver")
def test_embedded_ray_runs_the_torchrun_job_with_the_same_result_schema(tmp_path: Path) -> None:
    baseline = descendants(os.getpid())
    # the same job on torchrun, for the schema, runs alongside (its launch is waited for below)
    with ThreadPoolExecutor(1) as pool:
        torch_f = pool.submit(launch, "jobs/matmul_scaling.yaml", "--backend", "torchrun", *SMALL, "--out", str(tmp_path / "tr"))
        ray_run = launch("jobs/matmul_scaling.yaml", "--backend", "ray", *SMALL, "--out", str(tmp_path / "ray"))
        torch_run = torch_f.result()
    assert ray_run.returncode == 0, ray_run.stderr[-3000:] + ray_run.stdout[-3000:]
    assert wait_no_orphans(baseline) == [], "a process of the embedded Ray run (or of the torchrun run) is still alive"
    assert "Ray dashboard: http://127.0.0.1:" in ray_run.stderr
    # Ray's own warning about its token auth stays off the console; the launcher says it, once
    assert "Token authentication is enabled" not in ray_run.stderr + ray_run.stdout
    assert "token auth on)" in ray_run.stderr, ray_run.stderr[-2000:]

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

    assert torch_run.returncode == 0, torch_run.stderr[-3000:]
    torch_result = _result(tmp_path / "tr", "matmul_scaling")
    assert _shape(ray_result) == _shape(torch_result)
    assert {r["metrics"]["steps"] for r in torch_result["ranks"]} == {r["metrics"]["steps"] for r in ray_result["ranks"]}


@pytest.mark.usefixtures("no_ray_driver")
def test_exposing_the_dashboard_needs_an_explicit_flag(tmp_path: Path) -> None:
    baseline = descendants(os.getpid())
    run = launch("jobs/matmul_scaling.yaml", "--backend", "ray", "--set", "ray.dashboard_host=0.0.0.0", "--out", str(tmp_path))
    assert run.returncode == 2
    assert "ray.expose_dashboard" in run.stderr and "Traceback" not in run.stderr
    assert wait_no_orphans(baseline) == []


# --- the backend's behaviour, on the session's Ray (this process is its driver) -----------------------


def test_rank_that_raises_fails_the_job_with_its_rank_and_traceback(ray_driver: RayHead, tmp_path: Path) -> None:
    run = _run(_faulty_job(tmp_path, "raise", rank=1), tmp_path)
    assert run.exit_code == 1 and run.status == "failed", run.data.get("failure")
    result = _result(tmp_path, "faulty")
    failure = result["failure"]
    assert failure["root_cause"]["rank"] == 1
    assert "ValueError: injected failure on rank 1" in failure["root_cause"]["traceback"]
    assert failure["collateral_ranks"] == [0]
    assert "faulty: rank 1" in Path(result["run_dir"], "world2", "logs", "rank1.log").read_text()
    assert_ray_run_left_nothing(ray_driver, "faulty", _rank_pids(result))


def test_actor_that_dies_fails_the_job_with_its_rank(ray_driver: RayHead, tmp_path: Path) -> None:
    run = _run(_faulty_job(tmp_path, "exit", rank=1), tmp_path)
    assert run.exit_code == 1 and run.status == "failed", run.data.get("failure")
    result = _result(tmp_path, "faulty")
    failure = result["failure"]
    assert failure["root_cause"]["rank"] == 1, failure["summary"]
    assert failure["root_cause"]["type"] == "ActorDied"
    assert failure["root_cause"]["traceback"]  # Ray's account of the death
    assert_ray_run_left_nothing(ray_driver, "faulty", _rank_pids(result))


def test_group_restarts_within_max_restarts(ray_driver: RayHead, tmp_path: Path) -> None:
    spec = _faulty_job(tmp_path, "flaky", rank=1, marker=str(tmp_path / "marker"))
    run = _run(spec, tmp_path / "out", "max_restarts=1")
    assert run.exit_code == 0, run.data.get("failure")
    result = _result(tmp_path / "out", "faulty")
    assert result["status"] == "succeeded" and result["restarts"] == 1
    assert (tmp_path / "marker").is_file()  # the first attempt did fail
    assert_ray_run_left_nothing(ray_driver, "faulty", _rank_pids(result))


def test_on_a_cluster_the_world_size_comes_from_the_cluster_not_this_machine(
    ray_driver: RayHead, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # inside a Ray job (what `launch --address` submits) the launcher plans on the cluster it is
    # connected to: the head offers 4 CPUs whatever this machine has; cpu_workers: auto means all of them
    monkeypatch.setenv(ENV_RAY_CONNECT, "1")
    run = _run(REPO / "jobs" / "matmul_scaling.yaml", tmp_path, *SMALL_OVERRIDES, "resources.cpu_workers=auto", "scaling=null")
    assert run.exit_code == 0, run.data.get("failure")
    result = _result(tmp_path, "matmul_scaling")
    assert result["world_sizes"] == [4]
    assert sorted(r["rank"] for r in result["ranks"]) == [0, 1, 2, 3]
    assert_ray_run_left_nothing(ray_driver, "matmul_scaling", _rank_pids(result))


# --- a running cluster, through the Jobs API ----------------------------------------------------------


def _jobs(head) -> list[dict]:  # noqa: ANN001
    return head.rest("/api/jobs/")


def test_submit_to_a_running_cluster_round_trips_result_and_metadata(ray_head, tmp_path: Path) -> None:  # noqa: ANN001
    run = launch("jobs/matmul_scaling.yaml", "--backend", "ray", "--address", ray_head.address, *SMALL, "--set", "scaling.workers=[1,2]",
                 "--out", str(tmp_path), env=ray_head.env)  # fmt: skip
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
    # the launcher inside the job ran its ranks as actors on this cluster (not on a Ray of its own)
    ranks = [a for a in ray_head.actors("matmul_scaling-rank") if a.get("job_id") == job["job_id"]]
    assert len(ranks) == 3, ranks  # rank 0 at world size 1, ranks 0 and 1 at world size 2
    assert ray_head.live_actors("matmul_scaling-rank") == [] and ray_head.live_placement_groups("matmul_scaling-world") == []

    # Ray's own client agrees; `launch status` and `launch logs` read the same job (run side by side)
    ray_argv = [str(Path(sys.executable).parent / "ray"), "job", "status", job_id, "--address", ray_head.address]
    with ThreadPoolExecutor(3) as pool:
        ray_cli_f = pool.submit(subprocess.run, ray_argv, env=ray_head.env, capture_output=True, text=True, timeout=60)
        status_f = pool.submit(launch, "status", job_id, "--address", ray_head.address, "--json", env=ray_head.env)
        logs_f = pool.submit(launch, "logs", job_id, "--address", ray_head.address, env=ray_head.env)
        ray_cli, status, logs = ray_cli_f.result(), status_f.result(), logs_f.result()
    assert ray_cli.returncode == 0 and "succeeded" in (ray_cli.stdout + ray_cli.stderr).lower()
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["status"] == "SUCCEEDED"
    assert logs.returncode == 0 and "matmul_scaling: world size 2" in logs.stdout
    assert "@gpulaunch-bundle" not in logs.stdout


@pytest.mark.usefixtures("no_ray_driver")
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


@pytest.mark.usefixtures("no_ray_driver")
def test_unreachable_address_is_one_line_exit_2(tmp_path: Path) -> None:
    from launcher.procutil import free_port

    address = f"http://127.0.0.1:{free_port()}"
    argvs = (["jobs/matmul_scaling.yaml", "--backend", "ray", "--address", address, "--out", str(tmp_path)],
             ["status", "x", "--address", address], ["jobs/matmul_scaling.yaml", "--address", "127.0.0.1:8265", "--out", str(tmp_path)])
    with ThreadPoolExecutor(len(argvs)) as pool:  # side by side: each is a second of Python start-up
        runs = list(pool.map(lambda argv: launch(*argv), argvs))
    for run in runs:
        assert run.returncode == 2, run.stderr
        assert run.stderr.count("\n") == 1 and run.stderr.startswith("error: ") and "Traceback" not in run.stderr
