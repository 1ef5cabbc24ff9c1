"""End to end with real torchrun processes (gloo on CPU): the first things every user types."""

from __future__ import annotations

import json
import socket
import textwrap
from pathlib import Path

import pytest

from tests.conftest import launch, pids_mentioning

TINY = ["--set", "params.sizes=[32,64]", "--set", "params.iters=3", "--set", "params.warmup=1"]


@pytest.fixture(scope="module")
def matmul_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    done = launch("jobs/matmul_scaling.yaml", *TINY, "--out", str(out))
    (run_dir,) = (out / "matmul_scaling").iterdir()
    return done, run_dir


def test_matmul_scaling_runs_world_sizes_1_and_2(matmul_run):
    done, run_dir = matmul_run
    assert done.returncode == 0, done.stderr
    result = json.loads((run_dir / "result.json").read_text())
    assert result["schema_version"] == 1
    assert (result["job"], result["backend"], result["status"]) == ("matmul_scaling", "torchrun", "succeeded")
    assert result["world_sizes"] == [1, 2] and result["world_size"] == 2
    from launcher.workloads.matmul import Params

    # what the ranks ran with: the spec's params with every default of the workload filled in
    written = {"sizes": [32, 64], "iters": 3, "warmup": 1, "dtype": "float32"}
    assert result["params"] == Params.model_validate(written).model_dump(mode="json", by_alias=True)
    assert {k: result["params"][k] for k in written} == written and len(result["params"]) > len(written)
    assert set(result["phases"]) >= {"spawn", "import", "rendezvous", "pg_init", "run", "aggregate"}
    assert all(v is not None and v >= 0 for k, v in result["phases"].items() if k != "launcher_cpu_s")
    assert result["phases"]["launcher_cpu_s"]["before_spawn"] > 0  # the launcher's own CPU (test_launcher_cpu.py)
    ranks = [r for r in result["ranks"] if r["world_size"] == 2]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["device"] == "cpu" and r["host"] == socket.gethostname() and r["status"] == "ok"
        assert len(r["metrics"]["times_ms"]["matmul/64"]) == result["params"]["trials"]  # one time per trial
        assert r["metrics"]["steps"] == 3 * 2 * result["params"]["trials"]  # 3 iters x 2 sizes per trial, counted on the host
        assert {"spawned", "imported", "joined", "pg_ready", "first_step", "finished"} <= set(r["phases"])
        assert r["phases"]["imported"] <= r["phases"]["joined"] <= r["phases"]["pg_ready"] <= r["phases"]["first_step"]
    rows = {(row["workers"], row["size"]): row for row in result["scaling"]}
    assert set(rows) == {(1, 32), (1, 64), (2, 32), (2, 64)}
    assert rows[(1, 64)]["efficiency"] == 1.0
    assert rows[(2, 64)]["gflops"] > 0 and 0 < rows[(2, 64)]["efficiency"]
    assert rows[(2, 64)]["threads_per_worker"] * 2 <= max(rows[(1, 64)]["threads_per_worker"] * 2, 2)


def test_run_directory_holds_plot_logs_and_reports(matmul_run):
    done, run_dir = matmul_run
    png = run_dir / "scaling.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for rank in (0, 1):
        assert json.loads((run_dir / "world2" / "reports" / f"rank{rank}.json").read_text())["rank"] == rank
    assert "run directory:" in done.stdout and str(run_dir) in done.stdout.replace("\n", "")
    assert "scaling efficiency" in done.stdout


def test_no_process_of_the_run_remains(matmul_run):
    _, run_dir = matmul_run
    assert pids_mentioning(str(run_dir)) == []


def test_script_mode_gets_torchrun_env_and_prefixed_output(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """\
            import os, sys
            import torch, torch.distributed as dist
            dist.init_process_group("gloo")
            t = torch.ones(1) * (dist.get_rank() + 1)
            dist.all_reduce(t)
            keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
            print("env", " ".join(f"{k}={os.environ[k]}" for k in keys), "sum", int(t.item()), "argv", sys.argv[1:])
            dist.destroy_process_group()
            """
        )
    )
    spec = tmp_path / "script_job.yaml"
    spec.write_text("name: script_job\nscript: train.py\nargs: [--lr, 3e-4]\nresources: {cpu_workers: 2}\n")
    done = launch(str(spec), "--out", str(tmp_path / "runs"))
    assert done.returncode == 0, done.stderr
    host = socket.gethostname()
    for rank in (0, 1):
        line = next(ln for ln in done.stdout.splitlines() if ln.startswith(f"{host}:{rank} env"))
        assert f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1" in line
        assert "sum 3" in line and "['--lr', '3e-4']" in line
    (run_dir,) = (tmp_path / "runs" / "script_job").iterdir()
    log = (run_dir / "world2" / "logs" / "rank1.log").read_text()
    assert "RANK=1" in log and "sum 3" in log


