"""A submitted run's result once its job has ended: the one the launcher inside wrote, or, when
it could not write one (its node was lost, the job was cancelled before it ran, the time limit
came first), one written here from what Slurm says about the job."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from launcher.backends.slurm import commands
from launcher.backends.slurm.script import RECORD_FILE, output_path
from launcher.errors import LauncherError
from launcher.procutil import read_json
from launcher.records import Failure, FailureReason
from launcher.results.aggregate import aggregate
from launcher.results.store import RunResult, load_result, write_result
from launcher.stage.watch import RunEvents

def finish(
    run_dir: Path, job_id: str, state: commands.JobState | None, interrupted: str | None, events: RunEvents, *, lost: str | None = None,
    written_after: float | None = None, requeued: bool = False,
) -> RunResult:
    """The run's result once its job has ended: the one the launcher inside wrote, else one
    written here from the job's final state; ``events.finished`` shows it."""
    data = settle(run_dir, job_id, state, interrupted, lost=lost, written_after=written_after, requeued=requeued)
    result = RunResult(data, run_dir, tuple(str(run_dir / p) for p in data.get("plots", [])))
    events.finished(result)
    return result


def settle(
    run_dir: Path, job_id: str, state: commands.JobState | None, interrupted: str | None = None, *, lost: str | None = None,
    written_after: float | None = None, requeued: bool = False,
) -> dict[str, Any]:
    """``result.json`` of an ended job, written here when the launcher inside could not.
    ``written_after``: when a requeued job was seen running again; a result finished before then
    is an earlier allocation's, not the last one's. ``requeued``: the job was requeued and did
    not run again (stopped in the queue): the run was interrupted, whatever the allocation
    before wrote (its record of stages and ranks is kept)."""
    data = load_result(run_dir)
    if data is not None and written_after is not None and float(data.get("finished_at") or 0) < written_after:
        data = None
    if data is None:
        reason, summary = explain_end(job_id, state, interrupted, output_path(run_dir, job_id), lost)
        record = read_json(run_dir / RECORD_FILE) or {}
        spec = yaml.safe_load((run_dir / "spec.yaml").read_text()) if (run_dir / "spec.yaml").is_file() else {}
        ended = aggregate(
            [], job=record.get("job", run_dir.parent.name), run_id=run_dir.name, backend="slurm", spec=spec or {},
            spec_hash=record.get("spec_hash", ""), params=record.get("params", {}), started_at=record.get("submitted_at", time.time()),
            cut_short=Failure(reason, summary),
        )  # fmt: skip
        data = replace(ended, run_dir=str(run_dir)).to_dict()
    elif interrupted and requeued and data.get("status") != "succeeded":
        summary = f"interrupted ({interrupted}; Slurm job {job_id} cancelled while requeued, before it ran again)"
        data = {**data, "status": "interrupted", "failure": Failure(FailureReason.INTERRUPTED, summary).to_dict()}
    elif interrupted and data.get("status") == "interrupted" and data.get("failure"):
        data = {**data, "failure": {**data["failure"], "summary": f"interrupted ({interrupted}; Slurm job {job_id} cancelled)"}}
    if state is not None:
        data = {**data, "slurm": {"job_id": job_id, "state": state.state, "exit_code": state.exit_code, "nodes": state.nodes, "restarts": state.restarts}}
    write_result(run_dir, data)
    return data


def explain_end(
    job_id: str, state: commands.JobState | None, interrupted: str | None, output: Path, lost: str | None = None
) -> tuple[FailureReason, str]:
    """Why a job ended without the launcher inside writing its result."""
    what = f"Slurm job {job_id}"
    if lost:
        how = "cancelled" if state is None or state.state in ("CANCELLED", "COMPLETING") else _ended(state)
        return FailureReason.FAILED, f"lost node {lost}, the job's batch host: the launcher inside went with it ({what} {how})"
    if interrupted:
        return FailureReason.INTERRUPTED, f"interrupted ({interrupted}; {what} cancelled{' before it ran' if not output.exists() else ''})"
    if state is None:
        return FailureReason.FAILED, f"{what} ended without a result, and Slurm no longer knows how (see {output})"
    if state.state == "NODE_FAIL":
        lost = _lost_nodes(state.nodes)
        return FailureReason.FAILED, f"{what} ended NODE_FAIL: lost node {lost or state.nodes} (the launcher's batch host {state.batch_host or '?'} went with it)"
    if state.state == "TIMEOUT":
        return FailureReason.TIMEOUT, f"{what} reached its Slurm time limit (slurm.time) before the launcher inside wrote its result"
    if state.state in ("CANCELLED", "PREEMPTED", "DEADLINE"):
        return FailureReason.INTERRUPTED, f"{what} was {state.state.lower()} ({state.reason or 'scancel'})"
    killed = state.exit_code.partition(":")[2] not in ("", "0")  # the batch script ended by a signal (0:9)
    down = _lost_nodes(state.batch_host) if state.state == "FAILED" and killed and state.batch_host else ""
    if down:  # its batch script killed with its node, reported ended a moment before the node went
        return FailureReason.FAILED, f"lost node {down}, the job's batch host: the launcher inside went with it ({what} {_ended(state)})"
    errors = [ln for ln in _tail_lines(output) if ln.startswith("error:") or "Error" in ln]
    said = f": {errors[-1]}" if errors else f" (see {output})"
    return FailureReason.FAILED, f"{what} ended {state.state} (exit code {state.exit_code or '?'}) without the launcher inside writing a result{said}"


def _ended(state: commands.JobState) -> str:
    return f"ended {state.state}, exit code {state.exit_code or '?'}"


def _lost_nodes(nodelist: str) -> str:
    try:
        records = commands.node_records(commands.hostnames(nodelist)) if nodelist else {}
    except LauncherError:
        return ""
    down = [f"{name} ({rec.get('State', '?')}{', ' + rec['Reason'] if rec.get('Reason') not in (None, '', '(null)') else ''})"
            for name, rec in records.items() if any(s in rec.get("State", "") for s in ("DOWN", "NOT_RESPONDING", "FAIL"))]  # fmt: skip
    return ", ".join(down)


def _tail_lines(path: Path, lines: int = 40) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []
