"""The one run loop, shared by every backend, and the only place that decides a stage's fate.

start -> watch -> on the first failure, a timeout or a signal: stop everything -> collect
reports -> explain the root cause. Restarts (``max_restarts``) happen here too, so every
backend gets the same semantics.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from launcher.backends.base import Backend, BackendStatus, RankExit
from launcher.logstream import LogRouter, redact, secret_values
from launcher.plan import LaunchPlan
from launcher.procutil import read_json, stage_worker_pids, write_json_atomic

POLL_S = 0.05
# After the first rank's error report, how long the process layer may take to end by itself
# (an agent notices its dead worker and reports its exit code or signal) before we stop it all.
FAILURE_GRACE_S = 2.0
# Errors a rank raises because a *peer* died under it: collateral, never the root cause when a
# rank is known to have died without a report of its own.
PEER_LOSS = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|DistNetworkError|remote (process|peer|worker)"
    r"|communicator was aborted|NCCL.*(abort|Watchdog)|peer .*(closed|crashed|died|exited)",
    re.IGNORECASE,
)
STACK_DUMP_WAIT_S = 1.0
# Tries on a freshly chosen rendezvous port when another process took the one we chose before
# the agent bound it (not restarts: nothing of the job ran).
PORT_RETRIES = 3
LOG_TAIL_LINES = 20


class StopRequest:
    """Set from a signal handler (Ctrl-C, SIGTERM) or another thread; read by the run loop."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    def set(self, reason: str) -> None:
        self.reason = self.reason or reason
        self._event.set()

    def __bool__(self) -> bool:
        return self._event.is_set()


@dataclass
class StageOutcome:
    plan: LaunchPlan
    status: str  # succeeded | failed | timeout | interrupted
    started_at: float
    ended_at: float
    restarts: int = 0
    reports: list[dict[str, Any]] = field(default_factory=list)
    failure: dict[str, Any] | None = None
    rendezvous_port_in_use: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"


Progress = Callable[[LaunchPlan, dict[str, Any]], None]


def run_stage(
    make_plan: Callable[[int], LaunchPlan],
    backend_cls: type[Backend],
    *,
    stop: StopRequest,
    echo: Callable[[str, str], None] | None = None,
    on_progress: Progress | None = None,
) -> StageOutcome:
    """Run one stage to its end, restarting the group up to ``max_restarts`` times."""
    attempt = port_retries = 0
    started = time.time()
    while True:
        plan = make_plan(attempt)  # a freshly chosen rendezvous port every time
        outcome = _run_attempt(plan, backend_cls, stop=stop, echo=echo, on_progress=on_progress)
        outcome.started_at, outcome.restarts = started, attempt
        if outcome.rendezvous_port_in_use and port_retries < PORT_RETRIES and not stop:
            port_retries += 1
            _archive_attempt(plan.stage_dir, f"port-retry{port_retries}")
            if echo:
                echo("launcher", f"rendezvous port {plan.master_port} was taken before the agent bound it; trying another")
            continue
        if outcome.ok or outcome.status != "failed" or attempt >= plan.max_restarts or stop:
            return outcome
        attempt += 1
        _archive_attempt(plan.stage_dir, f"attempt{attempt - 1}")
        if echo:
            echo("launcher", f"restarting the group (restart {attempt} of {plan.max_restarts})")


def _archive_attempt(stage_dir: Path, folder: str) -> None:
    for name in ("reports", "progress", "logs"):
        src = stage_dir / name
        if src.exists():
            shutil.move(str(src), str(stage_dir / folder / name))