def test_python_api_returns_the_result(tmp_path):
    import launcher
    from launcher.ui.console import RunUI

    result = launcher.run_job(
        "jobs/matmul_scaling.yaml",
        overrides=["params.sizes=[16]", "params.iters=2", "scaling.workers=[1]"],
        out=tmp_path,
        events=RunUI(quiet=True),
    )
    assert result.ok and result.path.is_file()
    assert result["world_size"] == 1 and result["scaling"][0]["workers"] == 1


def test_dry_run_prints_plan_and_torchrun_commands_and_spawns_nothing(tmp_path):
    done = launch("jobs/sync_logging.yaml", "--dry-run", "--out", str(tmp_path), "--set", "params.steps=10")
    assert done.returncode == 0, done.stderr
    text = done.stdout.replace("\n", " ")
    assert "torchrun --nnodes=1 --nproc-per-node=2" in text and "--rdzv-backend=static" in text
    assert "gloo" in text and "nothing was started" in text
    params = next(line for line in done.stdout.splitlines() if line.startswith("params: "))
    assert json.loads(params.removeprefix("params: ")) == {"steps": 10, "n": 100, "repeats": 3, "warmup": 1, "dtype": "float32", "seed": 0}
    assert not any(tmp_path.iterdir())


def test_dry_run_json_is_the_plan(tmp_path):
    done = launch("jobs/matmul_scaling.yaml", "--dry-run", "--json", "--set", "env.HF_TOKEN=secret", "--out", str(tmp_path))
    plans = json.loads(done.stdout)
    assert [p["world_size"] for p in plans] == [1, 2]
    assert plans[1]["ranks"][1]["device"] == "cpu" and plans[1]["ranks"][1]["local_rank"] == 1
    assert plans[0]["nodes"][0]["env"]["HF_TOKEN"] == "****" and "secret" not in done.stdout


def test_devices_says_plainly_there_is_no_gpu():
    done = launch("devices", env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0
    assert "no GPU visible" in done.stdout and "worker process" in done.stdout
    data = json.loads(launch("devices", "--json", env={"PATH": "/usr/bin:/bin"}).stdout)
    assert data["gpus"] == [] and data["cpu_count"] >= 1


def test_validate_checks_every_job(repo):
    specs = sorted(str(p.relative_to(repo)) for p in Path(repo, "jobs").glob("*.yaml"))
    done = launch("validate", *specs)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("ok  ") == len(specs)


def test_gpus_asked_for_without_a_gpu_run_on_the_cpu_and_say_so(tmp_path):
    # no GPU visible to the ranks, on this machine or on one with GPUs
    gpus = ["--set", "resources.gpus_per_node=2", "--set", "scaling.workers=[1]", "--set", "env.CUDA_VISIBLE_DEVICES="]
    note = "note: resources.gpus_per_node is 2, but"
    checked = launch("validate", "jobs/matmul_scaling.yaml", *gpus)
    assert checked.returncode == 0 and "on cpu here; " + note in checked.stdout, checked.stdout
    ran = launch("jobs/matmul_scaling.yaml", *gpus, *TINY, "--out", str(tmp_path), env={"COLUMNS": "400"})
    assert ran.returncode == 0 and note in ran.stdout and "running on the CPU" in ran.stdout, ran.stdout + ran.stderr
    (run_dir,) = (tmp_path / "matmul_scaling").iterdir()
    assert {r["device"] for r in json.loads((run_dir / "result.json").read_text())["ranks"]} == {"cpu"}


def test_bad_spec_exits_2_with_one_line_and_no_run(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nentrypoint: launcher.workloads.matmul:run\nresources: {gpus_per_nod: 2}\n")
    done = launch(str(bad), "--out", str(tmp_path / "runs"))
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: {bad}:3: resources.gpus_per_nod: unknown key, did you mean 'gpus_per_node'?"
    assert not (tmp_path / "runs").exists()


def test_a_listed_world_that_does_not_fit_is_skipped_and_the_others_run(tmp_path):
    done = launch("jobs/matmul_scaling.yaml", *TINY, "--set", "scaling.workers=[1,3]", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    said = " ".join((done.stdout + done.stderr).split())
    assert "world size 3 skipped: it needs 3 worker slot(s) per node but resources.cpu_workers gives 2" in said
    (run_dir,) = (tmp_path / "matmul_scaling").iterdir()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "succeeded" and result["world_sizes"] == [1]
    assert result["skipped_worlds"] == [
        {"world_size": 3, "reason": "needs 3 worker slot(s) per node but resources.cpu_workers gives 2",
         "remedy": "--set resources.cpu_workers=3 runs it on the CPU"}
    ]  # fmt: skip
    assert not (run_dir / "world3").exists()
