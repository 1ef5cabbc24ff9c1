"""A job's own ``summarize`` and ``plot`` hooks, run once at the end of a run.

A workload module may define ``summarize(stages, params) -> dict`` (its numbers, a table and
conclusions in words) and ``plot(result, run_dir) -> list[str]`` (PNG files it wrote). The module
is the one the launcher already imported to check the job's params (``spec.entrypoint``), or is
imported here once; a hook that raises is noted in the result and never loses it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from launcher.spec.entrypoint import load_module


def workload_module(entrypoint: str | None, pythonpath: str = "") -> Any | None:
    """The entrypoint's module, for its hooks (None: no entrypoint, or no such module here)."""
    if not entrypoint:
        return None
    module = entrypoint.partition(":")[0]
    try:
        return load_module(module, pythonpath)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None  # not here: the ranks had it, the launcher's machine has not
        raise  # the module's own import failed: say so


def stage_views(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each stage of the result with its own ranks, as ``summarize`` receives them."""
    return [
        {**stage, "ranks": [r for r in result["ranks"] if r.get("world_size") == stage["world_size"]]}
        for stage in result["stages"]
    ]


def run_summarize(result: Mapping[str, Any], module: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    """The job's ``summarize`` output, or ``{"error": ...}`` when it raised."""
    hook = getattr(module, "summarize", None)
    if hook is None:
        return {}
    try:
        return dict(hook(stage_views(result), params))
    except Exception as exc:  # noqa: BLE001 - the workload's own code; the run's results stay
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_plot(result: Mapping[str, Any], module: Any, run_dir: Path) -> list[str]:
    hook = getattr(module, "plot", None)
    if hook is None or not result.get("ranks"):
        return []  # a failed run still plots whatever stages completed
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    return [str(p) for p in hook(result, run_dir)]


def make_plots(result: Mapping[str, Any], run_dir: Path, module: Any) -> tuple[tuple[str, ...], str | None]:
    """Render the job's plots (a job without a ``plot`` hook gets a line plot of its logged series
    per stage): their paths relative to ``run_dir``, and what a broken plot hook raised (None when
    none did; the plots made before it are kept)."""
    from launcher.results.series import plot_series

    extra = plot_series if getattr(module, "plot", None) is None else None
    plots: list[str] = []
    error = None
    try:
        plots = run_plot(result, module, run_dir)
        if extra is not None:
            plots += [str(p) for p in extra(result, run_dir)]
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's plot code may raise anything
        error = f"{type(exc).__name__}: {exc}"
    return tuple(os.path.relpath(p, run_dir) for p in plots), error
