"""Aggregate rank reports into the run's result: a pure ``aggregate`` plus ``result.json`` I/O.

A workload module may add two hooks, imported only here, at the end of the run:
``summarize(stages, params) -> dict`` (its numbers, a table and conclusions in words) and
``plot(result, run_dir) -> list[str]`` (PNG files it wrote).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Mapping

from launcher.procutil import read_json, write_json_atomic
from launcher.supervisor import StageOutcome

SCHEMA_VERSION = 1
RESULT_FILE = "result.json"
PHASES = ("spawn", "import", "rendezvous", "pg_init", "run")
# each phase ends at a rank's stamp: spawned (the process exists), imported (torch and the job's
# code), joined (every rank reached the rendezvous), pg_ready (process group up), finished
_PHASE_ENDS = tuple(zip(PHASES, ("spawned", "imported", "joined", "pg_ready", "finished")))
_ENTRYPOINT_ONLY = ("rendezvous", "pg_init")


@dataclass(frozen=True)
class RunResult:
    """What ``run_job`` returns and ``result.json`` holds."""

    data: Mapping[str, Any]
    run_dir: Path
    plots: tuple[str, ...] = field(default_factory=tuple)

    @property
    def status(self) -> str:
        return self.data["status"]

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"

    @property
    def path(self) -> Path:
        return self.run_dir / RESULT_FILE

    def __getitem__(self, key: str) -> Any:
        return self.data[key]


def stage_phases(started_at: float, reports: list[dict[str, Any]], *, script: bool = False) -> dict[str, float | None]:
    """Where a stage's start-up time went, from the slowest rank at each step (seconds). A phase
    no rank finished is where the ranks stopped (a rendezvous that timed out): it runs to the
    end and the phases after it are None. A script joins the group inside its own run, so its
    rendezvous and pg_init are None too."""

    def latest(name: str) -> float | None:
        stamps = [r["phases"][name] for r in reports if name in r.get("phases", {})]
        return max(stamps) if stamps else None

    out: dict[str, float | None] = {}
    prev: float | None = started_at
    stopped = False
    for phase, stamp in _PHASE_ENDS:
        if stopped or (script and phase in _ENTRYPOINT_ONLY):
            out[phase] = None
            continue
        end = latest(stamp)
        if end is None:
            end, stopped = latest("finished"), True
        out[phase] = None if end is None or prev is None else round(max(0.0, end - prev), 4)
        prev = end
    first = [r["phases"]["first_step"] for r in reports if "first_step" in r.get("phases", {})]
    out["to_first_step"] = round(max(first) - started_at, 4) if first else None
    return out


def _rank_entry(report: dict[str, Any], started_at: float) -> dict[str, Any]:
    entry = dict(report)
    entry["timeline_s"] = {k: round(v - started_at, 4) for k, v in report.get("phases", {}).items()}
    return entry


def aggregate(
    stages: list[StageOutcome],
    *,
    job: str,
    run_id: str,
    backend: str,
    spec: Mapping[str, Any],
    spec_hash: str,
    entrypoint: str | None,
    params: Mapping[str, Any],
    started_at: float,
    pythonpath: str = "",
) -> dict[str, Any]:
    """Pure: stage outcomes in, the result document out (without plots and the aggregate phase)."""
    stage_docs, ranks = [], []
    for stage in stages:
        phases = stage_phases(stage.started_at, stage.reports, script=stage.plan.worker.script is not None)
        stage_docs.append(
            {
                "world_size": stage.plan.world_size,
                "status": stage.status,
                "restarts": stage.restarts,
                "wall_s": round(stage.ended_at - stage.started_at, 4),
                "phases": phases,
                "failure": stage.failure,
            }
        )
        ranks.extend(_rank_entry(r, stage.started_at) for r in stage.reports)
    failed = next((s for s in stages if not s.ok), None)
    status = "succeeded" if stages and failed is None else (failed.status if failed else "failed")
    totals = {p: round(sum(s["phases"][p] or 0.0 for s in stage_docs), 4) for p in PHASES}
    result: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "job": job,
        "run_id": run_id,
        "backend": backend,
        "status": status,
        "world_size": max((s["world_size"] for s in stage_docs), default=0),
        "world_sizes": [s["world_size"] for s in stage_docs],
        "spec_hash": spec_hash,
        "spec": dict(spec),
        "params": dict(params),  # what the ranks ran with, the workload's defaults included
        "started_at": started_at,
        "finished_at": time.time(),
        "wall_s": round(time.time() - started_at, 4),
        "phases": totals,
        "restarts": sum(s["restarts"] for s in stage_docs),
        "stages": stage_docs,
        "ranks": ranks,
        "failure": failed.failure if failed else None,
        "summary": {},
    }
    result["summary"] = summarize(result, entrypoint, params, pythonpath)
    if "scaling" in result["summary"]:
        result["scaling"] = result["summary"]["scaling"]
    return result


def workload_module(entrypoint: str | None, pythonpath: str = "") -> Any | None:
    """The entrypoint's module, for its ``summarize`` and ``plot`` hooks (None: no such module)."""
    if not entrypoint:
        return None
    from launcher.entrypoint import load_module

    module = entrypoint.partition(":")[0]
    try:
        return load_module(module, pythonpath)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return None  # not here: the ranks had it, the launcher's machine has not
        raise  # the module's own import failed: say so


