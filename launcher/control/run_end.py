"""The end of a run: aggregate the stages' outcomes into the run's record, the job's summary,
plots and TensorBoard scalars, then ``result.json``; and the effective spec as the run directory
keeps it (secrets masked)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from launcher.control import cpuclock
from launcher.masking import mask_env
from launcher.records import Failure, PreflightRecord, SkippedWorld, StageOutcome
from launcher.results.aggregate import aggregate
from launcher.results.hooks import make_plots, run_summarize, workload_module
from launcher.results.run_record import RunRecord
from launcher.results.series import default_summary
from launcher.results.store import RunResult, load_result, write_result
from launcher.spec.model import LoadedJob
from launcher.stage.watch import RunEvents


def masked_spec(job: LoadedJob) -> dict[str, Any]:
    """The effective spec as stored in the run directory and result.json: secrets masked."""
    effective = job.spec.model_dump(mode="json")
    effective["env"] = mask_env(effective["env"])
    return effective

def finish_run(
    loaded: LoadedJob,
    backend_name: str,
    run_id: str,
    run_dir: Path,
    outcomes: list[StageOutcome],
    started: float,
    events: RunEvents,
    *,
    cut_short: Failure | None = None,
    preflight: PreflightRecord | None = None,
    skipped: Sequence[SkippedWorld] = (),
) -> RunResult:
    """Aggregate, summarise, plot, write result.json and tell the watcher. ``cut_short``: the
    failure when a stage could not start, or a stop came between stages. The record is built
    once and every addition makes a new one; the document is made from it at the end."""
    t_agg = time.time()
    record = aggregate(
        outcomes, job=loaded.spec.name, run_id=run_id, backend=backend_name, spec=masked_spec(loaded),
        spec_hash=loaded.spec.fingerprint(), params=loaded.params, started_at=started, cut_short=cut_short,
        previous=load_result(run_dir),  # a run resumed: its record so far, every attempt of it kept
    )  # fmt: skip
    module, summary = _summary(loaded, record)
    record = replace(record, run_dir=str(run_dir), summary=summary, preflight=preflight, skipped_worlds=tuple(skipped))
    document = record.to_dict()  # what the job's plot hook and TensorBoard read, as they always have
    plots, plot_error = make_plots(document, run_dir, module)
    tensorboard, tensorboard_error = _write_tensorboard(document, run_dir)
    record = replace(
        record, plots=plots, plot_error=plot_error, tensorboard=tensorboard, tensorboard_error=tensorboard_error,
        phases={**record.phases, "aggregate": round(time.time() - t_agg, 4)},
    )  # fmt: skip
    record = replace(record, launcher_cpu=cpuclock.record())  # up to here: the launcher's own CPU by phase
    write_result(run_dir, record)
    run = RunResult.of(record, run_dir)
    events.finished(run)
    return run

def _summary(loaded: LoadedJob, record: RunRecord) -> tuple[Any, dict[str, Any]]:
    """The job's module (for its hooks) and the run's summary: the aggregate's figures, the job's
    ``summarize`` output, or for a job without one, every series its ranks logged."""
    summary = dict(record.summary)
    module, error = _workload_module(loaded)
    if error:
        summary["error"] = error
    document = record.to_dict()
    summary.update(run_summarize(document, module, loaded.params))
    if getattr(module, "summarize", None) is None:  # no hooks: every logged series, per rank
        summary.update(default_summary(document))
    return module, summary

def _write_tensorboard(result: Mapping[str, Any], run_dir: Path) -> tuple[str | None, str | None]:
    """Every ``ctx.metrics`` series as TensorBoard scalars, once, at the end (``tensorboard
    --logdir runs/``): their directory relative to the run's, or what went wrong; nothing when the
    optional ``tensorboard`` package is not installed."""
    from launcher.results.tensorboard import write_scalars

    try:
        written = write_scalars(result, run_dir)
    except Exception as exc:  # noqa: BLE001 - an optional extra must never cost the run its results
        return None, f"{type(exc).__name__}: {exc}"
    return ("tensorboard" if written else None), None

def _workload_module(loaded: LoadedJob) -> tuple[Any, str | None]:
    """The job's module for its hooks (found on the spec's PYTHONPATH too), or what its own import
    raised: noted in the summary, and the run's results stay."""
    try:
        return workload_module(loaded.spec.entrypoint, loaded.spec.env.get("PYTHONPATH", "")), None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the workload's own import
        return None, f"importing the workload: {type(exc).__name__}: {exc}"
