"""The statistics of repeated trials and the flags a figure carries.

How the suite measures (a benchmark, not a stopwatch): every timed figure comes from a warm-up
and then repeated trials, each timed on its own (CUDA events on a GPU, a host clock around
synchronous work on the CPU), and is reported as the median of the trials with their range
(min-max, the error bars of the plots). A figure whose spread, the interquartile range of its
trials over their median (robust to one trial hit by a passing job, as the median is), exceeds
``NOISY_SPREAD`` is flagged "noisy", as is a figure from a single trial; a scaling efficiency
above ``SUPERLINEAR`` is flagged "super-linear": with the same threads per rank at every world
size it cannot be real, and the summary never states it as a result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median, quantiles
from typing import Any, Literal

# A figure whose trials' interquartile range is more than this fraction of their median is "noisy".
NOISY_SPREAD = 0.10


# A scaling efficiency above this is "super-linear": not a result, a sign of an unfair comparison
# (a busy machine during the smaller stage, more threads per rank, caches) to be checked.
SUPERLINEAR = 1.05


def med(values: list[float] | None) -> float | None:
    values = [v for v in values or [] if v is not None]
    return float(median(values)) if values else None


def rnd(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(float(value), digits)


@dataclass(frozen=True)
class Stat:
    """The trials of one figure: median, min, max, quartiles, count."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    n: int

    def __bool__(self) -> Literal[True]:
        # always true, as every object is; spelt out so that the type checker reads
        # `s and s.median` (the figure, or None without trials) as a float or None
        return True

    @property
    def spread(self) -> float | None:
        """(q3 - q1) / median: how far apart the middle half of the trials is, as a fraction of the figure."""
        return (self.q3 - self.q1) / abs(self.median) if self.median else None

    @property
    def range_spread(self) -> float | None:
        """(max - min) / median: every trial, outliers included."""
        return (self.max - self.min) / abs(self.median) if self.median else None

    def scaled(self, factor: float) -> "Stat":
        """The same trials in other units (``factor`` > 0), e.g. ms per block -> us per matmul."""
        return Stat(self.median * factor, self.min * factor, self.max * factor, self.q1 * factor, self.q3 * factor, self.n)

    def inverse(self, numerator: float) -> "Stat":
        """``numerator / x`` of every trial (a time -> a rate): min and max swap, as do the quartiles."""
        return Stat(numerator / self.median, numerator / self.max, numerator / self.min, numerator / self.q3,
                    numerator / self.q1, self.n)


def stat(values: Any) -> Stat | None:
    """Median, min-max and quartiles of the finite, positive-or-zero values (None: there are none)."""
    vals = sorted(float(v) for v in values or [] if v is not None and math.isfinite(float(v)))
    if not vals:
        return None
    q1, q3 = (quantiles(vals, n=4, method="inclusive")[i] for i in (0, 2)) if len(vals) > 1 else (vals[0], vals[0])
    return Stat(float(median(vals)), vals[0], vals[-1], q1, q3, len(vals))


def flags_for(spread: float | None = None, efficiency: float | None = None, *, trials: int | None = None,
              busy: str | None = None, noisy: float = NOISY_SPREAD, superlinear: float = SUPERLINEAR) -> tuple[list[str], str | None]:
    """A row's flags (machine-readable: "noisy", "single-trial", "super-linear", "busy") and the note
    the table shows ("noisy: spread 38%", "super-linear: check the load", "busy: load 3.24 on 2 cores")."""
    flags, notes = [], []
    if trials == 1:
        flags.append("single-trial")
        notes.append("1 trial: spread unknown")
    elif spread is not None and spread > noisy:
        flags.append("noisy")
        notes.append(f"noisy: spread {spread:.0%}")
    if efficiency is not None and efficiency > superlinear:
        flags.append("super-linear")
        notes.append("super-linear: check the load")
    if busy:
        flags.append("busy")
        notes.append(busy)
    return flags, "; ".join(notes) or None


def stat_fields(prefix: str, s: Stat | None, digits: int = 4) -> dict[str, Any]:
    """``{prefix: median, prefix_min, prefix_max}`` for a row of ``result.json``."""
    if s is None:
        return {prefix: None, f"{prefix}_min": None, f"{prefix}_max": None}
    return {prefix: rnd(s.median, digits), f"{prefix}_min": rnd(s.min, digits), f"{prefix}_max": rnd(s.max, digits)}


def span(lo: float | None, hi: float | None) -> str | None:
    """A min-max range as one table cell without spaces: ``88.1\u2013109``, ``7,510\u20139,950``."""
    if lo is None or hi is None:
        return None
    return f"{num(lo)}\u2013{num(hi)}"


def num(value: float) -> str:
    """3 significant digits, thousands separated rather than in exponent form (as the table does)."""
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"

def ok_ranks(stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for s in stages if s["status"] == "succeeded" for r in s["ranks"] if r.get("status") == "ok"]


def times(ratio: float | None, more: str = "faster", less: str = "slower", digits: int = 1) -> str:
    """A ratio in words that never reads "0.3x faster": ``times(3.3)`` "3.3x faster", ``times(0.3)``
    "3.3x slower" (the inverse, with the other word). ``more``/``less``: the words for a ratio
    above/below 1 (a ratio of times: ``more="slower", less="faster"``)."""
    if ratio is None or not math.isfinite(ratio) or ratio <= 0:
        return "?"
    return f"{ratio:.{digits}f}x {more}" if ratio >= 1 else f"{1 / ratio:.{digits}f}x {less}"


def times_range(lo: float | None, hi: float | None, more: str = "faster", less: str = "slower", digits: int = 1) -> str:
    """A range of ratios in the same words: "1.2-1.6x faster", "2.5-5.0x slower", or, across 1,
    "2.0x slower to 1.3x faster"."""
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)) or lo <= 0 or hi <= 0:
        return "?"
    lo, hi = min(lo, hi), max(lo, hi)
    if lo >= 1:
        return f"{lo:.{digits}f}-{hi:.{digits}f}x {more}"
    if hi < 1:
        return f"{1 / hi:.{digits}f}-{1 / lo:.{digits}f}x {less}"
    return f"{1 / lo:.{digits}f}x {less} to {hi:.{digits}f}x {more}"


# what a row's flag says of the run it marks, in words a reader takes in at once
_FLAG_WORDS = {
    "busy": "ran on a busy machine",
    "noisy": "varied widely from trial to trial",
    "single-trial": "had a single trial",
    "super-linear": "reads above linear scaling",
}


def doubts_in_words(flags: list[str], workers: int | None, *, baseline: bool = False) -> list[str]:
    """A row's flags as clauses: "the 2-worker run ran on a busy machine", "the 1-worker
    baseline varied widely from trial to trial"."""
    who = f"the {workers}-worker {'baseline' if baseline else 'run'}"
    return [f"{who} {_FLAG_WORDS.get(flag, flag)}" for flag in flags]
