"""Every ``ctx.metrics`` series as TensorBoard scalars, written once at the end of a run.

``result.json``'s ranks carry what each rank's recorder copied to the host at the end
(``metrics.values``: the logged series; ``metrics.times_ms``: the timers). This writes them under
``<run_dir>/tensorboard/world<N>/``, one TensorBoard run per world size, so

    tensorboard --logdir runs/

shows every run and stage (``<job>/<run-id>/tensorboard/world<N>``) next to each other:

- a logged series ``loss`` of rank ``k``: tag ``loss/rank<k>``, step = its index (0, 1, ...);
- a timer ``step`` of rank ``k``: tag ``time_ms/step/rank<k>``, in milliseconds.

Nothing happens per step (the ranks never see TensorBoard); ``tensorboard`` is an optional
extra: without it :func:`write_scalars` writes nothing and returns ``[]``.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import re
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

TIMES_PREFIX = "time_ms"


def available() -> bool:
    """Whether TensorBoard event files can be written here (``tensorboard`` is installed)."""
    return importlib.util.find_spec("tensorboard") is not None


def scalar_series(result: Mapping[str, Any]) -> dict[int, dict[str, list[float]]]:
    """``{world_size: {tag: values}}`` from a result document (pure; no TensorBoard needed).

    A rank reported twice for one world size (a restarted group) keeps its last report."""
    by_stage: dict[int, dict[int, Mapping[str, Any]]] = {}
    for report in result.get("ranks") or []:
        metrics = report.get("metrics") or {}
        world_size, rank = report.get("world_size"), report.get("rank")
        if not isinstance(world_size, int) or not isinstance(rank, int) or not metrics:
            continue
        by_stage.setdefault(world_size, {})[rank] = metrics
    out: dict[int, dict[str, list[float]]] = {}
    for world_size, ranks in sorted(by_stage.items()):
        tags: dict[str, list[float]] = {}
        for rank, metrics in sorted(ranks.items()):
            for name, values in (metrics.get("values") or {}).items():
                tags[f"{_tag(name)}/rank{rank}"] = _numbers(values)
            for name, values in (metrics.get("times_ms") or {}).items():
                tags[f"{TIMES_PREFIX}/{_tag(name)}/rank{rank}"] = _numbers(values)
        if tags:
            out[world_size] = tags
    return out


def write_scalars(result: Mapping[str, Any], run_dir: Path) -> list[Path]:
    """Write every rank's series of ``result`` under ``run_dir/tensorboard/world<N>``; returns the
    event files written (``[]`` without ``tensorboard`` or without series). Writing again replaces
    the earlier files (``launch report`` may re-render a run), never appends duplicates."""
    if not available():
        return []
    series = scalar_series(result)
    if not series:
        return []
    try:
        # TensorBoard's own event writer, not torch's SummaryWriter: the launcher never imports
        # torch (1.5 s of CPU at the end of every run, for a handful of scalars)
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:  # tensorboard present but unusable here (say, a protobuf it rejects)
        return []

    walltime = result.get("finished_at")
    walltime = float(walltime) if isinstance(walltime, numbers.Real) else time.time()
    written: list[Path] = []
    for world_size, tags in series.items():
        logdir = Path(run_dir) / "tensorboard" / f"world{world_size}"
        logdir.mkdir(parents=True, exist_ok=True)
        for old in logdir.glob("events.out.tfevents.*"):
            old.unlink()
        writer = EventFileWriter(str(logdir), max_queue_size=10_000, flush_secs=3600)
        try:
            for tag, values in tags.items():
                for step, value in enumerate(values):
                    summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
                    writer.add_event(Event(wall_time=walltime, step=step, summary=summary))
        finally:
            writer.close()
        written.extend(sorted(logdir.glob("events.out.tfevents.*")))
    return written


def _tag(name: str) -> str:
    """A TensorBoard tag component: the series name, with characters TensorBoard rewrites or
    shows oddly made plain (``/`` stays: it groups, as users expect of ``train/loss``)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.\-/]", "_", str(name)).strip("/")
    return cleaned or "_"


def _numbers(values: Iterable[Any]) -> list[float]:
    out = []
    for v in values or []:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            out.append(math.nan)  # keep the index: step k stays the k-th logged value
        else:
            out.append(float(v))
    return out
