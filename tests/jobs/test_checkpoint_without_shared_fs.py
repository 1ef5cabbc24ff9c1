"""ddp_train without a shared filesystem: the checkpoint directory exists, with its files, on rank
0's "host" only (tests/jobs/private_fs.py gives every other rank an empty private mount there).
Rank 0's checkpoint must still reach every rank, and a resume from a file only rank 0 can read must
continue on every rank from the same parameters, optimizer state and epoch: ctx.checkpoint sends
the verified bytes from the rank that has them to every rank that does not see them."""

from __future__ import annotations

import hashlib

import pytest

from tests.jobs.conftest import assert_succeeded, run_job
from tests.jobs.private_fs import mount_works
from tests.jobs.test_gpu_chapter_jobs import TINY_TRAIN
from tests.integration.faultkit import pythonpath

pytestmark = pytest.mark.skipif(not mount_works(), reason="needs mount namespaces (root) to give a rank its own filesystem view")

PRIVATE = "entrypoint=tests.jobs.private_fs:run"


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_checkpoint_and_resume_reach_ranks_that_cannot_see_rank0s_files(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", pythonpath())
    shared_nothing = tmp_path / "rank0-host"
    shared_nothing.mkdir()
    first_dir, second_dir = shared_nothing / "a", shared_nothing / "b"

    run = run_job(tmp_path / "a", "ddp_train", PRIVATE, "scaling.workers=[2]", *TINY_TRAIN, "params.epochs=2",
                  f"checkpoint.dir={first_dir}", f"params.private_dir={shared_nothing}")  # fmt: skip
    assert_succeeded(run, "ddp_train", [2])
    first = first_dir / "world2" / "step-000000008"  # 4 steps an epoch
    r0, r1 = sorted(run.ranks(), key=lambda r: r["rank"])
    # the launcher made the checkpoint directory on rank 0's "host" (it checked it can be written there)
    assert r0["result"]["private_dir_listing"] == ["a"] and r1["result"]["private_dir_listing"] == []
    for r in (r0, r1):
        check = r["result"]["checkpoint_check"]
        # the bytes of rank 0's file (its manifest's digest), verified, on a rank that cannot open it
        assert check["sha256"] == _sha(first / "state.pt"), r["rank"]
        assert check["equals_replica"] and check["all_on_device"] and check["epoch"] == 2 and check["step"] == 8
        assert r["result"]["checkpoint"] == str(first)
    assert run.summary["checkpoints_ok"] is True

    resumed = run_job(tmp_path / "b", "ddp_train", PRIVATE, "scaling.workers=[2]", *TINY_TRAIN, "params.epochs=3",
                      f"params.resume={first}", f"checkpoint.dir={second_dir}", f"params.private_dir={shared_nothing}")  # fmt: skip
    assert_succeeded(resumed, "ddp_train", [2])
    r0, r1 = sorted(resumed.ranks(), key=lambda r: r["rank"])
    assert r0["result"]["private_dir_listing"] == ["a", "b"]  # rank 0's host has it ...
    assert r1["result"]["private_dir_listing"] == []  # ... rank 1's does not
    for r in (r0, r1):
        assert r["result"]["resumed_from"] == str(first)
        assert r["result"]["start_epoch"] == 2 and r["result"]["epochs_run"] == 1
        check = r["result"]["checkpoint_check"]
        # rank 1's replica equals rank 0's after an epoch of AdamW: it resumed from the same
        # parameters *and* optimizer moments (DDP only broadcasts parameters, at construction)
        assert check["sha256"] == _sha(second_dir / "world2" / "step-000000012" / "state.pt") and check["equals_replica"] and check["epoch"] == 3
    (row,) = resumed.summary["rows"]
    assert row["epochs"] == "2->3" and row["ckpt_ok"] is True
    # training went on rather than restarting from scratch
    assert resumed.summary["curves"]["2"]["train_loss"][0] < run.summary["curves"]["2"]["train_loss"][0]
