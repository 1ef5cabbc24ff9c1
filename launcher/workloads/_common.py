"""Small helpers shared by the d2l "GPUs" workloads: parameters, clocks, trials and their
statistics, flags, sync counters, plots.

Everything here is imported inside the ranks (``run``), by the launcher before it spawns anything
(to check ``params`` against a workload's ``Params``) and at the end of a run (``summarize`` /
``plot``); torch and matplotlib are imported lazily so that those stay cheap.

How the suite measures (a benchmark, not a stopwatch): every timed figure comes from a warm-up
and then repeated trials, each timed on its own (CUDA events on a GPU, a host clock around
synchronous work on the CPU), and is reported as the median of the trials with their range
(min-max, the error bars of the plots). A figure whose spread, the interquartile range of its
trials over their median (robust to one trial hit by a passing job, as the median is), exceeds
``NOISY_SPREAD`` is flagged "noisy", as is a figure from a single trial; a scaling efficiency above ``SUPERLINEAR`` is flagged "super-linear": with the same
threads per rank at every world size it cannot be real, and the summary never states it as a
result.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from statistics import median, quantiles
from typing import Annotated, Any, Callable, Iterator, Literal, Mapping

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator

from launcher.spec.validation import Real

# Tensor methods that hand a tensor's values to Python or to host memory: on a GPU every one of
# them waits for the device (a host synchronisation); on the CPU they are plain reads.
HOST_READS = frozenset({"item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "__complex__"})
HOST_COPIES = frozenset({"cpu", "to", "copy_"})
SYNC_WARNING = "synchronizing CUDA operation"


class WorkloadParams(BaseModel):
    """A workload's ``params``, checked by the launcher before anything is spawned (unknown keys
    and wrong types exit 2 with the spec's file and line) and read by the ranks with defaults;
    ``null`` means the default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # `--set params.steps=null`, or a spec unsetting what the file it extends set
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, Mapping) else data


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _distinct(values: tuple[Any, ...]) -> tuple[Any, ...]:
    if len(set(values)) != len(values):
        raise ValueError("expected each size once")  # a repeated size would be timed, and counted, twice
    return values


Count = Annotated[StrictInt, Field(ge=1)]
NonNegative = Annotated[StrictInt, Field(ge=0)]
Positive = Annotated[Real, Field(gt=0)]
# `sizes: 64` means `sizes: [64]`
Sizes = Annotated[tuple[Count, ...], BeforeValidator(_as_list), Field(min_length=1), AfterValidator(_distinct)]
PositiveSizes = Annotated[tuple[Positive, ...], BeforeValidator(_as_list), Field(min_length=1), AfterValidator(_distinct)]
DtypeName = Literal["float16", "bfloat16", "float32", "float64"]
# torch threads per rank: a count, or "share" (the launcher's share of the node's cores, which
# shrinks as the world size grows); null: 1 on the CPU (the same at every world size), the
# launcher's share on a GPU (where each rank computes on a device of its own)
ThreadsPerRank = Count | Literal["share"] | None

# A figure whose trials' interquartile range is more than this fraction of their median is "noisy".
NOISY_SPREAD = 0.10
# A scaling efficiency above this is "super-linear": not a result, a sign of an unfair comparison
# (a busy machine during the smaller stage, more threads per rank, caches) to be checked.
SUPERLINEAR = 1.05
# The most trials a time budget (``min_time_s``) may add.
MAX_TRIALS = 100


def torch_dtype(name: DtypeName) -> Any:
    import torch

    return getattr(torch, name)


def sync(device: Any) -> None:
    """Wait for the device (no-op on the CPU, where every op is synchronous)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


@contextmanager
def wall_clock(device: Any) -> Iterator[Callable[[], float]]:
    """Host wall time of a block, with the device drained before and after: ``with ... as ms: ...; ms()``."""
    sync(device)
    t0 = time.perf_counter()
    out: list[float] = []
    yield lambda: out[0]
    sync(device)
    out.append((time.perf_counter() - t0) * 1e3)


def med(values: list[float] | None) -> float | None:
    values = [v for v in values or [] if v is not None]
    return float(median(values)) if values else None


def rnd(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(float(value), digits)


# --- statistics of repeated trials -------------------------------------------------------------


@dataclass(frozen=True)
class Stat:
    """The trials of one figure: median, min, max, quartiles, count."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    n: int

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


# --- trials in the ranks -------------------------------------------------------------------------


