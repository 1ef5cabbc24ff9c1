"""Bit for bit at three ranks (torchrun, gloo on the CPU): a rank of ddp_train SIGKILLed after a
checkpoint, the group restarted from it, ends with the model of a run never interrupted.

At two ranks any layout sums alike (a + b == b + a); at three, gloo's all-reduce adds each element
in an order set by its place in DDP's gradient bucket. DDP rebuilds its buckets after its first
step, so without ``ctx.checkpoint.fix_buckets`` the resumed run's first step (DDP's first again)
is reduced in the other layout and the models differ in the last bits."""

from __future__ import annotations

import pytest

from tests.jobs.conftest import TINY_TRAIN, JobRun, assert_succeeded, run_job

WORLD3 = ["entrypoint=tests.jobs.killed_train:run", "params.epochs=2", "scaling.workers=[3]", "resources.cpu_workers=3", "params.in_place=false", *TINY_TRAIN]
# 3 steps an epoch at 3 ranks: checkpoints at steps 3 and 6


def shas(run: JobRun) -> set[str]:
    return {r["result"]["model_sha256"] for r in run.ranks()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> JobRun:
    out = tmp_path_factory.mktemp("world3")
    run = run_job(out, "ddp_train", *WORLD3, "params.kill_at=-1", f"params.marker={out / 'unused'}")
    assert_succeeded(run, "ddp_train", [3])
    assert len(shas(run)) == 1 and run.result["restarts"] == 0
    return run


def test_three_ranks_resumed_after_a_lost_rank_end_with_the_uninterrupted_model_bit_for_bit(tmp_path, uninterrupted) -> None:
    run = run_job(tmp_path, "ddp_train", *WORLD3, "params.kill_rank=1", "params.kill_at=4", f"params.marker={tmp_path / 'killed'}")
    assert_succeeded(run, "ddp_train", [3])
    first, second = run.result["stages"][0]["attempts"]
    assert (first["failure_class"], first["checkpoint_step"], second["resumed_step"]) == ("rank_lost", 3, 3), run.result["stages"][0]
    assert all(r["result"]["start_step"] == 3 and r["result"]["steps"] == 6 for r in run.ranks())
    assert shas(run) == shas(uninterrupted)  # every bit: the resumed first step reduced in the uninterrupted run's layout
