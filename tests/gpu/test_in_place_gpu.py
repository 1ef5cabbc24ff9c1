"""Recovery in place on a real GPU (marked ``gpu``: skipped where nvidia-smi finds none), with two
ranks sharing it (``ranks_per_gpu: 2``: gloo over CUDA tensors, the path a one-GPU machine has).

A rank SIGKILLed mid-run is replaced while its peer keeps its process, its CUDA context and its
model on the GPU: the state goes from the survivor's GPU through pinned host memory to the
replacement's GPU (``launcher/runtime/peerstate.py``), no restart of the group, and the final
model equals an uninterrupted run's, bit for bit (the same kernels on the same GPU, the data order
the step's), its checkpoints saved behind the steps from pinned host copies (``async_save``). The
shipped ``ddp_train`` (``params.in_place: true``) takes the same path. Each test
prints its recovery's figures (``pytest -rP`` shows them): what a GPU session records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.faultkit import Launched, describe, pythonpath, result_of, wait_no_pids
from tests.jobs.conftest import TINY_TRAIN, run_job

pytestmark = pytest.mark.gpu

SHARED_GPU = {"device": "cuda", "gpus_per_node": 1, "ranks_per_gpu": 2}
HANG_GUARD_S = 240


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _figures(recovery: dict[str, Any]) -> str:
    keys = ("path", "dead_ranks", "resumed_step", "steps_lost", "detection_s", "recovery_s", "state_s", "state_bytes")
    return "recovery in place on the GPU: " + json.dumps({k: recovery.get(k) for k in keys})


def _run_in_place_job(tmp_path: Path, name: str, **params: Any) -> dict[str, Any]:
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({
        "name": name, "entrypoint": "tests.integration.in_place_job:run", "resources": SHARED_GPU, "max_restarts": 1,
        "params": {"steps": 30, "checkpoint_every": 10, "marker": str(tmp_path / f"{name}.killed"), **params},
        "timeouts": {"rendezvous_s": 120, "run_s": HANG_GUARD_S}, "env": {"PYTHONPATH": pythonpath()},
        "checkpoint": {"async_save": True},  # each save's copy of the GPU state to pinned host memory, written behind the steps
    }, sort_keys=False))  # fmt: skip
    out = tmp_path / f"{name}-runs"
    run = Launched(spec, out, "--no-metrics")
    try:
        code = run.wait(HANG_GUARD_S + 60)
        result = result_of(run.run_dir())
        assert code == 0, run.output()[-4000:]
        left, _ = wait_no_pids(str(out), 30)
        assert left == [], f"processes of the run remain:\n{describe(left)}"
        return result
    finally:
        run.close()


def test_a_rank_sharing_the_gpu_is_replaced_in_place_bit_for_bit(tmp_path: Path) -> None:
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    clean = _run_in_place_job(tmp_path, "clean")
    killed = _run_in_place_job(tmp_path, "killed", kill_at=17, victim=1)
    assert (tmp_path / "killed.killed").exists()  # the fault happened
    stage = killed["stages"][0]
    assert stage["status"] == "succeeded" and stage["restarts"] == 0 and len(stage["attempts"]) == 1, stage
    (recovery,) = stage["recoveries"]
    print(_figures(recovery))
    assert recovery["path"] == "in_place" and recovery["dead_ranks"] == [1] and recovery["steps_lost"] == 0, recovery
    assert recovery["resumed_step"] == 17 and recovery["state_bytes"] > 0, recovery
    ranks = {r["rank"]: r for r in killed["ranks"]}
    assert all(r["device"] == "cuda:0" for r in ranks.values()), ranks
    assert ranks[1]["result"]["first_step"] == 17 and ranks[1]["result"]["gen"] == 1 and ranks[0]["result"]["first_step"] == 0
    hashes = lambda result: {r["result"]["model_sha256"] for r in result["ranks"]}  # noqa: E731
    assert len(hashes(killed)) == 1 and hashes(killed) == hashes(clean)  # bit for bit, both ranks


def test_the_shipped_ddp_train_recovers_in_place_on_a_shared_gpu(tmp_path: Path) -> None:
    """``jobs/ddp_train.yaml`` as shipped (``params.in_place: true``), a rank killed at step 10:
    one attempt, the loss curve of an uninterrupted run."""
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    common = ["entrypoint=tests.jobs.killed_train:run", "params.epochs=4", "scaling.workers=[2]", "resources.device=cuda", *TINY_TRAIN,
              "resources.ranks_per_gpu=2", "resources.gpus_per_node=1"]
    base = run_job(tmp_path / "a", "ddp_train", *common, "params.kill_at=-1", f"params.marker={tmp_path / 'unused'}")
    assert base.returncode == 0, base.stderr[-3000:]
    run = run_job(tmp_path / "b", "ddp_train", *common, "params.kill_rank=1", "params.kill_at=10", f"params.marker={tmp_path / 'killed'}")
    assert run.returncode == 0, run.stderr[-3000:]
    stage = run.result["stages"][0]
    (recovery,) = stage["recoveries"]
    print(_figures(recovery))
    assert len(stage["attempts"]) == 1 and recovery["path"] == "in_place" and recovery["dead_ranks"] == [1], stage
    assert recovery["steps_lost"] <= 1, recovery
    assert run.summary["rows"][0]["train_loss"] == base.summary["rows"][0]["train_loss"]  # the same model, the same loss