def _run_attempt(
    plan: LaunchPlan,
    backend_cls: type[Backend],
    *,
    stop: StopRequest,
    echo: Callable[[str, str], None] | None,
    on_progress: Progress | None,
) -> StageOutcome:
    (plan.stage_dir / "reports").mkdir(parents=True, exist_ok=True)
    (plan.stage_dir / "worker.json").write_text(plan.worker.to_json())
    secrets = secret_values(plan.spec_env)
    logs = LogRouter(plan.stage_dir / "logs", echo, secrets=secrets)
    backend = backend_cls(plan, logs)
    t0 = time.time()
    deadline = time.monotonic() + plan.run_timeout_s
    status: BackendStatus | None = None
    fate = "succeeded"
    failed_at: float | None = None
    try:
        backend.start()
        while True:
            status = backend.poll()
            if status.done:
                fate = "succeeded" if status.ok else "failed"
                break
            errors = _rank_errors(plan)
            if any(not _peer_loss(e) for e in errors):
                fate = "failed"  # fail fast: do not wait for the others' collective timeouts
                break
            if errors and failed_at is None:
                # only "a peer is gone" so far: let the agent report which rank died, and how
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
                fate = "failed"
                break
            if stop:
                fate = "interrupted"
                break
            if time.monotonic() > deadline:
                fate = "timeout"
                _dump_stacks(plan)
                break
            if on_progress is not None:
                on_progress(plan, progress_snapshot(plan, t0))
            time.sleep(POLL_S)
    finally:
        backend.stop()
        backend.collect()
        logs.close()
    if status is None or not status.done:
        status = backend.poll()
    _scrub_files(plan.stage_dir / "torchelastic", secrets)  # torchrun's raw copies of the logs
    reports = _load_reports(plan, secrets)
    outcome = StageOutcome(plan=plan, status=fate, started_at=t0, ended_at=time.time(), reports=reports)
    if fate == "succeeded" and any(r["status"] != "ok" for r in reports):
        outcome.status = fate = "failed"
    if fate != "succeeded":
        outcome.failure = explain_failure(plan, fate, reports, status, stop.reason)
        outcome.rendezvous_port_in_use = bool(status.extra.get("rendezvous_port_in_use"))
    return outcome


def _rank_errors(plan: LaunchPlan) -> list[dict[str, Any]]:
    """The errors of the ranks that have reported a failure so far."""
    errors = []
    for path in (plan.stage_dir / "reports").glob("rank*.json"):
        report = read_json(path)
        if report and report.get("status") == "failed":
            errors.append(report.get("error") or {})
    return errors


def progress_snapshot(plan: LaunchPlan, t0: float) -> dict[str, Any]:
    phases: dict[str, int] = {}
    steps = []
    for rank in plan.ranks:
        data = read_json(plan.stage_dir / "progress" / f"rank{rank.rank}.json") or {}
        phase = data.get("phase", "spawning")
        phases[phase] = phases.get(phase, 0) + 1
        steps.append(int(data.get("steps", 0)))
    return {"phases": phases, "steps_min": min(steps, default=0), "steps_max": max(steps, default=0), "elapsed_s": time.time() - t0}


def _dump_stacks(plan: LaunchPlan) -> None:
    """Ask every live local rank for a faulthandler stack dump (it lands in the rank's log)."""
    for pid in stage_worker_pids(plan.stage_dir).values():
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(STACK_DUMP_WAIT_S)


def _scrub_files(root: Path, secrets: tuple[str, ...]) -> None:
    """Mask secret env values in files written outside the LogRouter (best effort)."""
    if not secrets or not root.is_dir():
        return
    for path in root.rglob("*"):
        try:
            if not path.is_file():
                continue
            text = path.read_text(errors="replace")
            masked = redact(text, secrets)
            if masked != text:
                tmp = path.with_name(f".{path.name}.scrub")
                tmp.write_text(masked)
                os.replace(tmp, path)
        except OSError:
            continue


def _mask_report(report: dict[str, Any], path: str, secrets: tuple[str, ...]) -> dict[str, Any]:
    """A report whose text (an exception message, a result) holds a secret is masked on disk too."""
    if not secrets:
        return report
    text = json.dumps(report, default=str)
    masked = redact(text, tuple(json.dumps(v)[1:-1] for v in secrets))
    if masked == text:
        return report
    report = json.loads(masked)
    write_json_atomic(path, report)
    return report


