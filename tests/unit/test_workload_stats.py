"""The job suite's statistics and flags, on synthetic stages (no ranks are started): medians and
ranges of trials, "noisy" and "super-linear" flags in result.json and the table, conclusions that
never state a flagged figure as a result, and plots that clip nothing and draw no missing value."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from launcher.workloads import cpu_vs_gpu, measure, matmul, sync_logging, train, transfer
from launcher.workloads.stats import NOISY_SPREAD, flags_for, span, stat

N, ITERS = 100, 10
FLOP = 2 * N**3 * ITERS  # one trial of ITERS matmuls of N x N


def gflops(ms: float) -> float:
    return FLOP / (ms / 1e3) / 1e9


def rank(r: int, ws: int, metrics: dict[str, Any], result: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"rank": r, "local_rank": r, "world_size": ws, "host": "h", "device": "cpu", "status": "ok",
            "metrics": {"steps": 0, "values": {}, "times_ms": {}, **metrics}, "result": result or {}}


def matmul_stage(ws: int, trials_ms: list[list[float]], threads: int = 1, load: dict | None = None) -> dict[str, Any]:
    """A succeeded matmul stage: ``trials_ms[r]`` are rank r's trial times for size N."""
    result = {"threads": threads, "threads_policy": "fair", "machine_start": {"cores": 2, "load_avg": [0.1, 0.1, 0.1]},
              "machine_end": {"cores": 2, "load_avg": [0.2, 0.1, 0.1]}}
    stage = {"world_size": ws, "status": "succeeded",
             "ranks": [rank(r, ws, {"times_ms": {f"matmul/{N}": t}}, result) for r, t in enumerate(trials_ms)]}
    if load is not None:
        stage["load_avg"] = load
    return stage


PARAMS = {"sizes": [N], "iters": ITERS, "trials": 5}


# --- the statistics -------------------------------------------------------------------------------


def test_stat_gives_median_range_and_quartiles():
    s = stat([5.0, 1.0, 3.0, 2.0, 4.0, None, math.nan])
    assert (s.median, s.min, s.max, s.n) == (3.0, 1.0, 5.0, 5)
    assert (s.q1, s.q3) == (2.0, 4.0)
    assert s.spread == pytest.approx(2 / 3)  # interquartile range / median
    assert s.range_spread == pytest.approx(4 / 3)  # every trial
    assert stat([]) is None and stat([None]) is None
    one = stat([7.0])
    assert (one.median, one.min, one.max, one.spread) == (7.0, 7.0, 7.0, 0.0)


def test_a_rate_from_times_swaps_min_and_max():
    times = stat([10.0, 20.0, 40.0])
    rate = times.inverse(100.0)
    assert (rate.median, rate.min, rate.max) == (5.0, 2.5, 10.0)


def test_one_outlier_trial_does_not_make_a_figure_noisy_but_a_wide_middle_does():
    steady = stat([100, 101, 99, 100, 60])  # one trial hit by another job: the median holds
    assert steady.spread < NOISY_SPREAD and flags_for(steady.spread) == ([], None)
    wide = stat([100, 140, 70, 120, 80])
    flags, note = flags_for(wide.spread)
    assert flags == ["noisy"] and note == f"noisy: spread {wide.spread:.0%}"


def test_flags_for_single_trial_and_super_linear():
    assert flags_for(0.0, trials=1) == (["single-trial"], "1 trial: spread unknown")
    assert flags_for(0.01, 1.3) == (["super-linear"], "super-linear: check the load")
    assert flags_for(0.01, 1.05) == ([], None)  # 1.05 itself is allowed
    assert flags_for(0.01, busy="busy: load 3.00 on 2 cores") == (["busy"], "busy: load 3.00 on 2 cores")
    flags, note = flags_for(0.5, 1.3)
    assert flags == ["noisy", "super-linear"] and note == "noisy: spread 50%; super-linear: check the load"


def test_a_range_is_one_table_cell():
    assert span(88.14, 109.2) == "88.1\u2013109"
    assert span(7512.0, 9950.0) == "7,512\u20139,950"  # never 7.51e+03
    assert span(None, 3.0) is None
    assert " " not in span(0.000123, 123456.0)


# --- matmul_scaling --------------------------------------------------------------------------------


