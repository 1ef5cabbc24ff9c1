"""Why a stage failed: the root cause (the first failure) apart from the ranks it took with it.

Pure: reports and what the process layer saw in, one ``Failure`` record out. torchelastic's idea
(an error file per worker, the first one is the root cause), without a decorator in user code and
with the peers that died of the loss told apart from the rank that caused it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from launcher.protocol import HOST_LOST, RankReport, RankStatus, is_peer_loss
from launcher.records import Failure, FailureReason, RankExit, RootCause

LOG_TAIL_LINES = 20
# a rank on the CPU whose code reached for CUDA or NCCL (a script written for a GPU box)
CUDA_ON_CPU = re.compile(r"_cuda_setDevice|torch\.cuda|CUDA|NCCL|nccl|Torch not compiled with CUDA", re.IGNORECASE)
CUDA_ON_CPU_HINT = (
    "this rank ran on the CPU (no GPU visible here) and the job's code uses CUDA or NCCL: run it where "
    "GPUs are, or let it follow the device it is given (ctx.device, or cuda only if torch.cuda.is_available(), with gloo)"
)


def log_tail(path: str | None, lines: int = LOG_TAIL_LINES) -> tuple[str, ...]:
    if not path:
        return ()
    try:
        return tuple(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ()


def explain_failure(
    reason: FailureReason,
    reports: Sequence[RankReport],
    rank_exits: Sequence[RankExit],
    *,
    detail: str = "",
    run_timeout_s: float = 0.0,
    stop_reason: str = "",
) -> Failure:
    """The root cause (first failure) apart from the collateral. ``detail``: what the backend
    said when no rank report explains the failure (an agent's exit, a lost actor)."""
    root = find_root_cause(reports, rank_exits) if reason == FailureReason.FAILED else None
    stuck = tuple(r.rank for r in reports if r.status not in (RankStatus.OK, RankStatus.FAILED)) if reason == FailureReason.TIMEOUT else ()
    # the ranks of a lost host were lost with it: neither the root cause nor collateral
    lost = {r.rank: r.host for r in reports if r.error is not None and r.error.type == HOST_LOST}
    if reason == FailureReason.INTERRUPTED:
        collateral: tuple[int, ...] = ()  # a stop is nobody's fault: nothing is "collateral"
    else:  # a stuck rank is named as stuck, not as collateral
        collateral = tuple(
            r.rank for r in reports if not r.ok and r.rank not in stuck and r.rank not in lost and (root is None or r.rank != root.rank)
        )
    if root is not None and root.type == HOST_LOST:
        failed = _lost_hosts(root, reports, lost)
    else:
        failed = root.line() if root else detail or "the group ended without a rank report"
    summary = {
        FailureReason.FAILED: failed,
        FailureReason.TIMEOUT: f"run exceeded timeouts.run_s={run_timeout_s:g}s; stuck ranks: {list(stuck) or 'none'}",
        FailureReason.INTERRUPTED: f"interrupted ({stop_reason or 'signal'})",
        FailureReason.NOT_STARTED: detail,
    }[reason]
    return Failure(reason, summary, root, collateral, stuck)


def _lost_hosts(root: RootCause, reports: Sequence[RankReport], lost: dict[int, str]) -> str:
    """``lost host h2 (no answer for 5 s): ranks [1] lost with h2``, the root cause's host first."""
    messages = {r.host: r.error.message for r in reports if r.rank in lost and r.error is not None}
    hosts = [root.host or "", *sorted(h for h in set(lost.values()) if h != root.host)]
    return "; ".join(f"{messages.get(h, f'lost host {h}')}: ranks {sorted(k for k, v in lost.items() if v == h)} lost with {h}" for h in hosts)


def find_root_cause(reports: Sequence[RankReport], rank_exits: Sequence[RankExit]) -> RootCause | None:
    """The first rank that failed on its own: the earliest error that is not a peer's loss, or,
    when a rank died without a report (a signal, os._exit, the OOM killer), that rank."""
    by_rank = {r.rank: r for r in reports}
    errored = sorted((r for r in reports if r.error), key=lambda r: r.error.time if r.error else 0.0)
    # ranks that died without a Python exception of their own, in the backend's order (those
    # that failed on their own first, then those their agent stopped)
    died = [e for e in rank_exits if (e.signal or e.exitcode) and not (e.rank in by_rank and by_rank[e.rank].error)]
    own = next((r for r in errored if r.error and not is_peer_loss(r.error)), None)
    if errored and not (died and own is None):
        return _from_error(own or errored[0])
    if died:
        return _from_exit(died[0], by_rank.get(died[0].rank))
    return _from_error(errored[0]) if errored else None


def _from_error(report: RankReport) -> RootCause:
    assert report.error is not None
    return RootCause(
        rank=report.rank,
        host=report.host,
        local_rank=report.local_rank,
        device=report.device,
        type=report.error.type,
        message=report.error.message,
        traceback=report.error.traceback,
        log_tail=log_tail(report.log),
        hint=CUDA_ON_CPU_HINT if report.device == "cpu" and CUDA_ON_CPU.search(f"{report.error.message}\n{report.error.traceback}") else None,
    )


def _from_exit(rank_exit: RankExit, report: RankReport | None) -> RootCause:
    if rank_exit.signal:
        oom = " (out of memory: killed by the kernel's OOM killer)" if rank_exit.oom_suspected else ""
        message = f"killed by {rank_exit.signal}{oom}"
        kind = "OutOfMemoryKill" if rank_exit.oom_suspected else "KilledBySignal"
    else:
        message = f"exited with code {rank_exit.exitcode} without raising a Python exception"
        kind = "ProcessExit"
    return RootCause(
        rank=rank_exit.rank,
        host=report.host if report else rank_exit.host,
        local_rank=report.local_rank if report else None,
        device=report.device if report else None,
        type=kind,
        message=message,
        log_tail=log_tail(report.log if report else None),
        exitcode=rank_exit.exitcode,
        signal=rank_exit.signal,
    )