def summarize(result: dict[str, Any], entrypoint: str | None, params: Mapping[str, Any], pythonpath: str = "") -> dict[str, Any]:
    stages = [
        {**stage, "ranks": [r for r in result["ranks"] if r.get("world_size") == stage["world_size"]]}
        for stage in result["stages"]
    ]
    summary: dict[str, Any] = {"steps_per_rank": _steps_summary(result["ranks"])}
    try:
        module = workload_module(entrypoint, pythonpath)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the workload's own import; the run's results stay
        summary["error"] = f"importing the workload: {type(exc).__name__}: {exc}"
        return summary
    hook = getattr(module, "summarize", None)
    if hook is not None:
        try:
            summary.update(hook(stages, params))
        except Exception as exc:  # noqa: BLE001 - the workload's own code; the run's results stay
            summary["error"] = f"{type(exc).__name__}: {exc}"
    return summary


def _steps_summary(ranks: list[dict[str, Any]]) -> float | None:
    steps = [r.get("metrics", {}).get("steps") for r in ranks if r.get("metrics")]
    steps = [s for s in steps if isinstance(s, int)]
    return median(steps) if steps else None


def make_plots(result: Mapping[str, Any], run_dir: Path, entrypoint: str | None, pythonpath: str = "") -> list[str]:
    hook = getattr(workload_module(entrypoint, pythonpath), "plot", None)
    if hook is None or not result.get("ranks"):
        return []  # a failed run still plots whatever stages completed
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    return [str(p) for p in hook(result, run_dir)]


def attach_plots(result: dict[str, Any], run_dir: Path, entrypoint: str | None, pythonpath: str = "") -> list[str]:
    """Render the job's plots and list them in ``result["plots"]``; a broken plot hook is noted
    in ``result["plot_error"]`` and never loses the results."""
    try:
        plots = make_plots(result, run_dir, entrypoint, pythonpath)
        result.pop("plot_error", None)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's plot code may raise anything
        plots = []
        result["plot_error"] = f"{type(exc).__name__}: {exc}"
    result["plots"] = [os.path.relpath(p, run_dir) for p in plots]
    return plots


def write_result(run_dir: Path, result: dict[str, Any]) -> Path:
    path = run_dir / RESULT_FILE
    write_json_atomic(path, result)
    return path


def load_result(run_dir: str | Path) -> dict[str, Any] | None:
    return read_json(Path(run_dir) / RESULT_FILE)