def test_matmul_reports_the_median_of_trials_with_its_range():
    one = matmul_stage(1, [[10.0, 10.2, 9.9, 10.1, 10.0]])
    two = matmul_stage(2, [[10.5, 10.4, 10.6, 10.5, 10.5], [10.4, 10.6, 10.5, 10.5, 10.6]])
    s = matmul.summarize([one, two], PARAMS)
    rows = {r["workers"]: r for r in s["rows"]}
    assert rows[1]["gflops"] == pytest.approx(gflops(10.0), rel=1e-3)
    assert rows[1]["gflops_min"] == pytest.approx(gflops(10.2), rel=1e-3)
    assert rows[1]["gflops_max"] == pytest.approx(gflops(9.9), rel=1e-3)
    assert rows[1]["trials"] == 5 and rows[1]["efficiency"] == 1.0 and rows[1]["flags"] == []
    # world size 2: each trial's total is both ranks' work over the slower rank's time
    per_trial = [2 * gflops(max(a, b)) for a, b in zip(*[r["metrics"]["times_ms"][f"matmul/{N}"] for r in two["ranks"]])]
    assert rows[2]["gflops"] == pytest.approx(sorted(per_trial)[2], rel=1e-3)
    assert rows[2]["efficiency"] == pytest.approx(rows[2]["gflops"] / (2 * rows[1]["gflops"]), rel=1e-3)
    assert rows[2]["efficiency_min"] <= rows[2]["efficiency"] <= rows[2]["efficiency_max"]
    assert rows[2]["flags"] == [] and rows[2]["note"] is None
    assert len(rows[2]["gflops_by_rank"]) == 2
    assert s["like_for_like"] is True
    (claim,) = [c for c in s["conclusions"] if "scaling efficiency" in c]
    assert claim.startswith("2 workers reach 94% scaling efficiency")  # 10.0 ms vs the slower rank's 10.6
    assert any(c.startswith("like for like: every rank ran 1 torch thread(s) at every world size") for c in s["conclusions"])
    for column in s["columns"]:
        assert column in rows[2]


def test_a_wide_spread_is_flagged_in_the_row_and_the_table_and_not_stated_as_fact():
    one = matmul_stage(1, [[10.0, 10.1, 9.9, 10.0, 10.0]])
    two = matmul_stage(2, [[10.0, 16.0, 10.5, 25.0, 13.0], [10.0, 15.0, 10.2, 24.0, 12.0]])
    s = matmul.summarize([one, two], PARAMS)
    row = next(r for r in s["rows"] if r["workers"] == 2)
    assert "noisy" in row["flags"] and row["spread"] > NOISY_SPREAD
    assert re.fullmatch(r"noisy: spread \d+%", row["note"])
    assert "note" in s["columns"]  # the table shows it
    claims = [c for c in s["conclusions"] if "scaling efficiency" in c]
    assert claims and all("cannot be trusted: the 2-worker run varied widely from trial to trial" in c and "reach" not in c for c in claims)
    assert any(c.startswith("flagged rows (2x n=100)") for c in s["conclusions"])


def test_a_super_linear_efficiency_is_flagged_and_never_claimed():
    one = matmul_stage(1, [[13.0, 13.0, 13.1, 12.9, 13.0]])
    two = matmul_stage(2, [[10.0, 10.0, 10.1, 9.9, 10.0], [10.0, 10.0, 10.0, 10.0, 10.1]])  # 1.3x "per worker"
    s = matmul.summarize([one, two], PARAMS)
    row = next(r for r in s["rows"] if r["workers"] == 2)
    assert row["efficiency"] == pytest.approx(1.3, rel=0.01)
    assert row["flags"] == ["super-linear"] and row["note"] == "super-linear: check the load"
    for sentence in s["conclusions"]:
        assert "reach" not in sentence
        if "130%" in sentence:
            assert "cannot be trusted" in sentence and "reads above linear scaling" in sentence


def test_unequal_threads_per_rank_are_said_and_no_efficiency_is_claimed():
    one = matmul_stage(1, [[10.0] * 5], threads=2)  # the launcher's share: 2 threads for one worker ...
    two = matmul_stage(2, [[20.0] * 5, [20.0] * 5], threads=1)  # ... one each for two
    s = matmul.summarize([one, two], PARAMS)
    assert s["like_for_like"] is False and s["threads_per_rank"] == {"1": 2, "2": 1}
    assert any(c.startswith("NOT like for like: threads per rank differ by world size") for c in s["conclusions"])
    assert all("reach" not in c for c in s["conclusions"])


