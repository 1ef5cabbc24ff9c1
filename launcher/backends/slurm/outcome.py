"""A submitted run's record once its job has ended (``SubmittedRun``): how Slurm saw the job end,
and, should the launcher inside have written no result (its node was lost, the job was cancelled
before it ran, the time limit came first), why, in Slurm's words. The results layer makes the run's
result from it (``launcher.results.handed_back``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from launcher.backends.slurm import commands
from launcher.backends.slurm.script import RECORD_FILE, output_path
from launcher.errors import LauncherError
from launcher.procutil import read_json
from launcher.records import AsSubmitted, Failure, FailureReason, SubmittedRun
from launcher.stage.engine import settle_submitted


def ended_run(
    run_dir: Path, job_id: str, state: commands.JobState | None, interrupted: str | None = None, *, lost: str | None = None,
    written_after: float | None = None, requeued: bool = False,
) -> SubmittedRun:
    """The ended job's record. ``written_after``: when a requeued job was seen running again; a
    result finished before then is an earlier allocation's, not the last one's. ``requeued``: the
    job was requeued and did not run again (stopped in the queue): the run was interrupted,
    whatever the allocation before wrote (its record of stages and ranks is kept)."""
    reason, summary = explain_end(job_id, state, interrupted, output_path(run_dir, job_id), lost)
    record = read_json(run_dir / RECORD_FILE) or {}
    spec = yaml.safe_load((run_dir / "spec.yaml").read_text()) if (run_dir / "spec.yaml").is_file() else {}
    stopped = None
    if interrupted and requeued:
        stopped = Failure(FailureReason.INTERRUPTED, f"interrupted ({interrupted}; Slurm job {job_id} cancelled while requeued, before it ran again)")
    elif interrupted:
        stopped = Failure(FailureReason.INTERRUPTED, f"interrupted ({interrupted}; Slurm job {job_id} cancelled)")
    scheduler = {} if state is None else {"job_id": job_id, "state": state.state, "exit_code": state.exit_code, "nodes": state.nodes,
                                          "restarts": state.restarts}  # fmt: skip
    return SubmittedRun(
        "slurm", str(record.get("job", run_dir.parent.name)), run_dir.name, run_dir, job_id=job_id, state=state.state if state else "",
        stale_before=written_after, ended_without=Failure(reason, summary), interrupted=stopped, interrupted_before_rerun=requeued,
        scheduler=scheduler, submitted=AsSubmitted(spec or {}, str(record.get("spec_hash", "")), record.get("params", {}), record.get("submitted_at")),
    )  # fmt: skip


def settle(
    run_dir: Path, job_id: str, state: commands.JobState | None, interrupted: str | None = None, *, lost: str | None = None,
    written_after: float | None = None, requeued: bool = False,
) -> dict[str, Any]:
    """``result.json`` of an ended job (``launch status`` and ``launch stop`` of a Slurm job id), as
    the results layer makes it through the seam (``settle_submitted``) from ``ended_run``'s record."""
    result = settle_submitted(ended_run(run_dir, job_id, state, interrupted, lost=lost, written_after=written_after, requeued=requeued))
    assert result is not None  # Slurm always says why a job ended
    return dict(result.data)


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
