"""Ratios below 1 read as "3.3x slower", never "0.3x faster": the helper and every job's summary line."""

from __future__ import annotations

import pytest

from launcher.workloads import cpu_vs_gpu, matmul, sync_logging, transfer
from launcher.workloads.stats import times, times_range


@pytest.mark.parametrize(
    ("ratio", "words"),
    [(3.3, "3.3x faster"), (1 / 3.3, "3.3x slower"), (1.0, "1.0x faster"), (None, "?"), (0.0, "?"), (float("nan"), "?")],
)
def test_times_turns_a_ratio_below_one_into_its_inverse_with_the_other_word(ratio, words):
    assert times(ratio) == words


def test_times_takes_the_words_of_a_ratio_of_times():
    assert times(3.2, more="slower", less="faster", digits=2) == "3.20x slower"
    assert times(0.8, more="slower", less="faster", digits=2) == "1.25x faster"


@pytest.mark.parametrize(
    ("lo", "hi", "words"),
    [(1.2, 1.6, "1.2-1.6x faster"), (0.2, 0.4, "2.5-5.0x slower"), (0.5, 1.3, "2.0x slower to 1.3x faster"), (None, 1.0, "?")],
)
def test_times_range_keeps_one_word_where_it_can(lo, hi, words):
    assert times_range(lo, hi) == words


def _rank(rank: int, times_ms: dict, result: dict, device: str = "cuda:0", host: str = "h") -> dict:
    return {"rank": rank, "host": host, "device": device, "status": "ok", "world_size": 1,
            "metrics": {"times_ms": times_ms, "values": {}}, "result": result}


def test_cpu_vs_gpu_says_the_gpu_is_slower_at_a_small_size():
    p = cpu_vs_gpu.Params(sizes=(16,), trials=3)
    iters = cpu_vs_gpu.iters_for(16, p)
    # CPU 1 us per matmul, GPU 3.3 us: the GPU is 3.3x slower
    times_ms = {"cpu/16": [iters * 1e-3] * 3, "gpu/16": [iters * 3.3e-3] * 3}
    stage = {"status": "succeeded", "world_size": 1,
             "ranks": [_rank(0, times_ms, {"cpu_measured": True, "gpu_measured": True, "cpu_threads": 2, "gpu_name": "H100"})]}
    said = "\n".join(cpu_vs_gpu.summarize([stage], p.model_dump())["conclusions"])
    assert "at n=16 the GPU is 3.3x slower than the CPU (range 3.3-3.3x slower" in said
    assert "faster" not in said.split("the GPU is", 1)[1].split("\n")[0]
    assert "no faster (3.3x slower than the CPU)" in said


def test_matmul_concurrency_below_one_is_slower_and_ranks_on_one_gpu_measure_sharing():
    p = matmul.Params(sizes=(64,), iters=2, trials=3)
    seq, par = [10.0, 10.0, 10.0], [12.5, 12.5, 12.5]  # at once slower than in turn: 1.25x slower
    ranks = [_rank(r, {"concurrent/sequential": seq if r == 0 else [], "concurrent/parallel": par}, {}, device="cuda:0")
             for r in (0, 1)]
    stage = {"status": "succeeded", "world_size": 2, "ranks": ranks}
    rows = matmul._concurrency_rows([stage], p)
    said = "\n".join(matmul._conclusions([{"workers": 2, "size": 64, "efficiency": None, "flags": []}], p, 1, "cuda", "fair", True,
                                         None, False, rows))
    assert "at once 1.25x slower than one after the other (range 1.25-1.25x slower)" in said
    assert "measures sharing a GPU, not scaling" in said and "0.80x" not in said


def test_sync_logging_says_item_is_slower_than_the_device_log():
    row = {"variant": ".item()/step", "wall_ms": 30.0, "trials": 3, "flags": [], "ratio": 3.0, "ratio_min": 2.5, "ratio_max": 3.5,
           "syncs_loop": None, "reads_loop": 100, "at_end": 0}
    dev = {**row, "variant": "device log", "wall_ms": 10.0, "ratio": 1.0}
    said = sync_logging._conclusions([row, dev, dict(dev)], False, [{"logs_agree": True}], 100)[0]
    assert said.endswith(".item() every step is 3.00x slower than the on-device log (range 2.50-3.50x slower)")


def test_transfer_says_pinned_is_faster_or_slower_than_pageable():
    rows = [{"kind": k, "copy": k, "mib": 16, "gb_s": g, "flags": [], "note": None}
            for k, g in (("h2d/pinned", 20.0), ("h2d/pageable", 10.0), ("d2h/pinned", 5.0), ("d2h/pageable", 10.0))]
    said = "\n".join(transfer._conclusions(rows, True, True, [], ["nccl"]))
    assert "(pinned 2.00x faster)" in said and "(pinned 2.00x slower)" in said
