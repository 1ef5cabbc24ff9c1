"""Injected hangs on real GPUs under NCCL (marked ``gpu``: skipped where nvidia-smi finds none).

On one GPU: a single rank that stops counting is called hung, and its evidence holds its stacks
and NCCL's flight-recorder entries; the four injected hangs at world 2 with both ranks sharing the
GPU (``ranks_per_gpu: 2``, gloo over CUDA tensors). On two or more, under NCCL: each injected hang (a rank sleeping, skipping a
collective, frozen, deadlocked on a lock) names that rank and its line, although the others' host
threads may have queued many collectives past the one their GPUs wait in (the recorder's
completion states say which)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.integration.faultkit import child_env, result_of, wait_no_pids
from tests.integration.test_hangs import CASES, hang_spec, line_of

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _launch(spec: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", str(spec), "--out", str(out), "--no-metrics"], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_one_gpu_rank_that_stops_counting_is_hung_with_its_nccl_record(tmp_path):
    spec = hang_spec(tmp_path, "gpuhang1", params={"hang": "sleep", "rank": 0, "at": 20}, resources={"gpus_per_node": 1, "device": "cuda"})
    done = _launch(spec, tmp_path / "runs")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "gpuhang1").iterdir()
    result = result_of(run_dir)
    assert result["status"] == "hung"
    evidence = (Path(result["failure"]["hang"]["evidence_dir"]) / "stacks.txt").read_text()
    assert "time.sleep(FOREVER_S)" in evidence, evidence[:3000]
    left, _ = wait_no_pids(str(tmp_path / "runs"), 10)
    assert left == []


@pytest.mark.parametrize("hang", sorted(CASES))
def test_an_injected_hang_of_two_ranks_sharing_one_gpu_names_the_rank_and_line(tmp_path, hang):
    """Both ranks on cuda:0 (``ranks_per_gpu: 2``: gloo over CUDA tensors): the same four hangs,
    each named with its rank, line and device, on a one-GPU machine."""
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    why, marker = CASES[hang]
    spec = hang_spec(tmp_path, f"gpushared-{hang}", params={"hang": hang, "rank": 1, "at": 20},
                     resources={"device": "cuda", "gpus_per_node": 1, "ranks_per_gpu": 2})
    done = _launch(spec, tmp_path / "runs")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / f"gpushared-{hang}").iterdir()
    info = result_of(run_dir)["failure"]["hang"]
    culprits = {c["rank"]: c for c in info["culprits"]}
    # at world 2 a skipped collective has no majority to be told from: both ranks are named, each
    # with its own call (rank 0 in the all-reduce rank 1 skipped); every other hang names rank 1 alone
    assert sorted(culprits) == ([0, 1] if hang == "skip" else [1]), info
    culprit = culprits[1]
    assert culprit["line"] == line_of(marker) and culprit["device"] == "cuda:0", info
    assert why in culprit["why"] and Path(culprit["file"]).name == "hang_job.py", info  # as under gloo on the CPU
    if hang == "skip":
        assert culprits[0]["why"].startswith("is in all_reduce ") and "where rank 1 is in broadcast [1]" in culprits[0]["why"], info
    left, _ = wait_no_pids(str(tmp_path / "runs"), 10)
    assert left == []


@pytest.mark.parametrize("hang", sorted(CASES))
def test_an_injected_nccl_hang_names_the_rank_and_line(tmp_path, hang):
    """NCCL between GPUs is the point (its host threads run ahead of the GPU a collective waits
    in; the flight recorder's completion states say which): two GPUs or more."""
    if _gpus() < 2:
        pytest.skip("needs two GPUs (NCCL will not put two ranks on one)")
    why, marker = CASES[hang]
    last = _gpus() - 1
    spec = hang_spec(tmp_path, f"gpuhang-{hang}", params={"hang": hang, "rank": last, "at": 20}, resources={"device": "cuda"})
    done = _launch(spec, tmp_path / "runs")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / f"gpuhang-{hang}").iterdir()
    info = result_of(run_dir)["failure"]["hang"]
    culprits = {c["rank"]: c for c in info["culprits"]}
    # two GPUs and a skipped collective: no majority, both ranks named, each with its own call
    assert sorted(culprits) == ([0, 1] if hang == "skip" and last == 1 else [last]), info
    culprit = culprits[last]
    assert culprit["line"] == line_of(marker) and culprit["device"] == f"cuda:{last}", info
    left, _ = wait_no_pids(str(tmp_path / "runs"), 10)
    assert left == []