def _load_reports(plan: LaunchPlan, secrets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    reports = []
    for rank in plan.ranks:
        report = read_json(rank.report_path)
        if report is not None:
            report = _mask_report(report, rank.report_path, secrets)
        if report is None:
            progress = read_json(plan.stage_dir / "progress" / f"rank{rank.rank}.json") or {}
            report = {
                "rank": rank.rank,
                "local_rank": rank.local_rank,
                "node_rank": rank.node_rank,
                "world_size": plan.world_size,
                "host": rank.host,
                "device": rank.device,
                "status": "stopped",
                "last_phase": progress.get("phase", "spawning"),
                "phases": {},
                "metrics": {},
                "error": None,
            }
        report["log"] = rank.log_path
        reports.append(report)
    return reports


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        return Path(path).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def explain_failure(
    plan: LaunchPlan, fate: str, reports: list[dict[str, Any]], status: BackendStatus, stop_reason: str
) -> dict[str, Any]:
    """The root cause (first failure) apart from the ranks stopped as collateral."""
    by_rank = {r["rank"]: r for r in reports}
    errored = sorted((r for r in reports if r.get("error")), key=lambda r: r["error"].get("time", 0))
    exits = {e.rank: e for e in status.rank_exits}
    # ranks that died without a Python exception of their own: os._exit, a signal, the OOM killer
    died = [e for e in exits.values() if (e.signal or e.exitcode) and not by_rank.get(e.rank, {}).get("error")]
    # (in the backend's order: first the ranks that failed on their own, then those their agent stopped)
    root: dict[str, Any] | None = None
    if fate == "failed" and errored and not (died and _peer_loss(errored[0]["error"])):
        first = errored[0]
        root = {**_who(first), **{k: first["error"][k] for k in ("type", "message", "traceback")}}
    elif fate == "failed" and died:
        first_exit = died[0]
        root = {**_who(by_rank.get(first_exit.rank, {"rank": first_exit.rank})), **_describe_exit(first_exit)}
    elif fate == "failed" and errored:
        first = errored[0]
        root = {**_who(first), **{k: first["error"][k] for k in ("type", "message", "traceback")}}
    if root is not None:
        root["log_tail"] = log_tail(by_rank.get(root["rank"], {}).get("log", ""))
    stuck = [r["rank"] for r in reports if r["status"] not in ("ok", "failed")] if fate == "timeout" else []
    collateral = [r["rank"] for r in reports if r["status"] != "ok" and (root is None or r["rank"] != root["rank"])]
    summary = {
        "failed": _root_line(root) if root else status.detail or "the group ended without a rank report",
        "timeout": f"run exceeded timeouts.run_s={plan.run_timeout_s:g}s; stuck ranks: {stuck or 'none'}",
        "interrupted": f"interrupted ({stop_reason or 'signal'})",
    }[fate]
    return {"reason": fate, "summary": summary, "root_cause": root, "collateral_ranks": collateral, "stuck_ranks": stuck}


def _peer_loss(error: dict[str, Any]) -> bool:
    return bool(PEER_LOSS.search(f"{error.get('type', '')}: {error.get('message', '')}"))


def _who(report: dict[str, Any]) -> dict[str, Any]:
    return {k: report.get(k) for k in ("host", "rank", "local_rank", "device")}


def _describe_exit(rank_exit: RankExit) -> dict[str, Any]:
    if rank_exit.signal:
        oom = " (out of memory: killed by the kernel's OOM killer)" if rank_exit.oom_suspected else ""
        message = f"killed by {rank_exit.signal}{oom}"
        kind = "OutOfMemoryKill" if rank_exit.oom_suspected else "KilledBySignal"
    else:
        message = f"exited with code {rank_exit.exitcode} without raising a Python exception"
        kind = "ProcessExit"
    return {"type": kind, "message": message, "traceback": "", "exitcode": rank_exit.exitcode, "signal": rank_exit.signal}


def _root_line(root: dict[str, Any]) -> str:
    return f"rank {root['rank']} on {root['host']} ({root['device']}): {root['type']}: {root['message']}"