def test_the_run_loops_load_average_is_reported_and_a_busy_machine_said():
    busy = {"start": [3.2, 2.0, 1.0], "end": [4.5, 2.5, 1.2]}
    s = matmul.summarize([matmul_stage(1, [[10.0] * 5], load=busy)], PARAMS)
    (line,) = [c for c in s["conclusions"] if c.startswith("load average")]
    assert "1 worker(s) 3.20->4.50" in line and "the machine was busy" in line
    assert s["rows"][0]["flags"] == ["busy"] and s["rows"][0]["note"] == "busy: load 4.50 on 2 cores"
    quiet = matmul.summarize([matmul_stage(1, [[10.0] * 5])], PARAMS)  # no load_avg: the ranks' own readings
    (line,) = [c for c in quiet["conclusions"] if c.startswith("load average")]
    assert "1 worker(s) 0.10->0.20" in line and "busy" not in line


def test_the_jobs_own_ranks_do_not_make_the_machine_busy():
    # two 1-thread ranks on 2 cores raise the load to ~2 by themselves: that is the job, not other work
    own = matmul_stage(2, [[10.0] * 5, [10.0] * 5], load={"start": [0.5, 0.2, 0.1], "end": [1.9, 0.6, 0.2]})
    s = matmul.summarize([matmul_stage(1, [[10.0] * 5]), own], PARAMS)
    (line,) = [c for c in s["conclusions"] if c.startswith("load average")]
    assert "2 worker(s) 0.50->1.90" in line and "busy" not in line
    others = matmul_stage(2, [[10.0] * 5, [10.0] * 5], load={"start": [2.5, 1.0, 0.5], "end": [4.0, 2.0, 1.0]})
    s = matmul.summarize([matmul_stage(1, [[10.0] * 5]), others], PARAMS)
    assert any("the machine was busy" in c for c in s["conclusions"])
    # steady trials, but measured while other work held the cores: flagged, and no efficiency claimed
    row = next(r for r in s["rows"] if r["workers"] == 2)
    assert row["flags"] == ["busy"] and row["note"] == "busy: load 4.00 on 2 cores"
    assert all("reach" not in c for c in s["conclusions"])
    assert any("cannot be trusted: the 2-worker run ran on a busy machine" in c for c in s["conclusions"])


def test_a_single_trial_is_flagged():
    s = matmul.summarize([matmul_stage(1, [[10.0]])], {**PARAMS, "trials": 1})
    assert s["rows"][0]["flags"] == ["single-trial"]


def test_matmul_params_take_trials_budget_and_threads():
    p = matmul.Params.model_validate({"trials": 3, "min_time_s": 0.5, "threads_per_rank": "share"})
    assert (p.trials, p.min_time_s, p.threads_per_rank) == (3, 0.5, "share")
    assert matmul.Params().threads_per_rank is None and matmul.Params.model_validate({"threads_per_rank": 4}).threads_per_rank == 4
    for bad in ({"trials": 0}, {"min_time_s": -1}, {"threads_per_rank": 0}, {"threads_per_rank": "all"}):
        with pytest.raises(ValidationError):
            matmul.Params.model_validate(bad)


def _capture_figures(monkeypatch, module) -> list[Any]:
    figures = []

    def save(fig, run_dir, name, notes=None):  # noqa: ANN001
        figures.append((name, fig, notes))
        return Path(run_dir) / name

    monkeypatch.setattr(module, "save_figure", save)
    return figures


