"""Plot helpers the workloads share: notes under the axes, integer worker ticks, error bars from
a figure's min-max, gaps (never zeros) where nothing was measured. matplotlib is imported lazily."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence


def save_figure(fig: Any, run_dir: Path, name: str, notes: list[str] | None = None) -> Path:
    """Save ``fig`` as ``run_dir/name``; ``notes`` are written under the axes, never over data."""
    import textwrap

    import matplotlib.pyplot as plt

    notes = [n for n in notes or [] if n]
    if notes:
        # the notes get room of their own under the axes: the figure grows, the axes keep their size
        width = int(fig.get_figwidth() * 13)
        text = "\n".join(textwrap.fill(n, width) for n in notes)
        extra = (text.count("\n") + 1) * 0.15 + 0.2  # inches
        height = fig.get_figheight() + extra
        fig.set_figheight(height)
        fig.text(0.01, 0.01, text, ha="left", va="bottom", fontsize=8, color="#444444")
        fig.tight_layout(rect=(0, extra / height, 1, 1))
    else:
        fig.tight_layout()
    path = Path(run_dir) / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def devices_label(result: Mapping[str, Any]) -> str:
    devices = sorted({r.get("device", "?") for r in result.get("ranks", []) if r.get("status") == "ok"})
    return ", ".join(devices) or "?"


def integer_ticks(ax: Any, values: Any) -> None:
    """Worker counts on the x axis: exactly those integers, nothing in between."""
    vals = sorted({int(v) for v in values})
    ax.set_xticks(vals)
    ax.set_xticklabels([str(v) for v in vals])
    ax.xaxis.set_minor_formatter(_no_labels())
    if len(vals) == 1:
        ax.set_xlim(vals[0] - 1, vals[0] + 1)


def yerr(rows: Sequence[Mapping[str, Any]], key: str) -> Any:
    """Asymmetric error bars (median to min, median to max) for ``key``; NaN where not measured.
    The figures are rounded on their own, so where the trials all but agree a bound can pass the
    median by a rounding step: such a bar is 0, never negative (matplotlib refuses those)."""
    lo = [max(0.0, r[key] - r[f"{key}_min"]) if _num(r.get(key)) and _num(r.get(f"{key}_min")) else math.nan for r in rows]
    hi = [max(0.0, r[f"{key}_max"] - r[key]) if _num(r.get(key)) and _num(r.get(f"{key}_max")) else math.nan for r in rows]
    return [lo, hi]


def values(rows: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    """``key`` of every row, NaN where missing: matplotlib leaves a gap, never draws a 0."""
    return [float(r[key]) if _num(r.get(key)) else math.nan for r in rows]


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def legend_below(ax: Any, ncol: int = 2) -> None:
    """The axes' legend under them, where it cannot cover a point (empty: no legend)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=ncol, frameon=False)


def _no_labels() -> Any:
    from matplotlib.ticker import NullFormatter

    return NullFormatter()