def trial_loop(device: Any, count: int, min_time_s: float = 0.0, *, group: Any = None, together: bool = True) -> Iterator[int]:
    """Trial indices 0, 1, ...: at least ``count`` of them, more (up to ``MAX_TRIALS``) while the
    trials so far took less than ``min_time_s``. The device is drained after each trial (outside
    the timed block) so that the next starts on an idle device.

    ``together``: every rank runs the same number of trials and starts each at the same moment:
    before each trial the ranks agree on going on with one small all-reduce on a host (gloo)
    group, which is also the barrier that lines them up. Ranks measured one at a time pass
    ``together=False``.
    """
    import torch
    import torch.distributed as dist

    agree = together and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    started = time.perf_counter()
    i = 0
    while True:
        more = i < count or (min_time_s > 0 and i < max(MAX_TRIALS, count) and time.perf_counter() - started < min_time_s)
        if agree:
            flag = torch.tensor([1 if more else 0], dtype=torch.int32)  # on the host: no device sync
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            more = bool(flag[0])
        if not more:
            return
        yield i
        sync(device)
        i += 1


def set_threads(ctx: Any, threads_per_rank: Any) -> dict[str, Any]:
    """Apply ``threads_per_rank`` (see ``ThreadsPerRank``) in this rank; what it ran with, for the summary."""
    import torch

    if threads_per_rank == "share" or (threads_per_rank is None and ctx.device.type == "cuda"):
        policy = "share"
    else:
        torch.set_num_threads(1 if threads_per_rank is None else int(threads_per_rank))
        policy = "fair" if threads_per_rank is None else "set"
    return {"threads": torch.get_num_threads(), "threads_policy": policy, "launcher_share": ctx.threads}


def machine_state() -> dict[str, Any]:
    """This node's usable cores and load average (1, 5, 15 min), read on the host: no device involved."""
    from launcher.runtime.devices import usable_cpu_count

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cores": usable_cpu_count(), "load_avg": load}


def stage_load(stage: Mapping[str, Any]) -> dict[str, Any] | None:
    """The stage's load average at start and end: the run loop's ``load_avg`` where it records one,
    else what the first rank saw at the start and end of its work."""
    if stage.get("load_avg"):
        return dict(stage["load_avg"])
    for r in sorted(stage.get("ranks", []), key=lambda r: r.get("rank", 0)):
        res = r.get("result") or {}
        start, end = (res.get("machine_start") or {}).get("load_avg"), (res.get("machine_end") or {}).get("load_avg")
        if start or end:
            return {"start": start, "end": end}
    return None


def stage_cores(stage: Mapping[str, Any]) -> int | None:
    for r in stage.get("ranks", []):
        cores = ((r.get("result") or {}).get("machine_start") or {}).get("cores")
        if cores:
            return int(cores)
    return None


def busy_stages(stages: list[Mapping[str, Any]]) -> dict[int, str]:
    """The stages (by world size) during which other work than this job's own ranks kept more than
    half the cores busy, with the note their rows carry ("busy: load 3.24 on 2 cores"). The job's
    own threads are taken out of each 1-minute load reading: at a stage's end its own ranks', at
    its start the previous stage's, which the average still remembers."""
    out, previous = {}, 0
    for stage in stages:
        load, own, cores = stage_load(stage), _own_threads(stage), stage_cores(stage)
        if load and cores:
            start, end = (load.get("start") or [None])[0], (load.get("end") or [None])[0]
            readings = [(x, x - mine) for x, mine in ((start, previous), (end, own)) if x is not None]
            worst = max(readings, key=lambda r: r[1], default=None)
            if worst and worst[1] > cores / 2:
                out[stage["world_size"]] = f"busy: load {worst[0]:.2f} on {cores} cores"
        previous = own
    return out


def load_words(stages: list[Mapping[str, Any]]) -> tuple[str | None, bool]:
    """"load average (1 min) at start->end of each stage: 1 worker(s) 0.4->1.1, ..." and whether the
    machine was busy during any stage (see ``busy_stages``)."""
    parts = []
    for stage in stages:
        load = stage_load(stage)
        if load:
            start, end = (load.get("start") or [None])[0], (load.get("end") or [None])[0]
            parts.append(f"{stage['world_size']} worker(s) " + "->".join("?" if x is None else f"{x:.2f}" for x in (start, end)))
    if not parts:
        return None, False
    return "load average (1 min) at start->end of each stage: " + ", ".join(parts), bool(busy_stages(stages))


def _own_threads(stage: Mapping[str, Any]) -> int:
    """The torch threads this stage's ranks ran on the first rank's host (the host whose load is read)."""
    ranks = sorted(stage.get("ranks", []), key=lambda r: r.get("rank", 0))
    host = ranks[0].get("host") if ranks else None
    return sum(int((r.get("result") or {}).get("threads") or 1) for r in ranks if r.get("host") == host)