def test_the_scaling_plot_clips_nothing_draws_ideal_linear_and_integer_ticks(monkeypatch, tmp_path):
    one = matmul_stage(1, [[13.0] * 5])
    two = matmul_stage(2, [[5.0, 5.0, 5.0, 5.0, 5.0], [5.0] * 5])  # efficiency 2.6: far above any fixed limit
    s = matmul.summarize([one, two], PARAMS)
    figures = _capture_figures(monkeypatch, matmul)
    matmul.plot({"job": "matmul_scaling", "ranks": one["ranks"], "scaling": s["rows"], "summary": s}, tmp_path)
    ((name, fig, notes),) = figures
    ax_tp, ax_eff = fig.axes
    top = max(r["efficiency_max"] or r["efficiency"] for r in s["rows"])
    assert ax_eff.get_ylim()[1] >= top  # the super-linear point and its error bar are inside the panel
    assert [t.get_text() for t in ax_eff.get_xticklabels()] == ["1", "2"]
    assert any("ideal linear" in t.get_text() for t in ax_tp.get_legend().get_texts())
    assert any("super-linear: check the load" in n for n in notes)  # under the axes, not over the data


def test_a_missing_efficiency_is_drawn_as_missing_not_zero(monkeypatch, tmp_path):
    rows = [{"workers": 1, "size": N, "gflops": 10.0, "gflops_min": 9.0, "gflops_max": 11.0, "efficiency": None,
             "efficiency_min": None, "efficiency_max": None, "flags": [], "note": None},
            {"workers": 2, "size": N, "gflops": 18.0, "gflops_min": 17.0, "gflops_max": 19.0, "efficiency": 0.9,
             "efficiency_min": 0.8, "efficiency_max": 1.0, "flags": [], "note": None}]
    figures = _capture_figures(monkeypatch, matmul)
    matmul.plot({"job": "j", "ranks": [], "scaling": rows, "summary": {}}, tmp_path)
    _, ax_eff = figures[0][1].axes
    ys = [y for line in ax_eff.get_lines() for y in line.get_ydata() if line.get_label() == "n=100"]
    assert 0 not in ys and 0.0 not in ys


# --- the other jobs --------------------------------------------------------------------------------


def train_stage(ws: int, epoch_ms: list[list[float]], samples: int = 1000) -> dict[str, Any]:
    result = {"samples_per_epoch": samples, "epochs_run": len(epoch_ms[0]), "first_epoch": 0, "threads": 1,
              "threads_policy": "fair", "checkpoint_check": {"all_on_device": True, "equals_replica": True}}
    values = {"train/loss": [1.0] * len(epoch_ms[0]), "train/acc": [0.5] * len(epoch_ms[0]), "test/acc": [0.5]}
    return {"world_size": ws, "status": "succeeded",
            "ranks": [rank(r, ws, {"times_ms": {"train/epoch": t}, "values": values}, result) for r, t in enumerate(epoch_ms)]}


def test_ddp_train_leaves_out_the_warm_up_epoch_and_flags_153_percent():
    one = train_stage(1, [[900.0, 100.0, 101.0, 99.0]], samples=1000)  # the first epoch is the warm-up
    two = train_stage(2, [[500.0, 65.0, 66.0, 65.5]] * 2, samples=1000)  # 2000 samples in ~65 ms: 153%
    s = train.summarize([one, two], {})
    rows = {r["workers"]: r for r in s["rows"]}
    assert rows[1]["timed_epochs"] == 3 and rows[1]["total_sps"] == pytest.approx(1000 / 0.1, rel=1e-3)
    assert rows[1]["warmup_epoch_sps"] == pytest.approx(1000 / 0.9, rel=1e-3)
    assert rows[2]["efficiency"] == pytest.approx(1.53, abs=0.01)
    assert "super-linear" in rows[2]["flags"] and "super-linear: check the load" in rows[2]["note"]
    for sentence in s["conclusions"]:
        assert "reach" not in sentence
    assert any("153%" in c and "cannot be trusted" in c and "reads above linear scaling" in c for c in s["conclusions"])
    assert "note" in s["columns"] and rows[2]["total_sps_min"] <= rows[2]["total_sps"] <= rows[2]["total_sps_max"]


def test_cpu_vs_gpu_reports_ranges_and_leaves_the_gpu_missing_not_zero():
    p = {"sizes": [64], "work_gflop": 0.001, "trials": 5}
    iters = cpu_vs_gpu.iters_for(64, cpu_vs_gpu.Params.model_validate(p))
    cpu_rank = rank(0, 1, {"times_ms": {"cpu/64": [1.0, 1.1, 0.9, 3.0, 1.0]}}, {"cpu_measured": True, "cpu_threads": 2})
    s = cpu_vs_gpu.summarize([{"world_size": 1, "status": "succeeded", "ranks": [cpu_rank]}], p)
    (row,) = s["rows"]
    assert row["cpu_us"] == pytest.approx(1.0 * 1e3 / iters, rel=1e-3)
    assert row["cpu_us_min"] == pytest.approx(0.9e3 / iters, rel=1e-3) and row["cpu_us_max"] == pytest.approx(3e3 / iters, rel=1e-3)
    assert row["gpu_us"] is None and row["speedup"] is None and row["flags"] == []
    assert "\u00b5s" in s["title"]


