"""The d2l "GPUs" job suite, end to end: real `launch jobs/X.yaml` runs (torchrun, gloo, CPU) at
world sizes 1 and 2 with tiny sizes. Assertions are on result.json and the plots, never on timings:
how many trials were timed, that every figure comes with its range and flags, never what it is."""

from __future__ import annotations

import hashlib
import json
import math

import pytest

from tests.conftest import launch
from tests.jobs.conftest import TINY_TRAIN, assert_plots, assert_succeeded, run_job

BOTH = "scaling.workers=[1,2]"


@pytest.fixture(scope="module")
def cpu_vs_gpu(runs_root):
    return run_job(runs_root, "cpu_vs_gpu", BOTH, "resources.cpu_workers=2", "params.sizes=[8,32]", "params.work_gflop=0.0001",
                   "params.max_iters=20", "params.warmup=1", "params.trials=3")


@pytest.fixture(scope="module")
def sync_logging(runs_root):
    return run_job(runs_root, "sync_logging", BOTH, "params.steps=40", "params.n=16", "params.repeats=2")


@pytest.fixture(scope="module")
def transfer(runs_root):
    return run_job(runs_root, "transfer", BOTH, "params.sizes_mb=[0.25,1]", "params.repeats=2")


@pytest.fixture(scope="module")
def ddp_train(runs_root):
    return run_job(runs_root, "ddp_train", BOTH, *TINY_TRAIN, "params.epochs=2")


def assert_ranged(row: dict, key: str) -> None:
    """A timed figure is a median with the min-max of its trials around it."""
    assert row[f"{key}_min"] <= row[key] <= row[f"{key}_max"], (key, row)


def assert_flagged_honestly(row: dict) -> None:
    """Flags are a list of known words, and the table's note says them (or is None)."""
    assert set(row["flags"]) <= {"noisy", "single-trial", "super-linear", "busy"}
    assert (row["note"] is None) == (not row["flags"])


def test_cpu_vs_gpu_reports_the_cpu_and_says_the_gpu_was_not_measured(cpu_vs_gpu):
    assert_succeeded(cpu_vs_gpu, "cpu_vs_gpu", [1, 2])
    s = cpu_vs_gpu.summary
    assert [row["size"] for row in s["rows"]] == [8, 32]
    for row in s["rows"]:
        assert 1 <= row["iters"] <= 20
        assert row["cpu_us"] > 0 and row["cpu_gflops"] > 0
        assert row["gpu_us"] is None and row["gpu_gflops"] is None and row["speedup"] is None  # never made up
        assert row["gpu_us_min"] is None and row["gpu_us_range"] is None  # missing, not 0
        assert row["trials"] == 3 * 2 and row["cpu_us_range"]  # 3 trials by local rank 0 of each of the 2 stages
        assert_ranged(row, "cpu_us")
        assert_flagged_honestly(row)
    assert s["gpu_measured"] is False and s["break_even_size"] is None
    assert any("GPU side not measured" in c for c in s["conclusions"])
    # the CPU is measured once per node (local rank 0), with the cores of the node
    for ws in (1, 2):
        measured = [r["rank"] for r in cpu_vs_gpu.ranks(ws) if r["result"]["cpu_measured"]]
        assert measured == [0]
        (r0,) = [r for r in cpu_vs_gpu.ranks(ws) if r["rank"] == 0]
        assert all(len(r0["metrics"]["times_ms"][f"cpu/{n}"]) == 3 for n in (8, 32))  # one timing per trial
    assert "GPU side not measured" in cpu_vs_gpu.stdout.replace("\n", " ")
    assert_plots(cpu_vs_gpu, "cpu_vs_gpu.png")


def test_sync_logging_counts_one_host_read_per_item_and_none_for_device_logs(sync_logging):
    assert_succeeded(sync_logging, "sync_logging", [1, 2])
    s = sync_logging.summary
    v = s["variants"]
    assert v["item"]["reads_loop"] == 40  # one .item() per step, counted by the TorchFunctionMode
    assert v["device"]["reads_loop"] == 0 and v["device"]["at_end"] == 1  # one copy at the end
    assert v["recorder"]["reads_loop"] == 0 and v["recorder"]["at_end"] == 1  # the launcher's recorder
    assert all(row["syncs_loop"] is None for row in s["rows"])  # no device: not measured, not zero
    assert s["device_syncs_measured"] is False
    for row in s["rows"]:
        assert row["wall_ms"] > 0 and row["us_step"] > 0
        assert row["wall_ms_min"] <= row["wall_ms_max"] and row["trials"] == 2 * len(sync_logging.ranks())  # 2 repeats a rank
        assert_flagged_honestly(row)
    assert v["device"]["ratio"] == 1.0 and v["item"]["ratio"] > 0
    assert v["item"]["ratio_min"] <= v["item"]["ratio_max"]
    assert s["ratio_item_vs_device"] == v["item"]["ratio"]
    assert s["logs_agree"] is True  # the three logs hold the same 40 norms
    for r in sync_logging.ranks():
        assert r["metrics"]["steps"] == 40  # ctx.metrics.step(), once per step of the recorder variant
        assert len(r["metrics"]["values"]["sync/norm"]) == 40
        assert all(math.isfinite(x) and x > 0 for x in r["metrics"]["values"]["sync/norm"])
        assert r["result"]["device_syncs"] is None
        assert len(r["metrics"]["times_ms"]["wall/item"]) == 2
    assert_plots(sync_logging, "sync_logging.png")


