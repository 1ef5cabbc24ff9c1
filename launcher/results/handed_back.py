"""A submitted run's result, made from what its submitter handed back (``SubmittedRun``): the
``result.json`` the launcher inside the scheduler's job wrote, completed with the scheduler's
words (an interruption from here, its own record of the job), or, where the launcher inside wrote
none (its node lost, the job cancelled before it ran, the time limit first), one made here from
how the scheduler saw the job end. Written back to ``result.json``; the submitters read and write
no result themselves."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from launcher.records import AsSubmitted, SubmittedRun
from launcher.results.aggregate import aggregate
from launcher.results.store import RunResult, load_result, write_result

WHOLE = ("job", "status", "stages", "ranks")  # what a result.json the launcher inside finished has


def result_of(run: SubmittedRun) -> RunResult | None:
    """The run's result (written to ``result.json`` once the run has ended); None when no whole
    result came back and the scheduler cannot say why (``run.ended_without`` is None): the
    submitter explains that itself."""
    if run.run_dir is None:
        return None
    if run.pending_hint is not None:
        return RunResult(pending(run), run.run_dir)
    data = settled(run)
    if data is None:
        return None
    write_result(run.run_dir, data)
    return RunResult(data, run.run_dir, tuple(str(run.run_dir / p) for p in data.get("plots", [])))


def pending(run: SubmittedRun) -> dict[str, Any]:
    """A run submitted and not followed (``--detach``): what its result says until it ends."""
    data: dict[str, Any] = {"job": run.job, "run_id": run.run_id, "backend": run.backend, "status": "pending", "job_id": run.job_id,
                            "run_dir": str(run.run_dir)}  # fmt: skip
    if run.scheduler_address:
        data["address"] = run.scheduler_address
    return {**data, "hint": run.pending_hint}


def settled(run: SubmittedRun) -> dict[str, Any] | None:
    """The ended run's result document: the one the launcher inside wrote for this allocation,
    with the scheduler's words added, or one made from ``run.ended_without``."""
    assert run.run_dir is not None
    data = load_result(run.run_dir)
    if data is not None and (any(k not in data for k in WHOLE) or _stale(data, run.stale_before)):
        data = None
    if data is None:
        if run.ended_without is None:
            return None
        given = run.submitted or AsSubmitted({}, "", {}, None)
        started = given.at if given.at is not None else time.time()
        ended = aggregate([], job=run.job, run_id=run.run_id, backend=run.backend, spec=dict(given.spec), spec_hash=given.spec_hash,
                          params=dict(given.params), started_at=started, cut_short=run.ended_without)  # fmt: skip
        data = replace(ended, run_dir=str(run.run_dir)).to_dict()
    elif run.interrupted is not None and run.interrupted_before_rerun and data.get("status") != "succeeded":
        data = {**data, "status": "interrupted", "failure": run.interrupted.to_dict()}
    elif run.interrupted is not None and data.get("status") == "interrupted" and data.get("failure"):
        data = {**data, "failure": {**data["failure"], "summary": run.interrupted.summary}}
    if run.brought_back:
        data = {**data, "run_dir": str(run.run_dir)}  # where it is now, not the cluster's directory
    if run.scheduler:
        data = {**data, run.backend: dict(run.scheduler)}
    return data


def _stale(data: dict[str, Any], since: float | None) -> bool:
    """An earlier allocation's result (finished before the job last ran again)."""
    return since is not None and float(data.get("finished_at") or 0) < since