def test_transfer_gb_s_range_runs_from_the_slowest_to_the_fastest_trial():
    r0 = rank(0, 1, {"times_ms": {"h2h/memcpy/16": [2.0, 4.0, 2.1, 2.0, 1.9]}}, {"identity": {"a": True}})
    s = transfer.summarize([{"world_size": 1, "status": "succeeded", "ranks": [r0]}], {"sizes_mb": [16]})
    (row,) = s["rows"]
    gb = 16 * 2**20 / 1e9
    assert row["gb_s"] == pytest.approx(gb / 2e-3, rel=1e-3)
    assert row["gb_s_min"] == pytest.approx(gb / 4e-3, rel=1e-3) and row["gb_s_max"] == pytest.approx(gb / 1.9e-3, rel=1e-3)
    assert row["flags"] == [] and row["trials"] == 5


def test_sync_logging_flags_a_noisy_variant_and_claims_no_ratio():
    times = {"wall/item": [100.0, 180.0, 60.0], "wall/device": [50.0, 51.0, 49.0], "wall/recorder": [50.0, 52.0, 50.0]}
    res = {"host_reads": {}, "device_syncs": None, "norm_sum": {}}
    r0 = rank(0, 1, {"times_ms": times}, res)
    s = sync_logging.summarize([{"world_size": 1, "status": "succeeded", "ranks": [r0]}], {"steps": 10, "repeats": 3})
    item = s["variants"]["item"]
    assert item["flags"] == ["noisy"] and item["ratio"] == 2.0
    assert item["ratio_min"] == pytest.approx(60 / 51, rel=1e-3) and item["ratio_max"] == pytest.approx(180 / 49, rel=1e-3)
    assert "not conclusive" in s["conclusions"][0]


def test_every_table_column_of_every_job_is_in_its_rows():
    stages = [matmul_stage(1, [[10.0] * 5])]
    for s in (matmul.summarize(stages, PARAMS), train.summarize([train_stage(1, [[9.0, 1.0, 1.0]])], {})):
        for row in s["rows"]:
            assert set(s["columns"]) <= set(row)
            for column in s["columns"]:
                assert " " not in str(row[column]) or column == "note"  # a table cell is one token, notes aside


def test_trial_loop_runs_the_count_then_extends_to_the_time_budget(monkeypatch):
    import torch

    cpu = torch.device("cpu")
    assert list(measure.trial_loop(cpu, 3, together=False)) == [0, 1, 2]
    clock = [100.0]  # the loop's clock, advanced by each trial: no dependence on the machine's load
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    n = 0
    for _ in measure.trial_loop(cpu, 1, 0.05, together=False):
        clock[0] += 0.011
        n += 1
    assert n == 5  # trials started at 0, 11, 22, 33 and 44 ms: the fifth ends past the 50 ms budget
    clock[0] = 0.0
    assert len(list(measure.trial_loop(cpu, 1, 1e9, together=False))) == measure.MAX_TRIALS  # a clock that never moves: capped


def test_error_bars_are_never_negative_where_rounding_crosses_the_median():
    """cpu_vs_gpu's throughput bars come from rounded figures: with the trials all but equal, the
    bound computed from the rounded time passed the rounded median and matplotlib refused the
    plot ("'yerr' must not contain negative values")."""
    from launcher.workloads.plotting import yerr

    rows = [{"v": 91.6, "v_min": 91.60004, "v_max": 91.59998}, {"v": 10.0, "v_min": 9.0, "v_max": 12.0}, {"v": None}]
    lo, hi = yerr(rows, "v")
    assert lo[:2] == [0.0, 1.0] and hi[:2] == [0.0, 2.0]
    assert all(x != x for x in (lo[2], hi[2]))  # NaN where not measured: matplotlib leaves a gap