def threads_words(threads: Mapping[int, Any], policy: set[str], cores: int | None, device: str) -> tuple[str, bool]:
    """The fairness sentence for the threads ranks ran with at each world size, and whether it is
    like for like (the same threads per rank at every world size)."""
    counts = {ws: t for ws, t in threads.items() if t is not None}
    same = len(set(counts.values())) <= 1
    if device != "cpu":
        return "each rank computes on a GPU of its own at every world size", True
    if not counts:
        return "threads per rank not recorded", False
    if same:
        t = next(iter(counts.values()))
        how = {"fair": "threads_per_rank default", "set": "threads_per_rank", "share": "the launcher's share"}
        why = ", ".join(how.get(p, p) for p in sorted(policy))
        most = max(counts)
        over = f"; {most} worker(s) x {t} thread(s) is more than the {cores} cores" if cores and most * t > cores else ""
        where = f" of this machine's {cores}" if cores else ""
        return (f"like for like: every rank ran {t} torch thread(s) at every world size ({why}), so N workers "
                f"use N x {t} core(s){where}{over}"), not over
    each = ", ".join(f"{ws} worker(s): {t}" for ws, t in sorted(counts.items()))
    return (f"NOT like for like: threads per rank differ by world size ({each}), so the efficiency mixes "
            "scaling with thread count (set params.threads_per_rank to compare like for like)"), False


def ok_ranks(stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for s in stages if s["status"] == "succeeded" for r in s["ranks"] if r.get("status") == "ok"]


class SyncCounter:
    """Counts what a block of code makes the host wait for, per phase (e.g. "loop", "end").

    ``host_reads``: tensor values handed to Python or copied from a device to host memory
    (``.item()``, ``.tolist()``, ``float(t)``, ``.cpu()`` of a CUDA tensor, ...), counted by a
    ``TorchFunctionMode`` on every device. ``device_syncs``: on CUDA only, the synchronisations
    PyTorch itself reports under ``torch.cuda.set_sync_debug_mode("warn")``; ``None`` on the CPU,
    where there is no device to wait for.
    """

    def __init__(self, device: Any) -> None:
        self.device = device
        self.host_reads: dict[str, int] = {}
        self.device_syncs: dict[str, int] | None = {} if device.type == "cuda" else None
        self.phase = "loop"

    @contextmanager
    def counting(self, phase: str) -> Iterator["SyncCounter"]:
        import torch
        from torch.overrides import TorchFunctionMode

        counter = self
        self.phase = phase
        self.host_reads.setdefault(phase, 0)

        class _Reads(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if name in HOST_READS or (name in HOST_COPIES and _device_to_host(name, args, kwargs)):
                    counter.host_reads[counter.phase] += 1
                return func(*args, **kwargs)

        cuda = self.device_syncs is not None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            previous = torch.cuda.get_sync_debug_mode() if cuda else 0
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with _Reads():
                    yield self
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(previous)
        if self.device_syncs is not None:
            syncs = sum(SYNC_WARNING in str(w.message) for w in caught)
            self.device_syncs[phase] = self.device_syncs.get(phase, 0) + syncs
        for w in caught:  # give back the warnings that were not ours
            if SYNC_WARNING not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _device_to_host(name: str, args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Is this ``cpu``/``to``/``copy_`` call a copy from a device into host memory?"""
    import torch

    if not args or not isinstance(args[0], torch.Tensor):
        return False
    if name == "copy_":
        dst, src = args[0], (args[1] if len(args) > 1 else kwargs.get("src"))
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst.device.type == "cpu"
    if args[0].device.type == "cpu":
        return False
    if name == "cpu":
        return True
    targets = [a for a in (*args[1:], kwargs.get("device")) if a is not None]
    return any(
        (isinstance(t, torch.Tensor) and t.device.type == "cpu") or (isinstance(t, (str, torch.device)) and torch.device(t).type == "cpu")
        for t in targets
        if isinstance(t, (str, torch.device, torch.Tensor))
    )


def host_barrier_group(dist: Any, ctx: Any) -> Any:
    """A gloo group for barriers around host-side measurements (``None``: the default group).

    A rank waiting in an NCCL barrier may spin a CPU core; one waiting in gloo sleeps in a socket
    read, so ranks that wait while another times the CPU or the host's memory leave it alone.
    """
    return dist.new_group(backend="gloo") if ctx.pg_backend != "gloo" else None


def device_name(device: Any) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return "cpu"


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


def yerr(rows: list[Mapping[str, Any]], key: str) -> Any:
    """Asymmetric error bars (median to min, median to max) for ``key``; NaN where not measured.
    The figures are rounded on their own, so where the trials all but agree a bound can pass the
    median by a rounding step: such a bar is 0, never negative (matplotlib refuses those)."""
    lo = [max(0.0, r[key] - r[f"{key}_min"]) if _num(r.get(key)) and _num(r.get(f"{key}_min")) else math.nan for r in rows]
    hi = [max(0.0, r[f"{key}_max"] - r[key]) if _num(r.get(key)) and _num(r.get(f"{key}_max")) else math.nan for r in rows]
    return [lo, hi]


def values(rows: list[Mapping[str, Any]], key: str) -> list[float]:
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
