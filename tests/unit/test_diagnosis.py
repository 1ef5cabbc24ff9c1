"""Failure diagnosis is pure: rank reports and rank exits in, one Failure out."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.control.diagnosis import LOG_TAIL_LINES, explain_failure, find_root_cause, is_peer_loss, log_tail
from launcher.protocol import RankError, RankReport, RankStatus
from launcher.records import FailureReason, RankExit

PEER_LOSS_MESSAGE = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:29500"


def report(rank: int, status: RankStatus = RankStatus.STOPPED, *, error: RankError | None = None, log: str | None = None,
           host: str = "h") -> RankReport:
    return RankReport(
        rank=rank,
        local_rank=rank % 2,
        node_rank=rank // 2,
        world_size=4,
        host=host,
        device=f"cuda:{rank % 2}",
        status=RankStatus.FAILED if error else status,
        error=error,
        log=log,
    )


def err(type_: str, message: str, at: float) -> RankError:
    return RankError(type_, message, f"Traceback (most recent call last):\n...\n{type_}: {message}\n", at)


def peer(at: float) -> RankError:
    return err("RuntimeError", PEER_LOSS_MESSAGE, at)


# --- what counts as "a peer is gone" --------------------------------------------------------------


@pytest.mark.parametrize(
    "type_, message",
    [
        ("RuntimeError", PEER_LOSS_MESSAGE),
        ("RuntimeError", "[../gloo/transport/tcp/pair.cc:598] Connection reset by peer"),
        ("BrokenPipeError", "[Errno 32] Broken pipe"),
        ("DistNetworkError", "failed to recv, got 0 bytes"),
        ("DistBackendError", "NCCL communicator was aborted on rank 0"),
        ("RuntimeError", "[Rank 1] NCCL watchdog thread terminated with exception"),
        ("RuntimeError", "the remote peer closed the connection"),
    ],
)
def test_errors_a_dead_peer_causes_are_peer_loss(type_: str, message: str) -> None:
    assert is_peer_loss(err(type_, message, 0.0))


@pytest.mark.parametrize(
    "type_, message",
    [
        ("ValueError", "bad batch shape (3, 4)"),
        ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB"),
        ("ModuleNotFoundError", "No module named 'mymodel'"),
    ],
)
def test_a_rank_own_errors_are_not_peer_loss(type_: str, message: str) -> None:
    assert not is_peer_loss(err(type_, message, 0.0))


# --- the root cause -------------------------------------------------------------------------------


def test_earliest_error_is_the_root_cause_and_the_rest_collateral() -> None:
    reports = [
        report(0, error=err("RuntimeError", "second", at=11.0)),
        report(1, error=err("ValueError", "first", at=10.0)),
        report(2, RankStatus.OK),
        report(3),  # wrote no report: stopped
    ]
    failure = explain_failure(FailureReason.FAILED, reports, ())
    root = failure.root_cause
    assert root is not None and (root.rank, root.type, root.message) == (1, "ValueError", "first")
    assert (root.host, root.local_rank, root.device) == ("h", 1, "cuda:1")
    assert "ValueError: first" in root.traceback
    assert (root.exitcode, root.signal) == (None, None) and "exitcode" not in root.to_dict()
    assert failure.summary == "rank 1 on h (cuda:1): ValueError: first" == root.line()
    assert failure.collateral_ranks == (0, 3) and failure.stuck_ranks == ()
    assert failure.to_dict()["root_cause"]["rank"] == 1


def test_the_root_cause_carries_its_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "rank1.log"
    log.write_text("".join(f"line {i}\n" for i in range(50)))
    root = find_root_cause([report(1, error=err("ValueError", "boom", 1.0), log=str(log))], ())
    assert root is not None and len(root.log_tail) == LOG_TAIL_LINES
    assert root.log_tail[0] == f"line {50 - LOG_TAIL_LINES}" and root.log_tail[-1] == "line 49"


def test_log_tail_of_a_missing_or_unnamed_log_is_empty(tmp_path: Path) -> None:
    assert log_tail(None) == () and log_tail(str(tmp_path / "absent.log")) == ()


def test_peer_loss_first_with_a_rank_that_died_blames_the_dead_rank() -> None:
    reports = [report(0, error=peer(at=5.0)), report(1)]
    rank_exits = (RankExit(1, None, "SIGKILL", host="h"),)
    failure = explain_failure(FailureReason.FAILED, reports, rank_exits)
    root = failure.root_cause
    assert root is not None and (root.rank, root.type, root.signal) == (1, "KilledBySignal", "SIGKILL")
    assert root.message == "killed by SIGKILL" and root.traceback == ""
    # where it ran comes from its (stopped) report: the plan's slot
    assert (root.host, root.local_rank, root.device) == ("h", 1, "cuda:1")
    assert root.to_dict()["signal"] == "SIGKILL"
    assert failure.collateral_ranks == (0,)
    assert failure.summary == "rank 1 on h (cuda:1): KilledBySignal: killed by SIGKILL"


def test_a_dead_rank_without_any_report_is_placed_by_its_exit() -> None:
    root = find_root_cause([report(0, error=peer(at=5.0))], (RankExit(3, None, "SIGSEGV", host="node-b"),))
    assert root is not None and (root.rank, root.host, root.local_rank, root.device) == (3, "node-b", None, None)


def test_a_rank_own_error_beats_a_rank_the_agent_stopped() -> None:
    """Exits of ranks their agent stopped (SIGTERM) after a real error are not the cause."""
    reports = [report(0, error=err("ValueError", "bad input", at=5.0)), report(1)]
    root = find_root_cause(reports, (RankExit(1, None, "SIGTERM"),))
    assert root is not None and (root.rank, root.type) == (0, "ValueError")


def test_an_exit_of_a_rank_that_wrote_its_own_report_is_not_a_silent_death() -> None:
    """The agent lists every failed rank; rank 0 exited after its report (exit code 1) and comes
    first, but only rank 1 died without saying why."""
    reports = [report(0, error=peer(at=5.0)), report(1)]
    root = find_root_cause(reports, (RankExit(0, 1), RankExit(1, None, "SIGKILL")))
    assert root is not None and (root.rank, root.type) == (1, "KilledBySignal")


def test_the_first_of_several_dead_ranks_in_the_backend_order() -> None:
    reports = [report(0, error=peer(at=5.0)), report(1), report(2)]
    root = find_root_cause(reports, (RankExit(2, None, "SIGKILL"), RankExit(1, None, "SIGTERM")))
    assert root is not None and root.rank == 2


def test_a_rank_that_exited_without_an_exception() -> None:
    root = find_root_cause([report(0), report(1)], (RankExit(1, 3),))
    assert root is not None and (root.rank, root.type, root.exitcode, root.signal) == (1, "ProcessExit", 3, None)
    assert root.message == "exited with code 3 without raising a Python exception"
    assert root.to_dict()["exitcode"] == 3


def test_an_oom_kill_says_so() -> None:
    root = find_root_cause([report(0), report(1)], (RankExit(1, None, "SIGKILL", oom_suspected=True),))
    assert root is not None and root.type == "OutOfMemoryKill"
    assert root.message == "killed by SIGKILL (out of memory: killed by the kernel's OOM killer)"


def test_a_clean_exit_is_no_death() -> None:
    assert find_root_cause([report(0), report(1)], (RankExit(1, 0),)) is None


def test_peer_loss_alone_is_still_reported_when_nothing_better_is_known() -> None:
    root = find_root_cause([report(0, error=peer(at=5.0)), report(1)], ())
    assert root is not None and root.rank == 0 and root.message == PEER_LOSS_MESSAGE


@pytest.mark.parametrize(
    "rank_exits",
    [
        (),  # a backend that reports no exits (Ray)
        (RankExit(2, 1, host="b"), RankExit(0, 1, host="a")),  # torchrun's agents: both exited with 1 after their reports
    ],
    ids=["no-exits", "agent-exits"],
)
def test_a_rank_own_error_beats_an_earlier_stamped_peer_loss(rank_exits: tuple[RankExit, ...]) -> None:
    """Rank 2 (host b) raised; rank 0 (host a, whose clock runs 0.2 s behind b's) then saw the
    connection drop: its timestamp is the earlier one, but its error is only the consequence."""
    reports = [
        report(0, error=peer(at=100.1), host="a"),
        report(1, host="a"),
        report(2, error=err("ValueError", "bad batch", at=100.2), host="b"),
        report(3, host="b"),
    ]
    root = find_root_cause(reports, rank_exits)
    assert root is not None and (root.rank, root.type) == (2, "ValueError")
    failure = explain_failure(FailureReason.FAILED, reports, rank_exits)
    assert failure.collateral_ranks == (0, 1, 3)


def test_nothing_to_blame() -> None:
    assert find_root_cause([], ()) is None
    assert find_root_cause([report(0, RankStatus.OK), report(1)], ()) is None


# --- every kind of failure's summary --------------------------------------------------------------


def test_a_failure_nobody_reported_uses_the_backend_detail() -> None:
    failure = explain_failure(FailureReason.FAILED, [report(0), report(1)], (), detail="agent on h exited with 1")
    assert failure.root_cause is None and failure.summary == "agent on h exited with 1"
    assert failure.collateral_ranks == (0, 1)
    bare = explain_failure(FailureReason.FAILED, [report(0)], ())
    assert bare.summary == "the group ended without a rank report"


def test_timeout_names_the_stuck_ranks() -> None:
    reports = [report(0, RankStatus.OK), report(1), report(2, error=err("ValueError", "x", 1.0)), report(3)]
    failure = explain_failure(FailureReason.TIMEOUT, reports, (RankExit(1, None, "SIGTERM"),), run_timeout_s=20)
    assert failure.reason == FailureReason.TIMEOUT and failure.reason.status.value == "timeout"
    assert failure.root_cause is None  # a timeout has no root cause to look for
    assert failure.stuck_ranks == (1, 3)  # neither finished nor failed
    assert failure.summary == "run exceeded timeouts.run_s=20s; stuck ranks: [1, 3]"
    assert failure.to_dict()["stuck_ranks"] == [1, 3]


def test_timeout_with_no_stuck_rank() -> None:
    failure = explain_failure(FailureReason.TIMEOUT, [report(0, RankStatus.OK)], (), run_timeout_s=0.5)
    assert failure.summary == "run exceeded timeouts.run_s=0.5s; stuck ranks: none" and failure.stuck_ranks == ()


def test_interrupted_has_no_collateral_and_no_root_cause() -> None:
    reports = [report(0, error=err("KeyboardInterrupt", "", 1.0)), report(1)]
    rank_exits = (RankExit(1, None, "SIGTERM"),)
    failure = explain_failure(FailureReason.INTERRUPTED, reports, rank_exits, stop_reason="SIGINT")
    assert failure.summary == "interrupted (SIGINT)"
    assert (failure.root_cause, failure.collateral_ranks, failure.stuck_ranks) == (None, (), ())
    assert explain_failure(FailureReason.INTERRUPTED, reports, ()).summary == "interrupted (signal)"
    assert failure.reason.status.exit_code == 130


def test_not_started_uses_the_detail() -> None:
    detail = "the stage of world size 2 could not start: cannot reach host b"
    failure = explain_failure(FailureReason.NOT_STARTED, [], (), detail=detail)
    assert failure.summary == detail and failure.root_cause is None
    assert failure.to_dict() == {
        "reason": "not_started",
        "failure_class": None,  # the run loop classifies an attempt that ran; this one never did
        "summary": detail,
        "root_cause": None,
        "collateral_ranks": [],
        "stuck_ranks": [],
    }