def test_transfer_measures_what_the_cpu_has_and_checks_identity(transfer):
    assert_succeeded(transfer, "transfer", [1, 2])
    s = transfer.summary
    kinds = {(row["kind"], row["mib"]) for row in s["rows"]}
    assert kinds == {("h2h/memcpy", 0.25), ("h2h/memcpy", 1.0), ("pg/pingpong", 0.25), ("pg/pingpong", 1.0)}
    assert all(row["gb_s"] > 0 for row in s["rows"])
    for row in s["rows"]:
        assert_ranged(row, "gb_s")
        assert_flagged_honestly(row)
        assert row["trials"] == 2 * row["ranks"]  # repeats=2 per rank
    assert s["on_gpu"] is False and s["pg_backends"] == ["gloo"]
    assert any("host->device, pinned" in n for n in s["not_measured"])
    assert s["pinned_vs_pageable"] == {}
    assert s["identity_ok"] is True and len(s["identity"]) == 3  # every rank of both stages
    for checks in s["identity"].values():
        assert checks == {"to_same_device_is_same": True, "cuda_or_cpu_call_is_same": True,
                          "same_storage": True, "copy_true_makes_new": True}
    # only rank 0 of the 2-rank stage measures the ping-pong
    pp = [r["rank"] for r in transfer.ranks() if any(k.startswith("pg/") for k in r["metrics"]["times_ms"])]
    assert pp == [0]
    assert_plots(transfer, "transfer.png")


def test_ddp_train_trains_checkpoints_and_reads_back_on_every_rank(ddp_train):
    assert_succeeded(ddp_train, "ddp_train", [1, 2])
    s = ddp_train.summary
    assert [row["workers"] for row in s["rows"]] == [1, 2]
    for row in s["rows"]:
        assert row["epochs"] == "0->2" and row["ckpt_ok"] is True
        assert row["rank_sps"] > 0 and row["total_sps"] > 0
        assert len(row["rank_sps_by_rank"]) == row["workers"]
        assert 0 <= row["train_acc"] <= 1 and 0 <= row["test_acc"] <= 1 and row["train_loss"] > 0
        # 2 epochs: the first is the warm-up, the second the one timed epoch, flagged as such
        assert row["timed_epochs"] == 1 and row["warmup_epoch_sps"] > 0 and "single-trial" in row["flags"]
        assert_ranged(row, "total_sps")
        assert row["threads_per_worker"] == 1  # the same threads per rank at every world size
    assert s["checkpoints_ok"] is True and s["like_for_like"] is True
    assert all("reach" not in c for c in s["conclusions"])  # one timed epoch: no scaling claimed
    for ws in (1, 2):
        steps = 2 * 1024 // 128 // ws  # two epochs of this world size's batches
        ckpt = ddp_train.run_dir / f"world{ws}" / "checkpoints" / f"step-{steps:09d}"
        assert (ckpt / "state.pt").stat().st_size > 0 and json.loads((ckpt / "manifest.json").read_text())["step"] == steps
        for r in ddp_train.ranks(ws):
            check = r["result"]["checkpoint_check"]
            sha = check.pop("sha256")
            assert check == {"map_location": "cpu", "all_on_device": True, "equals_replica": True, "epoch": 2, "step": steps, "tensors": 6}
            assert sha == hashlib.sha256((ckpt / "state.pt").read_bytes()).hexdigest()  # every rank loaded rank 0's file
            assert r["result"]["checkpoint"] == str(ckpt)
            assert r["result"]["samples_per_epoch"] == 1024 // ws  # each rank its shard
            assert len(r["metrics"]["values"]["train/loss"]) == 2 and len(r["metrics"]["values"]["test/acc"]) == 1
        # the metrics were reduced across ranks: every rank holds the same numbers
        values = [r["metrics"]["values"] for r in ddp_train.ranks(ws)]
        assert all(v == values[0] for v in values)
    assert_plots(ddp_train, "ddp_train.png")


