"""The selftest's table: figures against their limits, from recorded NVML answers (no GPU here).

Each test builds the ranks' reports as the selftest job writes them (figures, placement, the
node's NVML inventory read from a recording) and checks what ``summarize`` makes of them: the
limit each figure is set against, the fraction, "LOW" below the expected share, and the yes/no
checks (placement by UUID, GPU health, host syncs, the straggler flag).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from launcher.hardware.nvml import RecordedNvml, read_inventory
from launcher.workloads.selftest import LEVELS, Params
from launcher.workloads.selftest_report import summarize

NVML_DATA = Path(__file__).parent / "data" / "nvml"


def recording(name: str) -> dict[str, Any]:
    return json.loads((NVML_DATA / f"{name}.json").read_text())


def inventory(rec: dict[str, Any]) -> dict[str, Any]:
    inv = read_inventory(RecordedNvml(rec))
    assert inv is not None
    return inv.to_dict()


def figure(check: str, rank: int, value: float, unit: str, device: str, host: str = "node-a") -> dict[str, Any]:
    return {"check": check, "rank": rank, "host": host, "device": device, "value": value, "low": value, "high": value,
            "unit": unit, "detail": "recorded"}


def gpu_rank(rank: int, inv: dict[str, Any] | None, figures: list[dict[str, Any]], *, uuid: str | None = None,
             host: str = "node-a", visible: str | None = None, sync: dict[str, Any] | None = None) -> dict[str, Any]:
    device = f"cuda:{rank}"
    placement = {"device": device, "expected": device, "tensor_device": device, "visible": visible, "index": rank,
                 "uuid": uuid or inv["gpus"][rank]["uuid"], "name": inv["gpus"][rank]["name"]}
    result: dict[str, Any] = {
        "placement": placement, "host": host, "device": device, "figures": figures, "not_run": [],
        "sync_check": sync or {"steps": 50, "host_reads": 0, "device_sync": None, "baseline_sync": None, "values_kept": 50,
                               "clean": True, "cuda": True},
        "straggler": {"slow_rank": 1, "slow_ms": 20.0, "base_ms": 5.0, "steps": 160, "marks": "cuda events"},
    }
    if rank == 0:
        result["node"] = {"hostname": host, "cpus": 64, "ranks": 2, "versions": {}, "inventory": inv, "nvml": "read"}
    return {"rank": rank, "host": host, "status": "ok", "world_size": 2, "result": result}


def stage(ranks: list[dict[str, Any]], flagged: list[int] = (1,)) -> list[dict[str, Any]]:
    return [{"world_size": len(ranks), "status": "succeeded", "ranks": ranks,
             "stragglers": [{"rank": r, "host": "node-a"} for r in flagged]}]


def h100_ranks(inv: dict[str, Any], bf16: tuple[float, float] = (760.0, 770.0), h2d: float = 52.0) -> list[dict[str, Any]]:
    return [
        gpu_rank(r, inv, [figure("matmul_bf16", r, bf16[r], "TFLOP/s", f"cuda:{r}"), figure("h2d_pinned", r, h2d, "GB/s", f"cuda:{r}"),
                          figure("h2d_pageable", r, 20.0, "GB/s", f"cuda:{r}")]
                 + ([figure("peer_copy", 0, 380.0, "GB/s", "cuda:0->cuda:1"), figure("allreduce_node", 0, 360.0, "GB/s", "")] if r == 0 else []))
        for r in (0, 1)
    ]


def rows_by(summary: dict[str, Any], check: str) -> list[dict[str, Any]]:
    return [f for f in summary["figures"] if f["check"] == check]


def checks_by(summary: dict[str, Any], check: str) -> list[dict[str, Any]]:
    return [c for c in summary["checks"] if c["check"] == check]


def test_h100_figures_are_set_against_the_datasheet_pcie5_and_nvlink4():
    inv = inventory(recording("h100_sxm_8gpu"))
    s = summarize(stage(h100_ranks(inv)), {"level": "quick"})
    bf16 = rows_by(s, "matmul_bf16")
    assert [r["limit"] for r in bf16] == [989.4, 989.4] and bf16[0]["limit_source"] == "H100 SXM"
    assert bf16[0]["fraction"] == pytest.approx(760 / 989.4) and {r["verdict"] for r in bf16} == {"ok"}
    (pinned, _), (pageable, _) = rows_by(s, "h2d_pinned"), rows_by(s, "h2d_pageable")
    assert pinned["limit"] == pytest.approx(63.0, rel=0.01) and pinned["limit_source"] == "PCIe5 x16"
    assert pinned["verdict"] == "ok" and pageable["verdict"] == "-"  # pageable copies: shown, not judged
    (peer,) = rows_by(s, "peer_copy")
    (node,) = rows_by(s, "allreduce_node")
    assert peer["limit"] == node["limit"] == 450.0 and peer["limit_source"] == "NVLink4 x18"
    assert s["passed"] is True and "SELFTEST PASSED" in s["conclusions"][-1]
    table = s["rows"][0]
    assert s["columns"] == ["rank", "device", "check", "figure", "limit", "of_limit", "verdict"]  # one host: no host column
    assert table["figure"] == "760 TFLOP/s" and table["limit"] == "989 H100 SXM" and table["of_limit"] == "77%"


def test_a_slow_gpu_is_flagged_low_with_its_limit_in_words():
    inv = inventory(recording("h100_sxm_8gpu"))
    s = summarize(stage(h100_ranks(inv, bf16=(760.0, 410.0), h2d=20.0)), {"level": "quick"})
    low = {(f["check"], f["rank"]) for f in s["figures"] if f["verdict"] == "LOW"}
    assert low == {("matmul_bf16", 1), ("h2d_pinned", 0), ("h2d_pinned", 1)}
    assert s["passed"] is False
    said = "\n".join(s["conclusions"])
    assert "LOW: matmul bf16 on node-a cuda:1: 410 TFLOP/s is 41% of NVIDIA H100 datasheet (SXM5): 989 TFLOP/s" in said
    assert "SELFTEST FAILED" in said


def test_a_pcie_a100_pair_without_nvlink_is_judged_on_pcie():
    inv = inventory(recording("a100_pcie_2gpu"))
    ranks = [gpu_rank(r, inv, [figure("matmul_bf16", r, 280.0, "TFLOP/s", f"cuda:{r}")]
                      + ([figure("peer_copy", 0, 20.0, "GB/s", "cuda:0->cuda:1")] if r == 0 else [])) for r in (0, 1)]
    s = summarize(stage(ranks), {})
    (peer,) = rows_by(s, "peer_copy")
    gpu0 = inv["gpus"][0]
    assert peer["limit_source"] == f"PCIe{gpu0['pcie_max_gen']} x{gpu0['pcie_max_width']}"
    assert rows_by(s, "matmul_bf16")[0]["limit"] == 312.0


def test_a_rank_on_another_gpu_than_its_grant_fails_placement_and_names_the_fix():
    inv = inventory(recording("h100_sxm_8gpu"))
    ranks = h100_ranks(inv)
    ranks[1]["result"]["placement"]["uuid"] = inv["gpus"][3]["uuid"]  # torch's cuda:1 is NVML's GPU 3
    s = summarize(stage(ranks), {})
    bad = [c for c in checks_by(s, "placement") if not c["passed"]]
    assert len(bad) == 1 and inv["gpus"][3]["uuid"] in bad[0]["detail"] and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in bad[0]["detail"]
    assert s["passed"] is False


def test_the_grant_follows_cuda_visible_devices():
    inv = inventory(recording("h100_sxm_8gpu"))
    ranks = h100_ranks(inv)
    for r in ranks:  # the job's processes see GPUs 5 and 6 as cuda:0 and cuda:1
        r["result"]["placement"]["visible"] = "5,6"
        r["result"]["placement"]["uuid"] = inv["gpus"][5 + r["rank"]]["uuid"]
    s = summarize(stage(ranks), {})
    assert all(c["passed"] for c in checks_by(s, "placement"))
    assert "(NVML GPU 6)" in checks_by(s, "placement")[1]["detail"]


def test_two_ranks_on_one_gpu_fail_placement():
    inv = inventory(recording("h100_sxm_8gpu"))
    ranks = h100_ranks(inv)
    ranks[1]["result"]["placement"].update(visible="0,0", uuid=inv["gpus"][0]["uuid"])
    ranks[0]["result"]["placement"]["visible"] = "0,0"
    s = summarize(stage(ranks), {})
    assert any(not c["passed"] and "share 1 GPU" in c["detail"] for c in checks_by(s, "placement"))


@pytest.mark.parametrize(
    ("breakage", "words"),
    [
        (lambda d: d.__setitem__("nvmlDeviceGetTotalEccErrors", {"1,0": 3}), "uncorrectable ECC"),
        (lambda d: d.__setitem__("nvmlDeviceGetRetiredPagesPendingStatus", 1), "retired pages pending"),
        (lambda d: d.__setitem__("nvmlDeviceGetComputeMode", 2), "prohibited"),
    ],
)
def test_an_unhealthy_gpu_fails_the_health_check(breakage, words):
    rec = copy.deepcopy(recording("h100_sxm_8gpu"))
    breakage(rec["devices"][1])
    inv = inventory(rec)
    s = summarize(stage(h100_ranks(inv)), {})
    health = checks_by(s, "gpu_health")
    assert [c["passed"] for c in health] == [True, False]
    assert words in health[1]["detail"] and inv["gpus"][1]["uuid"] in health[1]["detail"]
    assert s["passed"] is False


def test_a_host_sync_from_the_recorder_fails_and_says_what_synced():
    inv = inventory(recording("h100_sxm_8gpu"))
    ranks = h100_ranks(inv)
    ranks[0]["result"]["sync_check"].update(clean=False, device_sync="called a synchronizing CUDA operation")
    s = summarize(stage(ranks), {})
    (bad,) = [c for c in checks_by(s, "recorder_syncs") if not c["passed"]]
    assert "a device sync: called a synchronizing CUDA operation" in bad["detail"]


@pytest.mark.parametrize(("flagged", "passed", "words"), [((1,), True, "flagged"), ((), False, "nothing flagged"), ((0, 1), False, "[0, 1]")])
def test_the_straggler_check_wants_the_slowed_rank_and_no_other(flagged, passed, words):
    inv = inventory(recording("h100_sxm_8gpu"))
    s = summarize(stage(h100_ranks(inv), flagged=list(flagged)), {})
    (check,) = checks_by(s, "straggler")
    assert check["passed"] is passed and words in check["detail"] and "cuda events" in check["detail"]


def test_without_nvml_figures_have_no_limit_and_the_table_drops_the_empty_columns():
    cpu = {"device": "cpu", "expected": "cpu", "tensor_device": "cpu", "visible": None}
    ranks = [{"rank": r, "host": "laptop", "status": "ok", "world_size": 2, "result": {
        "placement": dict(cpu), "figures": [figure("matmul_fp32", r, 0.15, "TFLOP/s", "cpu", host="laptop")],
        "not_run": [{"check": "host<->GPU copies vs PCIe", "host": "*", "why": "no GPU"}] if r == 0 else [],
        "sync_check": {"steps": 50, "host_reads": 0, "device_sync": None, "baseline_sync": None, "values_kept": 50, "clean": True, "cuda": False},
        "straggler": {"slow_rank": 1, "slow_ms": 20.0, "marks": "host clock"},
        **({"node": {"inventory": None, "nvml": "NVML did not start"}} if r == 0 else {})}} for r in (0, 1)]
    s = summarize(stage(ranks), {"level": "quick"})
    assert s["columns"] == ["rank", "device", "check", "figure"]
    assert s["rows"][0]["figure"] == "150 GFLOP/s"
    assert s["passed"] is True
    assert "not run (no GPU): host<->GPU copies vs PCIe" in s["conclusions"]


def test_every_level_is_a_valid_params_value_and_quick_is_the_smallest():
    assert set(LEVELS) == {"quick", "default", "full"}
    for name in LEVELS:
        assert Params.model_validate({"level": name}).level == name
    assert LEVELS["quick"].trials <= LEVELS["default"].trials <= LEVELS["full"].trials
    assert max(LEVELS["quick"].matmul_n) <= max(LEVELS["full"].matmul_n)


def test_a_healthy_h200_on_its_power_cap_passes_and_a_slow_one_does_not():
    """The figure of a real H200 SXM (one GPU, its NVML answers recorded by gpu_session.sh on
    2026-11-28): 677.8 TFLOP/s bf16, 69% of the datasheet's 989, every sample on the 700 W cap, a
    hand cuBLAS loop the same. That is a healthy part, not a LOW one; half of it is."""
    inv = inventory(recording("h200_sxm_1gpu"))
    assert inv["gpus"][0]["name"] == "NVIDIA H200"

    def judged(tflops: float) -> dict[str, Any]:
        rank = gpu_rank(0, inv, [figure("matmul_bf16", 0, tflops, "TFLOP/s", "cuda:0")])
        rank["world_size"] = 1
        return summarize(stage([rank], flagged=[]), {"level": "full"})

    healthy, slow = judged(677.8), judged(480.0)
    (row,) = rows_by(healthy, "matmul_bf16")
    assert row["limit"] == pytest.approx(989.4) and row["fraction"] == pytest.approx(677.8 / 989.4) and row["verdict"] == "ok"
    assert [r["verdict"] for r in rows_by(slow, "matmul_bf16")] == ["LOW"] and slow["passed"] is False
