"""The d2l "GPUs" job suite on real GPUs (marked ``gpu``: skipped where nvidia-smi finds none).

Correctness and synchronisation assertions only, never timings: the .item() loop syncs once per
step and the launcher's recorder never does; every rank runs on its own cuda:<local_rank>.
"""

from __future__ import annotations

import pytest

from tests.jobs.conftest import assert_plots, run_job

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _assert_on_gpus(run, job: str, ranks_per_gpu: int = 1) -> None:
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert (run.result["job"], run.result["status"]) == (job, "succeeded")
    for r in run.result["ranks"]:
        assert r["status"] == "ok" and r["device"] == f"cuda:{r['local_rank'] // ranks_per_gpu}"


def test_recorder_never_syncs_and_item_always_does():
    import torch

    from launcher.runtime.metrics import MetricsRecorder

    dev = torch.device("cuda:0")
    rec = MetricsRecorder(dev)
    a = torch.randn(100, 100, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation now raises
    try:
        for _ in range(50):
            with rec.timer("step"):
                rec.log("norm", torch.linalg.norm(a @ a))
            rec.step()
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.linalg.norm(a).item()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    host = rec.to_host()
    assert len(host["values"]["norm"]) == 50 and len(host["times_ms"]["step"]) == 50 and host["steps"] == 50


def test_sync_counter_sees_one_sync_per_item():
    import torch

    from launcher.workloads.synccount import SyncCounter

    dev = torch.device("cuda:0")
    a = torch.randn(64, 64, device=dev)
    counter = SyncCounter(dev)
    with counter.counting("item"):
        for _ in range(20):
            torch.linalg.norm(a @ a).item()
    log = torch.empty(20, device=dev)
    with counter.counting("device"):
        for i in range(20):
            log[i] = torch.linalg.norm(a @ a)
    with counter.counting("end"):
        log.tolist()
    assert counter.device_syncs == {"item": 20, "device": 0, "end": 1}
    assert counter.host_reads == {"item": 20, "device": 0, "end": 1}


def test_sync_logging_job_counts_syncs_on_every_gpu(tmp_path):
    run = run_job(tmp_path, "sync_logging", "params.steps=200", "params.repeats=2")
    _assert_on_gpus(run, "sync_logging")
    s = run.summary
    assert s["device_syncs_measured"] is True and s["logs_agree"] is True
    v = s["variants"]
    assert v["item"]["syncs_loop"] == 200 and v["item"]["reads_loop"] == 200
    assert v["device"]["syncs_loop"] == 0 and v["device"]["at_end"] == 1
    assert v["recorder"]["syncs_loop"] == 0 and v["recorder"]["at_end"] == 1
    assert max(r["world_size"] for r in run.result["ranks"]) == _gpus()  # the largest world: every GPU
    assert_plots(run, "sync_logging.png")


def test_cpu_vs_gpu_measures_both_sides_on_every_gpu(tmp_path):
    run = run_job(tmp_path, "cpu_vs_gpu", "params.sizes=[16,256,1024]", "params.work_gflop=0.5")
    _assert_on_gpus(run, "cpu_vs_gpu")
    s = run.summary
    assert s["gpu_measured"] is True and len(s["gpus"]) == _gpus()
    for row in s["rows"]:
        assert row["cpu_us"] > 0 and row["gpu_us"] > 0 and row["speedup"] > 0
        assert len(row["gpu_us_by_rank"]) == _gpus()
        # medians of trials with their range: CUDA events for the GPU, one timing per trial
        assert row["gpu_us_min"] <= row["gpu_us"] <= row["gpu_us_max"] and row["speedup_min"] <= row["speedup"] <= row["speedup_max"]
    for r in run.result["ranks"]:
        assert all(len(r["metrics"]["times_ms"][f"gpu/{n}"]) == 5 for n in (16, 256, 1024))  # params.trials' default
    assert_plots(run, "cpu_vs_gpu.png")


def test_transfer_measures_pageable_and_pinned_and_keeps_identity(tmp_path):
    run = run_job(tmp_path, "transfer", "params.sizes_mb=[1,16]", "params.repeats=2")
    _assert_on_gpus(run, "transfer")
    s = run.summary
    kinds = {row["kind"] for row in s["rows"]}
    assert {"h2d/pageable", "h2d/pinned", "d2h/pageable", "d2h/pinned"} <= kinds
    assert set(s["pinned_vs_pageable"]) == {"h2d/1", "h2d/16", "d2h/1", "d2h/16"}
    assert s["identity_ok"] is True  # Z.cuda(local_rank) is Z
    assert all(r["result"]["pinned_is_pinned"] for r in run.result["ranks"])
    if _gpus() >= 2:
        assert {"d2d/peer", "pg/pingpong"} <= kinds and s["pg_backends"] == ["nccl"]
    assert_plots(run, "transfer.png")


def test_ddp_train_on_gpus_reads_the_checkpoint_onto_each_device(tmp_path):
    run = run_job(tmp_path, "ddp_train", "scaling.workers=[1]", "params.n_train=4096", "params.epochs=2")
    _assert_on_gpus(run, "ddp_train")
    for r in run.result["ranks"]:
        check = r["result"]["checkpoint_check"]
        assert check["map_location"] == r["device"] and check["all_on_device"] and check["equals_replica"]
    # the store's layout (launcher/runtime/checkpoint.py): <run>/world1/checkpoints/step-<9 digits>/,
    # the newest taken; resumed at world 2: on two GPUs (NCCL), or two ranks sharing one (gloo on CUDA)
    ckpt = run.run_dir / "world1" / "checkpoints"
    steps = 2 * 4096 // 256  # two epochs of the job's batch_size (256) at world 1
    assert (ckpt / f"step-{steps:09d}" / "manifest.json").is_file(), sorted(p.name for p in ckpt.iterdir())
    share = 1 if _gpus() >= 2 else 2
    resumed = run_job(tmp_path / "resumed", "ddp_train", "scaling.workers=[2]", f"resources.ranks_per_gpu={share}",
                      f"resources.gpus_per_node={2 // share}", "params.n_train=4096", "params.epochs=3", f"params.resume={ckpt}")
    _assert_on_gpus(resumed, "ddp_train", share)
    (row,) = resumed.summary["rows"]
    assert row["epochs"] == "2->3" and row["ckpt_ok"] is True  # saved from cuda:0, read onto each rank's GPU
    assert row["resumed_from"] == str(ckpt / f"step-{steps:09d}")
    for r in resumed.result["ranks"]:
        check = r["result"]["checkpoint_check"]
        assert check["map_location"] == r["device"] and check["all_on_device"] and check["equals_replica"]


def test_matmul_scaling_on_gpus_with_concurrency(tmp_path):
    workers = [1, 2] if _gpus() >= 2 else [1]
    run = run_job(tmp_path, "matmul_scaling", f"scaling.workers={workers}", "params.sizes=[256,1024]", "params.iters=20",
                  "params.trials=3")
    _assert_on_gpus(run, "matmul_scaling")
    for r in run.result["ranks"]:
        assert len(r["metrics"]["times_ms"]["matmul/1024"]) == 3  # one CUDA-event timing per trial
        assert r["result"]["threads_policy"] == "share"  # on a GPU the threads are left as the launcher set them
    for row in run.summary["scaling"]:
        assert row["trials"] == 3 and row["gflops_min"] <= row["gflops"] <= row["gflops_max"]
    assert run.summary["like_for_like"] is True  # each rank on a GPU of its own
    concurrency = run.summary["concurrency"]
    if _gpus() >= 2:
        (row,) = concurrency
        assert row["devices"] == ["cuda:0", "cuda:1"] and row["speedup"] > 0
        assert_plots(run, "scaling.png", "concurrency.png")
    else:
        assert concurrency == []
        assert_plots(run, "scaling.png")
