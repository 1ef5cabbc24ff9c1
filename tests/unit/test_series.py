"""Default results for any job (launcher.results.series): per-rank summaries of every series logged
through ctx.metrics.log, per-stage step rates and one plot per stage, from result.json alone."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from launcher.results import series
from launcher.results.series import SeriesRow, StepRate, plot_series, series_summary, series_table, step_rates, summary_dict

PNG = b"\x89PNG\r\n\x1a\n"


def rank(r: int, ws: int, values: dict[str, list[float]], steps: int, run_s: float | None = 1.5) -> dict[str, Any]:
    phases = {"started": 100.0, "first_step": 101.0}
    if run_s is not None:
        phases["finished"] = 101.0 + run_s
    return {"rank": r, "world_size": ws, "status": "ok", "device": "cpu", "phases": phases,
            "metrics": {"steps": steps, "values": values, "times_ms": {}}}


def user_job() -> dict[str, Any]:
    """A user's DDP MLP with no hooks: it logs ``loss`` every step and ``acc`` at the end."""
    return {
        "job": "my_mlp",
        "stages": [{"world_size": 1, "status": "succeeded"}, {"world_size": 2, "status": "succeeded"}],
        "ranks": [
            rank(0, 1, {"loss": [2.0, 1.0, 0.5, 0.25], "acc": [0.9]}, steps=4, run_s=1.5),
            rank(1, 2, {"loss": [2.2, 1.1, 0.6, 0.3]}, steps=4, run_s=3.0),  # ranks listed out of order
            rank(0, 2, {"loss": [2.1, float("nan"), 0.4, 0.2], "acc": [0.8]}, steps=4, run_s=1.0),
        ],
    }


def test_every_series_gets_last_mean_min_max_count_per_rank_and_stage():
    rows = series_summary(user_job())
    assert [(r.world_size, r.series, r.rank) for r in rows] == [
        (1, "acc", 0), (1, "loss", 0), (2, "acc", 0), (2, "loss", 0), (2, "loss", 1),
    ]
    loss1 = rows[1]
    assert loss1 == SeriesRow(world_size=1, series="loss", rank=0, last=0.25, mean=0.9375, min=0.25, max=2.0, count=4)
    acc = rows[0]
    assert (acc.last, acc.mean, acc.min, acc.max, acc.count) == (0.9, 0.9, 0.9, 0.9, 1)


def test_a_nan_is_counted_and_kept_out_of_the_numbers():
    nan_row = next(r for r in series_summary(user_job()) if (r.world_size, r.series, r.rank) == (2, "loss", 0))
    assert nan_row.count == 4 and nan_row.nonfinite == 1
    assert nan_row.mean == pytest.approx((2.1 + 0.4 + 0.2) / 3) and nan_row.min == 0.2 and nan_row.last == 0.2
    columns, table = series_table([nan_row])
    assert columns == ["workers", "series", "rank", "last", "mean", "min", "max", "count"]
    assert table[0]["count"] == "3(+1nan)" and " " not in table[0]["count"]


def test_a_series_of_nothing_but_nan_has_no_numbers():
    result = {"stages": [{"world_size": 1}], "ranks": [rank(0, 1, {"loss": [float("nan"), float("inf")]}, steps=2)]}
    (row,) = series_summary(result)
    assert (row.last, row.mean, row.min, row.max, row.count, row.nonfinite) == (None, None, None, None, 2, 2)


def test_step_rates_per_stage():
    rates = step_rates(user_job())
    assert rates[0] == StepRate(world_size=1, ranks=1, steps_per_rank=4.0, steps_per_s=2.0, steps_per_s_total=2.0,
                                steps_per_s_by_rank=(2.0,))
    two = rates[1]
    # rank 0: 3 steps between its first step and its end in 1.0 s; rank 1: in 3.0 s
    assert two.world_size == 2 and two.ranks == 2 and two.steps_per_rank == 4.0
    assert two.steps_per_s_by_rank == (3.0, 1.0)
    assert two.steps_per_s == 3.0 and two.steps_per_s_total == 4.0


