"""Checkpoints and resume on real GPUs (marked ``gpu``: skipped where nvidia-smi finds none).

ddp_train at world 2, on two GPUs (NCCL) or with two ranks sharing one GPU (``ranks_per_gpu: 2``:
gloo over CUDA tensors): a rank SIGKILLed mid-run restarts from the last checkpoint and ends with
the same model as an uninterrupted run (within 1e-6: GPU kernels need not be bitwise
deterministic), its checkpoint read back on every rank onto its own cuda:<local_rank // k>;
a checkpoint saved on one GPU loads onto another and onto the CPU (map_location); and a stop
notice is agreed by the group over the gloo side group while NCCL trains."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.jobs.conftest import TINY_TRAIN, run_job

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


# world 2 on one GPU (two ranks share it: gloo over CUDA tensors, since NCCL refuses two ranks on
# one GPU), and on two GPUs (NCCL, each rank reading the checkpoint onto its own GPU)
@pytest.mark.parametrize("ranks_per_gpu", [2, 1], ids=["two-ranks-share-one-gpu", "two-gpus-nccl"])
def test_a_killed_gpu_rank_resumes_from_its_checkpoint(tmp_path: Path, ranks_per_gpu: int) -> None:
    if _gpus() < 2 // ranks_per_gpu:
        pytest.skip("needs two GPUs")
    # params.in_place=false: the restart path (ranks sharing a GPU now recover in place: test_in_place_gpu.py)
    common = ["entrypoint=tests.jobs.killed_train:run", "params.epochs=6", "scaling.workers=[2]", "resources.device=cuda", "params.in_place=false", *TINY_TRAIN,
              f"resources.ranks_per_gpu={ranks_per_gpu}", f"resources.gpus_per_node={2 // ranks_per_gpu}"]
    base = run_job(tmp_path / "a", "ddp_train", *common, "params.kill_at=-1", f"params.marker={tmp_path / 'unused'}")
    assert base.returncode == 0, base.stderr[-3000:]
    run = run_job(tmp_path / "b", "ddp_train", *common, "params.kill_rank=1", "params.kill_at=10", f"params.marker={tmp_path / 'killed'}")
    assert run.returncode == 0, run.stderr[-3000:]
    first, second = run.result["stages"][0]["attempts"]
    assert first["failure_class"] == "rank_lost" and second["resumed_step"] == 8
    for r in run.ranks():
        check = r["result"]["checkpoint_check"]
        assert check["map_location"] == f"cuda:{r['local_rank'] // ranks_per_gpu}" and check["all_on_device"] and check["equals_replica"]
    # the final models agree (GPU kernels: within a tolerance, see the loss curves)
    assert abs(run.summary["rows"][0]["train_loss"] - base.summary["rows"][0]["train_loss"]) < 1e-6


def test_a_checkpoint_saved_on_one_gpu_loads_on_another_and_on_the_cpu(tmp_path: Path) -> None:
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    script = tmp_path / "check.py"
    script.write_text(f"""
import torch
from launcher.checkpoint_store import job_identity
from launcher.protocol import WorkerConfig
from launcher.runtime.checkpoint import Checkpoints
cfg = WorkerConfig(job="j", stage_dir="{tmp_path}/w", device_type="cuda", pg_backend="nccl", threads_per_worker=1, entrypoint="m:f",
                   prepare=None, script=None, args=(), params={{}}, rendezvous_timeout_s=10, checkpoint_dir="{tmp_path}/ck", job_identity=job_identity("j", "m:f"),
                   collective_timeout_s=None, run_id="r1", time_ddp=True, checkpoint_keep=2, checkpoint_async_save=False, warm_spares=0, attempt=0, stop_grace_s=60.0, gpu_health=False,
                   ranks_per_gpu=1)
last = torch.device(f"cuda:{{torch.cuda.device_count() - 1}}")
Checkpoints(cfg, rank=0, world_size=1, local_rank=0, device=torch.device("cuda:0")).save({{"w": torch.ones(3, device="cuda:0")}}, step=1)
on_gpu = Checkpoints(cfg, rank=0, world_size=1, local_rank=0, device=last).load()
on_cpu = Checkpoints(cfg, rank=0, world_size=1, local_rank=0, device=torch.device("cpu")).load()
assert on_gpu.state["w"].device == last and on_cpu.state["w"].device.type == "cpu", (on_gpu.state["w"].device, on_cpu.state["w"].device)
print("ok")
""")
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