def test_ddp_train_resume_continues_from_the_checkpoint_of_another_world_size(ddp_train, tmp_path):
    ckpt = ddp_train.run_dir / "world1" / "checkpoints"  # world size 1's checkpoints: the newest is taken
    mine = tmp_path / "ckpt"
    run = run_job(tmp_path, "ddp_train", "scaling.workers=[2]", *TINY_TRAIN, "params.epochs=3",
                  f"params.resume={ckpt}", f"checkpoint.dir={mine}")  # fmt: skip
    assert_succeeded(run, "ddp_train", [2])
    (row,) = run.summary["rows"]
    assert row["epochs"] == "2->3" and row["resumed_from"] == str(ckpt / "step-000000016") and row["ckpt_ok"] is True
    for r in run.ranks():
        assert r["result"]["start_epoch"] == 2 and r["result"]["epochs_run"] == 1 and r["result"]["start_step"] == 8
        assert r["result"]["checkpoint_check"]["epoch"] == 3
        assert len(r["metrics"]["values"]["train/loss"]) == 1
    assert (mine / "world2" / "step-000000012" / "manifest.json").is_file()
    # it continued training rather than starting over: its loss is below the fresh run's first epoch
    fresh_first = ddp_train.summary["curves"]["1"]["train_loss"][0]
    assert run.summary["curves"]["2"]["epochs"] == [3]
    assert run.summary["curves"]["2"]["train_loss"][0] < fresh_first


def test_ddp_train_resume_from_a_missing_checkpoint_fails_with_its_path_and_is_not_restarted(tmp_path):
    missing = tmp_path / "nope"
    run = run_job(tmp_path, "ddp_train", "scaling.workers=[1]", *TINY_TRAIN, f"params.resume={missing}")
    assert run.returncode == 1 and run.result["status"] == "failed" and run.result["restarts"] == 0  # a job error
    root = run.result["failure"]["root_cause"]
    assert root["type"] == "CheckpointError" and root["message"].startswith(f"checkpoint {missing}: no complete checkpoint there")


def test_matmul_scaling_compares_concurrent_with_sequential(tmp_path):
    run = run_job(tmp_path, "matmul_scaling", "scaling.workers=[2]", "params.sizes=[32,64]", "params.iters=3",
                  "params.warmup=1", "params.trials=2")
    assert_succeeded(run, "matmul_scaling", [2])
    (row,) = run.summary["concurrency"]
    assert (row["workers"], row["size"], row["iters"], row["trials"]) == (2, 64, 3, 2)
    assert row["devices"] == ["cpu", "cpu"] and row["threads_per_worker"] == 1  # threads_per_rank's default
    assert row["sequential_ms"] > 0 and row["concurrent_ms"] > 0
    assert_ranged(row, "sequential_ms")
    assert_ranged(row, "concurrent_ms")
    assert_flagged_honestly(row)
    # the ms are rounded to the microsecond (half of one either way); tiny sizes make that a few %
    seq, par, half_us = row["sequential_ms"], row["concurrent_ms"], 0.0005
    low, high = (seq - half_us) / (par + half_us), (seq + half_us) / (par - half_us)
    assert low - 1e-4 <= row["speedup"] <= high + 1e-4, row  # the speedup itself has 4 decimals
    assert row["speedup_min"] <= row["speedup"] <= row["speedup_max"]
    # the row's conclusion: its range and what linear would be, or, flagged (a busy machine), why it is not conclusive
    (said,) = [c for c in run.summary["conclusions"] if c.startswith("two tasks of 3 matmuls (n=64)")]
    assert ("(range " in said and "2x faster would be linear" in said) != ("not conclusive" in said) and ("not conclusive" in said) == bool(row["flags"]), said
    assert any("cores, not GPUs" in c for c in run.summary["conclusions"])
    r0, r1 = sorted(run.ranks(), key=lambda r: r["rank"])
    assert len(r0["metrics"]["times_ms"]["concurrent/sequential"]) == 2 and "concurrent/sequential" not in r1["metrics"]["times_ms"]
    assert len(r0["metrics"]["times_ms"]["concurrent/parallel"]) == 2 == len(r1["metrics"]["times_ms"]["concurrent/parallel"])
    for r in (r0, r1):
        assert len(r["metrics"]["times_ms"]["matmul/64"]) == 2  # one timing per trial
        assert r["metrics"]["steps"] == 12  # 3 iters x 2 trials x 2 sizes; the comparison adds no steps
        assert r["result"]["threads"] == 1 and r["result"]["threads_policy"] == "fair"
        assert r["result"]["machine_start"]["cores"] >= 1
    for scaling_row in run.summary["scaling"]:
        assert scaling_row["trials"] == 2
        assert_ranged(scaling_row, "gflops")
        assert_flagged_honestly(scaling_row)
    assert run.summary["like_for_like"] is True
    assert any(c.startswith("like for like: every rank ran 1 torch thread(s)") for c in run.summary["conclusions"])
    assert_plots(run, "scaling.png", "concurrency.png")


@pytest.mark.parametrize("job, plot", [("sync_logging", "sync_logging.png"), ("transfer", "transfer.png"),
                                       ("cpu_vs_gpu", "cpu_vs_gpu.png"), ("ddp_train", "ddp_train.png")])
def test_launch_report_rerenders_table_and_plots(job, plot, request):
    run = request.getfixturevalue(job)
    png = run.run_dir / plot
    png.unlink()
    done = launch("report", str(run.run_dir))
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = " ".join(done.stdout.split())
    assert run.summary["title"].split(":")[0] in out
    assert run.summary["conclusions"][0].split(":")[0] in out
