"""Default results for any job: the series its ranks logged through ``ctx.metrics.log``.

A job without ``summarize``/``plot`` hooks still logs values (``ctx.metrics.log("loss", loss)``)
and counts steps (``ctx.metrics.step()``); each rank's ``to_host()`` puts them in its entry of
``result["ranks"]`` as ``metrics: {"steps": int, "values": {name: [float, ...]}, "times_ms": ...}``.
From those, with no knowledge of the job:

* ``series_summary(result)``: per stage (world size), series and rank: last, mean, min, max and
  count of the logged values (``SeriesRow``); ``series_table(rows)`` lays them out for a table;
* ``step_rates(result)``: per stage, steps per rank and steps/s (``StepRate``), from each rank's
  step count and its ``first_step`` and ``finished`` stamps;
* ``timer_summary(result)``: per stage, each ``ctx.metrics.timer`` name's median and count of
  blocks over every rank (``TimerRow``), from ``metrics.times_ms``;
* ``plot_series(result, run_dir)``: one PNG per stage, a panel per series, one line per rank,
  against the index of the logged value (the step, for a series logged once per step).

Pure functions of the result document (``plot_series`` only writes its PNGs): nothing here
imports torch, and matplotlib is used through its object API with the Agg canvas, so no global
pyplot state or display is touched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any

# Per figure: the most panels drawn (the rest are named in a note), the most ranks given a legend
# entry, and the most points per line (longer series are thinned evenly, the last point kept).
MAX_PANELS = 24
MAX_LEGEND_RANKS = 8
MAX_POINTS = 5000


@dataclass(frozen=True)
class SeriesRow:
    """One series of one rank in one stage. ``last``/``mean``/``min``/``max`` are over the finite
    values (None when there is none); ``count`` counts every value logged, ``nonfinite`` the NaN
    and infinite ones among them (a diverged loss shows here rather than as a NaN mean)."""

    world_size: int
    series: str
    rank: int
    last: float | None
    mean: float | None
    min: float | None
    max: float | None
    count: int
    nonfinite: int = 0


@dataclass(frozen=True)
class StepRate:
    """A stage's steps: ``steps_per_rank`` is the median rank's count; ``steps_per_s`` the median
    rank's rate, from its first step to its end (so it includes whatever ran after the last
    step); ``steps_per_s_total`` the sum over ranks. None where no rank stepped or stamped."""

    world_size: int
    ranks: int
    steps_per_rank: float | None
    steps_per_s: float | None
    steps_per_s_total: float | None
    steps_per_s_by_rank: tuple[float | None, ...] = ()


def _stage_ranks(result: Mapping[str, Any]) -> list[tuple[int, list[Mapping[str, Any]]]]:
    """(world size, its ranks that reported metrics) per stage, in the order the stages ran."""
    ranks = [r for r in result.get("ranks") or [] if isinstance(r.get("metrics"), Mapping)]
    sizes = [s.get("world_size") for s in result.get("stages") or []]
    sizes += sorted({r.get("world_size") for r in ranks} - set(sizes), key=lambda x: (x is None, x))
    out = []
    for ws in dict.fromkeys(sizes):
        mine = sorted((r for r in ranks if r.get("world_size") == ws), key=lambda r: r.get("rank", 0))
        if mine:
            out.append((ws, mine))
    return out


def _floats(values: Any) -> list[float]:
    out = []
    for v in values or []:
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            out.append(math.nan)  # something that is no number: counted, never summarised
    return out


def series_summary(result: Mapping[str, Any]) -> list[SeriesRow]:
    """Per stage, series (by name) and rank: last, mean, min, max, count of the logged values."""
    rows = []
    for ws, ranks in _stage_ranks(result):
        names = sorted({name for r in ranks for name in (r["metrics"].get("values") or {})})
        for name in names:
            for r in ranks:
                vals = _floats((r["metrics"].get("values") or {}).get(name))
                if not vals:
                    continue
                finite = [v for v in vals if math.isfinite(v)]
                rows.append(
                    SeriesRow(
                        world_size=ws,
                        series=name,
                        rank=int(r.get("rank", 0)),
                        last=finite[-1] if finite else None,
                        mean=math.fsum(finite) / len(finite) if finite else None,
                        min=min(finite) if finite else None,
                        max=max(finite) if finite else None,
                        count=len(vals),
                        nonfinite=len(vals) - len(finite),
                    )
                )
    return rows


SERIES_COLUMNS = ("workers", "series", "rank", "last", "mean", "min", "max", "count")


def series_table(rows: list[SeriesRow], digits: int = 4) -> tuple[list[str], list[dict[str, Any]]]:
    """``(columns, rows)`` for a table of ``series_summary``: numbers to ``digits`` significant
    digits; a series with non-finite values says how many in its ``count`` cell ("98(+2nan)": no spaces, one token per cell)."""
    out = []
    for row in rows:
        count: Any = row.count if not row.nonfinite else f"{row.count - row.nonfinite}(+{row.nonfinite}nan)"
        out.append(
            {
                "workers": row.world_size,
                "series": row.series,
                "rank": row.rank,
                **{k: _sig(getattr(row, k), digits) for k in ("last", "mean", "min", "max")},
                "count": count,
            }
        )
    return list(SERIES_COLUMNS), out


def _sig(value: float | None, digits: int) -> float | None:
    if value is None or value == 0:
        return value
    return round(value, max(0, digits - 1 - int(math.floor(math.log10(abs(value))))))


def step_rates(result: Mapping[str, Any]) -> list[StepRate]:
    """Per stage: the median rank's steps and steps/s, and the stage's total steps/s."""
    out = []
    for ws, ranks in _stage_ranks(result):
        counts, rates = [], []
        for r in ranks:
            steps = r["metrics"].get("steps")
            steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
            if steps is not None:
                counts.append(steps)
            rates.append(_rate(steps, r.get("phases") or {}))
        known = [x for x in rates if x is not None]
        out.append(
            StepRate(
                world_size=ws,
                ranks=len(ranks),
                steps_per_rank=float(median(counts)) if counts else None,
                steps_per_s=_round(sorted(known)[len(known) // 2]) if known else None,
                steps_per_s_total=_round(math.fsum(known)) if known else None,
                steps_per_s_by_rank=tuple(_round(x) for x in rates),
            )
        )
    return out


def _rate(steps: int | None, phases: Mapping[str, Any]) -> float | None:
    """Steps per second from the first step to the end: the first step's stamp is taken when it
    ends, so ``steps - 1`` steps fall between the two stamps."""
    first, end = phases.get("first_step"), phases.get("finished")
    if not steps or steps < 2 or not isinstance(first, (int, float)) or not isinstance(end, (int, float)) or end <= first:
        return None
    return (steps - 1) / (end - first)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


@dataclass(frozen=True)
class TimerRow:
    """One ``ctx.metrics.timer`` name in one stage, over every rank that timed it: the median of
    all their blocks (ms; None where none is a finite number), how many blocks, and by how many ranks."""

    world_size: int
    timer: str
    median_ms: float | None
    count: int
    ranks: int


def timer_summary(result: Mapping[str, Any]) -> list[TimerRow]:
    """Per stage and timer (by name): the median and count of its blocks over every rank."""
    rows = []
    for ws, ranks in _stage_ranks(result):
        timed = [r["metrics"].get("times_ms") or {} for r in ranks]
        for name in sorted({n for t in timed for n in t if isinstance(t, Mapping)}):
            per_rank = [_floats(t.get(name)) for t in timed if isinstance(t, Mapping) and t.get(name)]
            blocks = [v for vals in per_rank for v in vals]
            finite = [v for v in blocks if math.isfinite(v)]
            rows.append(TimerRow(ws, name, float(median(finite)) if finite else None, len(blocks), len(per_rank)))
    return rows


def summary_dict(result: Mapping[str, Any]) -> dict[str, Any]:
    """JSON-ready: ``series`` (every ``SeriesRow``), ``step_rates`` and a ``columns``/``rows`` table."""
    rows = series_summary(result)
    columns, table = series_table(rows)
    return {
        "series": [asdict(r) for r in rows],
        "step_rates": [{**asdict(s), "steps_per_s_by_rank": list(s.steps_per_s_by_rank)} for s in step_rates(result)],
        "columns": columns,
        "rows": table,
    }


def plot_series(result: Mapping[str, Any], run_dir: str | Path) -> list[Path]:
    """One PNG per stage with logged values, ``series_world<N>.png``: a panel per series, a line per
    rank, against the index of the value (the step, for a series logged once per step)."""
    written = []
    rates = {s.world_size: s for s in step_rates(result)}
    for ws, ranks in _stage_ranks(result):
        names = sorted({n for r in ranks for n, v in (r["metrics"].get("values") or {}).items() if v})
        if names:
            written.append(_plot_stage(result.get("job") or "job", ws, ranks, names, rates.get(ws), Path(run_dir)))
    return written


def _plot_stage(job: str, ws: int, ranks: list[Mapping[str, Any]], names: list[str], rate: StepRate | None, run_dir: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from launcher.workloads.plotting import fit_layout

    shown, hidden = names[:MAX_PANELS], names[MAX_PANELS:]
    cols = min(3, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig = Figure(figsize=(4.6 * cols, 3.3 * rows + 0.9))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    notes: list[str] = []
    for i, name in enumerate(shown):
        _plot_panel(axes[i // cols][i % cols], name, ranks, notes)
    for j in range(len(shown), rows * cols):
        axes[j // cols][j % cols].set_visible(False)
    if len(ranks) > MAX_LEGEND_RANKS:
        notes.append(f"{len(ranks)} ranks, one line each (no legend)")
    if hidden:
        notes.append(f"{len(hidden)} more series not drawn: {', '.join(hidden[:10])}{' ...' if len(hidden) > 10 else ''}")
    nb = "\u00a0"  # a no-break space: a wrapped title keeps "world size 2" and each figure with its unit
    title = f"{job}: logged series, world{nb}size{nb}{ws}"
    if rate and rate.steps_per_s is not None:
        title += f" ({rate.steps_per_rank:g}{nb}steps per rank, {rate.steps_per_s:,.1f}{nb}steps/s per rank)"
    fig.suptitle(title, fontsize=11)
    fit_layout(fig, list(dict.fromkeys(notes)))  # the title wraps where the figure is narrower than it
    path = run_dir / f"series_world{ws}.png"
    fig.savefig(path, dpi=110)
    return path


def _plot_panel(ax: Any, name: str, ranks: list[Mapping[str, Any]], notes: list[str]) -> None:
    """One series: a line per rank (NaN/inf stay gaps, never drawn as values), integer steps."""
    from matplotlib.ticker import MaxNLocator

    steps_logged, longest = True, 0
    for r in ranks:
        vals = _floats((r["metrics"].get("values") or {}).get(name))
        if not vals:
            continue
        steps_logged &= len(vals) == r["metrics"].get("steps")
        longest = max(longest, len(vals))
        xs, ys = _thin(vals)
        if len(xs) < len(vals):
            notes.append(f"{name}: {len(vals)} values per rank, every {len(vals) // len(xs) or 1}th drawn")
        marker = "o" if len(vals) <= 30 else None
        ax.plot(xs, [y if math.isfinite(y) else math.nan for y in ys], marker=marker, markersize=3,
                linewidth=1.2, label=f"rank {r.get('rank', '?')}")
    ax.set_title(name, fontsize=10)
    ax.set_xlabel("step" if steps_logged else "value # (in the order logged)")
    if longest <= 10:  # a handful of values: exactly their indices, never 0.975
        ax.set_xticks(range(1, longest + 1))
        ax.set_xlim(0.5, longest + 0.5)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if 1 < len(ranks) <= MAX_LEGEND_RANKS:
        ax.legend(fontsize=7)


def _thin(vals: list[float]) -> tuple[list[int], list[float]]:
    """x (1-based index) and y, thinned evenly to at most ``MAX_POINTS`` points, the last one kept."""
    n = len(vals)
    if n <= MAX_POINTS:
        return list(range(1, n + 1)), vals
    stride = math.ceil(n / MAX_POINTS)
    idx = list(range(0, n, stride))
    if idx[-1] != n - 1:
        idx.append(n - 1)
    return [i + 1 for i in idx], [vals[i] for i in idx]


def default_summary(result: Mapping[str, Any]) -> dict[str, Any]:
    """The summary a job without a ``summarize`` hook gets: its logged series per rank as the
    table, each stage's step rate in words (nothing when it logged nothing); for a ``script:``
    job, which has no ``ctx.metrics``, a line saying that it gets no table and no plot."""
    data = summary_dict(result)
    out: dict[str, Any] = {"series": data["series"], "step_rates": data["step_rates"]}
    if data["rows"]:
        out.update(title="logged series (ctx.metrics.log), per rank", columns=data["columns"], rows=data["rows"])
    out["conclusions"] = [
        f"world size {s['world_size']}: {_rate_words(s['steps_per_s'])} steps/s per rank (median over ranks)"
        for s in data["step_rates"]
        if isinstance(s.get("steps_per_s"), (int, float))
    ]
    if (result.get("spec") or {}).get("script") and not data["rows"]:
        # a torchrun script runs unchanged: it has no ctx, so it logs, times and counts nothing here
        ranks = [r for r in result.get("ranks") or () if isinstance(r, Mapping)]
        ok = sum(1 for r in ranks if r.get("status") == "ok")
        out["conclusions"].append(
            "a script: job has no ctx.metrics, so it gets no series table and no plot; what is measured is "
            f"each stage's wall time and start-up (above), and how its ranks ended: {ok}/{len(ranks)} exited 0"
        )
    return out


def _rate_words(rate: float) -> str:
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"
