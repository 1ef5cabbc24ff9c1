"""`launch selftest` on a real GPU node (marked ``gpu``: skipped where nvidia-smi finds none), and
with two ranks sharing one GPU (``ranks_per_gpu: 2``) so its all-reduce and straggler parts run on one.

The promises are asserted: every rank on its own GPU as granted (UUID), NVML's health read for
each, no host sync from the recorder under ``set_sync_debug_mode("error")``, every GPU figure
measured and set against a limit where the model is known, and with two GPUs or more the
straggler flagged on CUDA-event marks. How close the figures come to their limits is reported
(the table, selftest.json, BENCHMARKS.md), not asserted: speed is a benchmark's to show.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.gpu


def test_quick_selftest_on_this_gpu_node(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    gpus = torch.cuda.device_count()
    done = subprocess.run([sys.executable, "-m", "launcher", "selftest", "--quick", "--json", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["status"] == "succeeded", report["failure"]
    checks = {}
    for c in report["checks"]:
        checks.setdefault(c["check"], []).append(c)
    assert len(checks["placement"]) == gpus and all(c["passed"] for c in checks["placement"]), checks["placement"]
    assert len(checks["gpu_health"]) == gpus  # read for every GPU used (a sick GPU fails it: that is the point)
    assert all(c["passed"] for c in checks["recorder_syncs"]), checks["recorder_syncs"]
    figures = {(f["check"], f["rank"]): f for f in report["figures"]}
    for rank in range(gpus):
        for check in ("matmul_bf16", "matmul_fp32", "h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable"):
            assert figures[(check, rank)]["value"] > 0
        assert figures[("h2d_pinned", rank)]["limit"] is not None  # NVML's PCIe link
    if gpus >= 2:
        assert ("peer_copy", 0) in figures and ("allreduce_node", 0) in figures
        (straggler,) = checks["straggler"]
        assert straggler["passed"] and "cuda events" in straggler["detail"], straggler
    machine = next(iter(report["machine"].values()))
    assert len(machine["gpus"]) >= gpus and machine["versions"]["nccl"]


def test_quick_selftest_with_two_ranks_sharing_one_gpu(tmp_path):
    """The selftest's multi-rank parts on a one-GPU machine: two ranks on cuda:0
    (``ranks_per_gpu: 2``, gloo over CUDA tensors): both placed on the GPU they were given, the
    node all-reduce measured, the slowed rank flagged on CUDA-event marks."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    done = subprocess.run([sys.executable, "-m", "launcher", "selftest", "--quick", "--json", "--out", str(tmp_path),
                           "--set", "resources.gpus_per_node=1", "--set", "resources.ranks_per_gpu=2"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode in (0, 1), done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["status"] == "succeeded", report["failure"]
    checks: dict[str, list] = {}
    for c in report["checks"]:
        checks.setdefault(c["check"], []).append(c)
    # each rank on the GPU it was given, and both on the one GPU, as ranks_per_gpu=2 asks
    assert len(checks["placement"]) == 3 and all(c["passed"] for c in checks["placement"]), checks["placement"]
    assert "ranks 0, 1 share GPU-" in checks["placement"][-1]["detail"], checks["placement"]
    assert all(c["passed"] for c in checks["recorder_syncs"]), checks["recorder_syncs"]
    figures = {(f["check"], f["rank"]): f for f in report["figures"]}
    assert figures[("allreduce_node", 0)]["value"] > 0
    (straggler,) = checks["straggler"]
    assert straggler["passed"] and "cuda events" in straggler["detail"], straggler
