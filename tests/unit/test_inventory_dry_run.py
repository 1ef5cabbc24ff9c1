"""Plans for a node you are not on: every shipped job dry-runs against recorded one-GPU and
eight-GPU nodes (``--inventory``), worlds follow the GPUs present, and ranks can share a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.ui.cli import main
from tests.conftest import REPO

NVML = Path(__file__).parent / "data" / "nvml"
ONE_GPU = NVML / "h200_1gpu.json"
EIGHT_GPUS = NVML / "h100_sxm_8gpu.json"
JOBS = sorted((REPO / "jobs").glob("*.yaml"))


def _plans(capsys, job: Path, inventory: Path, *overrides: str) -> list[dict]:
    sets = [arg for o in overrides for arg in ("--set", o)]
    rc = main([str(job), "--dry-run", "--inventory", str(inventory), "--json", *sets])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(captured.out)


def _text(capsys, job: Path, inventory: Path, *overrides: str) -> str:
    sets = [arg for o in overrides for arg in ("--set", o)]
    rc = main([str(job), "--dry-run", "--inventory", str(inventory), *sets])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return " ".join(captured.out.split())  # notes wrap at the console's width


@pytest.mark.parametrize("inventory", [ONE_GPU, EIGHT_GPUS], ids=["one-gpu", "eight-gpus"])
@pytest.mark.parametrize("job", JOBS, ids=[j.stem for j in JOBS])
def test_every_shipped_job_plans_on_a_recorded_gpu_node(capsys, job, inventory):
    plans = _plans(capsys, job, inventory)
    gpus = 1 if inventory == ONE_GPU else 8
    assert plans and all(p["device_type"] == "cuda" for p in plans)
    assert max(p["world_size"] for p in plans) <= gpus
    for plan in plans:  # one rank per GPU, each on its own, over NCCL
        assert [r["device"] for r in plan["ranks"]] == [f"cuda:{k}" for k in range(plan["world_size"])]
        assert all(r["host"] == inventory.stem for r in plan["ranks"])


def test_the_headline_job_scales_over_every_gpu_of_an_eight_gpu_node(capsys):
    plans = _plans(capsys, REPO / "jobs" / "matmul_scaling.yaml", EIGHT_GPUS)
    assert [p["world_size"] for p in plans] == [1, 2, 4, 8]


@pytest.mark.parametrize("job", ["matmul_scaling", "ddp_train"])
def test_on_one_gpu_the_scaling_jobs_run_world_one(capsys, job):
    plans = _plans(capsys, REPO / "jobs" / f"{job}.yaml", ONE_GPU)
    assert [p["world_size"] for p in plans] == [1]


def test_two_ranks_sharing_the_one_gpu_plan_world_two_on_it_over_gloo_and_say_so(capsys):
    job = REPO / "jobs" / "ddp_train.yaml"
    plans = _plans(capsys, job, ONE_GPU, "resources.ranks_per_gpu=2")
    assert [p["world_size"] for p in plans] == [1, 2]
    world2 = plans[-1]
    assert [r["device"] for r in world2["ranks"]] == ["cuda:0", "cuda:0"]
    assert [r["local_rank"] for r in world2["ranks"]] == [0, 1]
    said = _text(capsys, job, ONE_GPU, "resources.ranks_per_gpu=2")
    assert "│ 1 │ 0 │ h200_1gpu │ 1 │ cuda:0 │ gloo │" in said
    assert "ranks_per_gpu: 2 ranks share each GPU" in said and "gloo over CUDA tensors" in said


def test_a_listed_world_that_does_not_fit_one_gpu_is_named_skipped(capsys):
    job = REPO / "jobs" / "matmul_scaling.yaml"
    plans = _plans(capsys, job, ONE_GPU, "scaling.workers=[1,2]")
    assert [p["world_size"] for p in plans] == [1]
    said = _text(capsys, job, ONE_GPU, "scaling.workers=[1,2]")
    assert "note: world size 2 skipped: it needs 2 worker slot(s) per node but 1 GPU(s) give 1" in said
    assert "resources.ranks_per_gpu: 2" in said


def test_a_cluster_file_planned_on_a_recorded_node_logs_in_to_no_host(capsys, tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("hosts:\n  - {name: n1, address: 192.0.2.1}\n  - {name: n2, address: 192.0.2.2}\n")
    plans = _plans(capsys, REPO / "jobs" / "matmul_scaling.yaml", EIGHT_GPUS, "resources.nodes=2", f"cluster={cluster}")
    assert [p["world_size"] for p in plans] == [2, 4, 8, 16]
    assert {r["host"] for r in plans[-1]["ranks"]} == {"n1", "n2"}
    assert plans[-1]["rendezvous"] == "192.0.2.1:29500"


@pytest.mark.parametrize(
    "content, expect",
    [(None, "cannot read it"), ("{not json", "not JSON"), ('{"gpus": []}', "neither a device list nor an NVML recording")],
    ids=["missing", "not-json", "other-json"],
)
def test_an_unreadable_inventory_is_one_line_exit_2(capsys, tmp_path, content, expect):
    path = tmp_path / "node.json"
    if content is not None:
        path.write_text(content)
    rc = main([str(REPO / "jobs" / "matmul_scaling.yaml"), "--dry-run", "--inventory", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"--inventory {path}" in err[0] and expect in err[0], err


def test_inventory_without_dry_run_is_refused(capsys):
    rc = main([str(REPO / "jobs" / "matmul_scaling.yaml"), "--inventory", str(ONE_GPU)])
    err = capsys.readouterr().err
    assert rc == 2 and "add --dry-run" in err


def test_a_device_list_from_launch_devices_is_an_inventory_too(capsys, tmp_path):
    from launcher.hardware.devices import NodeInventory, load_inventory

    recorded = load_inventory(EIGHT_GPUS)
    listing = tmp_path / "gpu-box.json"
    listing.write_text(NodeInventory.to_json(recorded.__class__(**{**recorded.__dict__, "hostname": "gpu-box", "cpu_count": 64})))
    plans = _plans(capsys, REPO / "jobs" / "ddp_train.yaml", listing)
    assert [p["world_size"] for p in plans] == [1, 2, 4, 8]
    assert plans[-1]["nodes"][0]["threads"] == 8  # 64 CPUs over 8 ranks


def test_a_dry_run_over_ssh_logs_in_to_no_host_and_says_what_it_assumed(capsys, tmp_path, monkeypatch):
    """192.0.2.0/24 is TEST-NET-1: nothing answers there, and nothing may try (the SSH client is
    made to fail loudly if it is started at all)."""
    import launcher.backends.ssh as ssh

    monkeypatch.setattr(ssh, "preflight_hosts", lambda *a, **k: pytest.fail("the dry run logged in"))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("hosts:\n  - {name: n1, address: 192.0.2.1}\n  - {name: n2, address: 192.0.2.2}\n")
    job = REPO / "jobs" / "matmul_scaling.yaml"
    plans = _plans(capsys, job, ONE_GPU, "resources.nodes=2", f"cluster={cluster}")  # a recorded node: its GPU
    assert [p["world_size"] for p in plans] == [2] and plans[0]["device_type"] == "cuda"
    rc = main([str(job), "--dry-run", "--cluster", str(cluster), "--set", "resources.nodes=2", "--set", "resources.gpus_per_node=4"])
    said = " ".join(capsys.readouterr().out.split())
    assert rc == 0
    assert said.count(" $ ssh ") == 6  # worlds 2, 4 and 8, each a command per host
    assert "hosts not logged in to: planned as written with 4 GPU(s) per host as resources.gpus_per_node says" in said
    assert "--preflight logs in" in said