def test_step_rates_without_stamps_or_steps_are_unknown_not_zero():
    result = {"stages": [{"world_size": 1}], "ranks": [rank(0, 1, {}, steps=0, run_s=None)]}
    (rate,) = step_rates(result)
    assert rate.steps_per_rank == 0.0 and rate.steps_per_s is None and rate.steps_per_s_total is None


def test_a_failed_rank_without_metrics_is_skipped():
    result = user_job()
    result["ranks"].append({"rank": 2, "world_size": 2, "status": "failed", "metrics": None})
    assert {r.rank for r in series_summary(result)} == {0, 1}
    assert step_rates(result)[1].ranks == 2


def test_summary_dict_is_json():
    doc = summary_dict(user_job())
    assert json.loads(json.dumps(doc)) == doc
    assert {r["series"] for r in doc["series"]} == {"loss", "acc"}
    assert [s["world_size"] for s in doc["step_rates"]] == [1, 2]
    assert doc["columns"][0] == "workers" and len(doc["rows"]) == len(doc["series"])


def test_plot_series_writes_one_png_per_stage_with_a_panel_per_series_and_a_line_per_rank(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    figures = []
    original = Figure.savefig

    def keep(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    paths = plot_series(user_job(), tmp_path)
    assert [p.name for p in paths] == ["series_world1.png", "series_world2.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG
    two = figures[1]
    visible = [ax for ax in two.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["acc", "loss"]
    loss = visible[1]
    assert sorted(line.get_label() for line in loss.get_lines()) == ["rank 0", "rank 1"]
    assert loss.get_xlabel() == "step"  # loss was logged once per step
    rank0 = next(line for line in loss.get_lines() if line.get_label() == "rank 0")
    assert math.isnan(rank0.get_ydata()[1])  # the NaN is a gap, not a value
    assert "steps/s per rank" in two._suptitle.get_text()


def test_plot_series_of_a_job_that_logged_nothing_writes_nothing(tmp_path):
    result = {"stages": [{"world_size": 1}], "ranks": [rank(0, 1, {}, steps=3)]}
    assert plot_series(result, tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_long_series_are_thinned_and_many_series_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(series, "MAX_PANELS", 2)
    long = [float(i) for i in range(series.MAX_POINTS * 3 + 1)]
    result = {"job": "j", "stages": [{"world_size": 1}],
              "ranks": [rank(0, 1, {"a": long, "b": [1.0], "c": [2.0]}, steps=len(long))]}
    (path,) = plot_series(result, tmp_path)
    assert path.read_bytes()[:8] == PNG
    xs, ys = series._thin(long)
    assert len(xs) <= series.MAX_POINTS + 1 and xs[-1] == len(long) and ys[-1] == long[-1]


def test_the_real_matmul_result_shape(tmp_path: Path):
    """The shape `to_host()` gives: values per name, steps an int; stages from result.json."""
    result = {"job": "matmul_scaling", "stages": [{"world_size": 2, "status": "succeeded"}],
              "ranks": [rank(r, 2, {"checksum/256": [4086.4]}, steps=20) for r in (0, 1)]}
    rows = series_summary(result)
    assert [(r.series, r.rank, r.count) for r in rows] == [("checksum/256", 0, 1), ("checksum/256", 1, 1)]
    assert plot_series(result, tmp_path)[0].name == "series_world2.png"


def _saved_figures(monkeypatch) -> list[Any]:  # noqa: ANN001
    """Every figure saved from now on (its own object: its texts can be measured)."""
    from matplotlib.figure import Figure

    figures: list[Any] = []
    original = Figure.savefig

    def keep(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def _outside(fig: Any) -> list[str]:
    """The titles and notes of ``fig`` that reach past its edges (as drawn, with its renderer)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()  # a closed pyplot figure has lost its own canvas
    width, height = fig.bbox.width, fig.bbox.height
    texts = [fig._suptitle, *fig.texts, *(ax.title for ax in fig.axes if ax.get_visible())]
    out = []
    for text in texts:
        if text is None or not text.get_text():
            continue
        box = text.get_window_extent(renderer)
        if box.x0 < 0 or box.y0 < 0 or box.x1 > width or box.y1 > height:
            out.append(f"{text.get_text()!r}: {box} outside {width}x{height}")
    return out


def test_a_one_panel_plot_wraps_its_title_inside_the_figure(tmp_path, monkeypatch):
    """One series: the figure is 506 px wide, narrower than the title with its step rate, which
    was cut at both edges ("n: logged series, world size 2 (200 steps per rank, 446.8 ste")."""
    figures = _saved_figures(monkeypatch)
    ranks = [rank(r, 2, {"loss": [1.0 / (i + 1) for i in range(200)]}, steps=200, run_s=199 / 446.8) for r in (0, 1)]
    (path,) = plot_series({"job": "sync_logging_user_run", "stages": [{"world_size": 2}], "ranks": ranks}, tmp_path)
    (fig,) = figures
    title = fig._suptitle.get_text()
    assert "\n" in title and "446.8\u00a0steps/s per rank" in title  # wrapped, every word kept
    assert title.replace("\n", " ").replace("\u00a0", " ") == (
        "sync_logging_user_run: logged series, world size 2 (200 steps per rank, 446.8 steps/s per rank)"
    )
    assert _outside(fig) == []
    assert path.read_bytes()[:8] == PNG


def test_the_workloads_figures_keep_long_titles_and_notes_inside(tmp_path, monkeypatch):
    """``save_figure`` (every workload's plot): a title naming eight GPUs, an axes title longer
    than its axes and a long note all wrap inside the figure; the axes keep their height."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from launcher.workloads.plotting import save_figure

    figures = _saved_figures(monkeypatch)
    fig, (left, right) = plt.subplots(1, 2, figsize=(6.4, 4.6))
    devices = ", ".join(f"cuda:{i} (NVIDIA H100 80GB HBM3)" for i in range(8))
    fig.suptitle(f"matmul_scaling on {devices}; torch threads per rank by world size: 1: 1, 2: 1, 4: 1, 8: 1")
    left.set_title("two tasks of 2 matmuls, n=1024: 0.90x (range 0.56-1.84) of the sequential time")
    right.set_title("ok")
    left.plot([1, 2], [1, 2])
    note = "not measured: " + "; ".join(f"cuda:{i}->cuda:{i + 1}, one process" for i in range(7))
    path = save_figure(fig, tmp_path, "wide.png", [note])
    (saved,) = figures
    assert _outside(saved) == []
    assert saved._suptitle.get_text().count("\n") >= 2 and "\n" in left.get_title()
    assert saved._suptitle.get_text().replace("\n", " ").endswith("4: 1, 8: 1")
    assert path.read_bytes()[:8] == PNG


def test_timers_per_stage_are_a_median_and_a_count_over_every_rank():
    result = user_job()
    result["ranks"][1]["metrics"]["times_ms"] = {"fwd": [3.0, 5.0], "bwd": [float("nan")]}  # world 2, rank 1
    result["ranks"][2]["metrics"]["times_ms"] = {"fwd": [1.0, 2.0, 4.0]}  # world 2, rank 0
    result["ranks"][0]["metrics"]["times_ms"] = {"fwd": [10.0]}  # world 1
    assert series.timer_summary(result) == [
        series.TimerRow(world_size=1, timer="fwd", median_ms=10.0, count=1, ranks=1),
        series.TimerRow(world_size=2, timer="bwd", median_ms=None, count=1, ranks=1),
        series.TimerRow(world_size=2, timer="fwd", median_ms=3.0, count=5, ranks=2),
    ]
    assert series.timer_summary({"stages": [{"world_size": 1}], "ranks": [rank(0, 1, {}, steps=1)]}) == []


def test_a_script_job_is_told_it_gets_no_table_and_no_plot():
    from launcher.results.series import default_summary

    script = {"job": "s", "spec": {"script": "train.py"}, "stages": [{"world_size": 2}],
              "ranks": [rank(r, 2, {}, steps=0, run_s=None) for r in (0, 1)]}
    (line,) = default_summary(script)["conclusions"]
    assert "script: job has no ctx.metrics" in line and "no plot" in line and line.endswith("2/2 exited 0")
    assert "rows" not in default_summary(script)
    entry = {**script, "spec": {"entrypoint": "m:run"}}
    assert default_summary(entry)["conclusions"] == []
