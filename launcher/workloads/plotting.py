"""Plot helpers the workloads share: notes under the axes, integer worker ticks, error bars from
a figure's min-max, gaps (never zeros) where nothing was measured, titles wrapped to the room they
have (``fit_layout``: never cut off at the figure's edge). matplotlib is imported lazily."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence


def save_figure(fig: Any, run_dir: Path, name: str, notes: list[str] | None = None) -> Path:
    """Save ``fig`` as ``run_dir/name``; ``notes`` are written under the axes, never over data,
    and no title is cut off at the figure's edge (``fit_layout``)."""
    import matplotlib.pyplot as plt

    fit_layout(fig, notes)
    path = Path(run_dir) / name
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# The room a title may take: the figure's width (its own title) or its axes' (an axes' title),
# less this share on each side, so that a few pixels of rounding at another dpi cut nothing.
_EDGE = 0.01
_NARROWEST = 8  # characters per line: a title is never wrapped narrower (a longer word is broken)


def fit_layout(fig: Any, notes: Sequence[str] | None = None) -> None:
    """Lay ``fig`` out for saving: its title and every axes' title wrapped, at spaces, to the
    width they have (the figure grows by the title's new lines, so its axes keep their height);
    ``notes`` in a band of their own under the axes, wrapped to the figure's width; then
    ``tight_layout``. After it every title and note lies inside the figure."""
    renderer = _renderer(fig)
    title = fig._suptitle  # noqa: SLF001 - the Text of fig.suptitle(), or None
    if title is not None:
        lines = title.get_text().count("\n")
        if _wrap_to(title, fig.bbox.width * (1 - 2 * _EDGE), renderer):
            grown = (title.get_text().count("\n") - lines) * title.get_fontsize() * 1.25 / 72
            fig.set_figheight(fig.get_figheight() + grown)
    band = 0.0
    notes = [n for n in notes or () if n]
    if notes:
        # the notes get room of their own under the axes: the figure grows, the axes keep their size
        text = fig.text(0.01, 0.01, "\n".join(notes), ha="left", va="bottom", fontsize=8, color="#444444")
        _wrap_to(text, fig.bbox.width * (0.99 - _EDGE), renderer)
        band = (text.get_text().count("\n") + 1) * 0.15 + 0.2  # inches
        fig.set_figheight(fig.get_figheight() + band)
    rect = (0, band / fig.get_figheight(), 1, 1)
    fig.tight_layout(rect=rect)
    for _ in range(3):  # each axes' title to the axes' width once laid out (which a wrapped title narrows again)
        if not any([_wrap_to(ax.title, ax.bbox.width * (1 - 2 * _EDGE), renderer) for ax in fig.axes if ax.get_visible()]):
            break
        fig.tight_layout(rect=rect)


def _renderer(fig: Any) -> Any:
    canvas = fig.canvas
    if not hasattr(canvas, "get_renderer"):  # a Figure() made without a canvas: Agg's
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        canvas = FigureCanvasAgg(fig)
    return canvas.get_renderer()


def _wrap_to(text: Any, room: float, renderer: Any) -> bool:
    """Wrap a matplotlib ``Text`` at spaces until it is at most ``room`` pixels wide (a word wider
    than that is broken, at ``_NARROWEST`` characters); its own line breaks are kept. Whether it
    had to be wrapped."""
    import textwrap

    content = text.get_text()
    width = text.get_window_extent(renderer).width
    if not content or width <= room:
        return False
    paragraphs = content.split("\n")
    chars = max(_NARROWEST, int(max(len(p) for p in paragraphs) * room / width))
    while True:
        text.set_text("\n".join(textwrap.fill(p, chars, break_on_hyphens=False) for p in paragraphs))
        if text.get_window_extent(renderer).width <= room or chars <= _NARROWEST:
            return True
        chars = max(_NARROWEST, chars - max(1, chars // 10))


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
