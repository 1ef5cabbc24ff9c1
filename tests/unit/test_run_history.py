"""A run's record is append-only: ``launch resume`` adds to result.json, never replaces it. Every
attempt of every stage stays (the kept stages as they were, a stage run again with its earlier
attempts first), the run's wall time is its launches' summed with the gaps said, its steps every
attempt's, and the record is written write-then-rename."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.protocol import RankReport
from launcher.policies import FailureClass
from launcher.records import AttemptRecord, Failure, FailureReason, RunStatus, StageOutcome
from launcher.results.aggregate import aggregate
from launcher.results.store import load_result, write_result


def _report(rank: int, world: int, t0: float, steps: int) -> RankReport:
    return RankReport.from_dict({
        "rank": rank, "local_rank": rank, "node_rank": 0, "world_size": world, "host": "h", "device": "cpu", "status": "ok",
        "phases": {"spawned": t0 + 0.5, "started": t0 + 0.6, "imported": t0 + 1.5, "joined": t0 + 1.6, "pg_ready": t0 + 1.7,
                   "first_step": t0 + 1.8, "finished": t0 + 2.0},
        "metrics": {"steps": steps, "values": {}, "times_ms": {}}, "result": None, "error": None,
    })  # fmt: skip


def _attempt(n: int, t0: float, t1: float, status: RunStatus, steps: int, **kw) -> AttemptRecord:
    return AttemptRecord(attempt=n, status=status, started_at=t0, ended_at=t1, steps=steps, world_size=2, **kw)


def _doc(stages, t0, t1, previous=None):
    return aggregate(stages, job="j", run_id="r", backend="torchrun", spec={}, spec_hash="x", params={}, started_at=t0,
                     finished_at=t1, previous=previous).to_dict()  # fmt: skip


def _first_launch() -> dict:
    """World 1 succeeded; world 2 was restarted once (a rank lost) and then stopped by a notice."""
    t0 = 1000.0
    one = StageOutcome(1, RunStatus.SUCCEEDED, t0, t0 + 3, reports=[_report(0, 1, t0, 10)],
                       attempts=[_attempt(0, t0, t0 + 3, RunStatus.SUCCEEDED, 10)])  # fmt: skip
    lost = _attempt(0, t0 + 3, t0 + 8, RunStatus.FAILED, 10, failure_class=FailureClass.RANK_LOST, checkpoint_step=8, lost_steps=2,
                    restarted=True, cause="rank 1 on h (cpu): killed by SIGKILL")  # fmt: skip
    stopped = _attempt(1, t0 + 9, t0 + 15, RunStatus.INTERRUPTED, 6, failure_class=FailureClass.PREEMPTED, resumed_step=8,
                       checkpoint_step=14, lost_steps=0)  # fmt: skip
    two = StageOutcome(2, RunStatus.INTERRUPTED, t0 + 3, t0 + 15, restarts=1, reports=[_report(r, 2, t0 + 9, 6) for r in (0, 1)],
                       attempts=[lost, stopped],
                       failure=Failure(FailureReason.INTERRUPTED, "stopped after a notice", failure_class=FailureClass.PREEMPTED))  # fmt: skip
    return _doc([one, two], t0, t0 + 15)


def test_a_resume_keeps_every_attempt_and_sums_the_wall_time_of_its_launches_with_the_gap_said():
    first = _first_launch()
    assert first["wall_s"] == 15.0 and "parts" not in first and first["summary"]["steps_per_rank"] == 10 + 6  # rank lost: 10 steps, then 6
    t1 = 1100.0  # resumed 85 s after the stop
    kept = StageOutcome(1, RunStatus.SUCCEEDED, 1000.5, 1003.5, reports=[_report(0, 1, 1000.0, 10)])  # finished_stages' rebuild
    again = StageOutcome(2, RunStatus.SUCCEEDED, t1, t1 + 7, reports=[_report(r, 2, t1, 10) for r in (0, 1)],
                         attempts=[_attempt(0, t1, t1 + 7, RunStatus.SUCCEEDED, 10, resumed_step=14)])  # fmt: skip
    second = _doc([kept, again], t1, t1 + 7, previous=first)

    assert second["stages"][0] == first["stages"][0]  # kept as it was recorded
    assert [r for r in second["ranks"] if r["world_size"] == 1] == [r for r in first["ranks"] if r["world_size"] == 1]
    attempts = second["stages"][1]["attempts"]
    assert [(a["attempt"], a["status"], a["failure_class"], a["steps"], a["resumed_step"], a["lost_steps"]) for a in attempts] == [
        (0, "failed", "rank_lost", 10, None, 2), (1, "interrupted", "preempted", 6, 8, 0), (2, "succeeded", None, 10, 14, None)]
    assert attempts[0]["cause"] == "rank 1 on h (cpu): killed by SIGKILL"
    assert second["stages"][1]["wall_s"] == 12.0 + 7.0 and second["stages"][1]["restarts"] == 1
    assert second["status"] == "succeeded" and second["started_at"] == 1000.0 and second["finished_at"] == 1107.0
    assert second["wall_s"] == 15.0 + 7.0 and second["gaps_s"] == 85.0
    assert [(p["wall_s"], p["status"], p["gap_s"]) for p in second["parts"]] == [(15.0, "interrupted", None), (7.0, "succeeded", 85.0)]
    assert second["summary"]["steps_per_rank"] == 10 + 6 + 10  # every attempt's steps: the whole run's

    # and once more: a third launch appends again, nothing of the two before is lost
    t2 = 1200.0
    third = _doc([kept, StageOutcome(2, RunStatus.SUCCEEDED, t2, t2 + 1, reports=[_report(r, 2, t2, 1) for r in (0, 1)],
                                     attempts=[_attempt(0, t2, t2 + 1, RunStatus.SUCCEEDED, 1)])], t2, t2 + 1, previous=second)  # fmt: skip
    assert [a["attempt"] for a in third["stages"][1]["attempts"]] == [0, 1, 2, 3] and len(third["parts"]) == 3
    assert third["wall_s"] == 23.0 and third["gaps_s"] == 85.0 + 93.0


def test_an_attempts_phases_count_from_its_own_start_not_the_stages_first():
    t0 = 1000.0
    restart_at = t0 + 8.0  # the first attempt took 8 s; the respawn about 1 s
    stage = StageOutcome(2, RunStatus.SUCCEEDED, t0, restart_at + 3, restarts=1, reports=[_report(r, 2, restart_at, 4) for r in (0, 1)],
                         attempts=[_attempt(0, t0, t0 + 7.5, RunStatus.FAILED, 3, failure_class=FailureClass.RANK_LOST, restarted=True),
                                   _attempt(1, restart_at, restart_at + 3, RunStatus.SUCCEEDED, 4)])  # fmt: skip
    doc = _doc([stage], t0, restart_at + 3)
    phases = doc["stages"][0]["phases"]
    assert phases["spawn"] == 0.5 and phases["to_first_step"] == 1.8, phases
    assert doc["ranks"][0]["timeline_s"]["first_step"] == 1.8
    assert doc["stages"][0]["wall_s"] == 11.0  # the stage's wall time is still the whole stage's


def test_a_record_of_another_run_is_no_history():
    first = _first_launch()
    doc = _doc([StageOutcome(1, RunStatus.SUCCEEDED, 2000.0, 2001.0, reports=[_report(0, 1, 2000.0, 3)])], 2000.0, 2001.0,
               previous={**first, "run_id": "another"})  # fmt: skip
    assert "parts" not in doc and doc["wall_s"] == 1.0 and doc["started_at"] == 2000.0


def test_the_record_is_written_then_renamed_so_a_crash_mid_write_leaves_the_previous_one(tmp_path, monkeypatch):
    write_result(tmp_path, {"status": "interrupted", "stages": []})
    before = (tmp_path / "result.json").read_bytes()

    def crash(*_a, **_k):
        raise KeyboardInterrupt("the launcher killed mid-write")

    monkeypatch.setattr(json, "dump", crash)
    with pytest.raises(KeyboardInterrupt):
        write_result(tmp_path, {"status": "succeeded", "stages": [{"world_size": 2}]})
    monkeypatch.undo()
    assert (tmp_path / "result.json").read_bytes() == before and load_result(tmp_path) == {"status": "interrupted", "stages": []}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no half-written temporary left either


def test_how_far_an_attempt_got_is_the_ranks_own_last_count_not_a_lagging_beacon():
    from launcher.control.restarts import AttemptProgress
    from launcher.control.stagestate import StageState
    from launcher.protocol import RankProgress
    from launcher.stage.events import RankBeacon, RankReported
    from launcher.control.planning import plan_stage
    from launcher.spec.model import load_job
    from tests.conftest import REPO
    from tests.unit.test_runloop import NODE

    job = load_job(REPO / "jobs" / "ddp_train.yaml", ["resources.cpu_workers=2"])
    state = StageState(plan_stage(job, [NODE], 2, "cpu", run_dir=Path("/tmp/unused-run"), master_port=1, backend=None), 1000.0)
    state.apply([RankBeacon(0, RankProgress(phase="running", steps=7, t=1001.0, ckpt_step=8, ckpt_at=4)),
                 RankBeacon(1, RankProgress(phase="running", steps=7, t=1001.0))])  # fmt: skip
    report = _report(0, 2, 1000.0, 11)  # rank 0 counted 11 steps when it ended; its beacon said 7
    state.apply([RankReported(report)])
    progress = AttemptProgress.of(state.beacons)
    assert (progress.steps, progress.checkpoint_step, progress.lost_steps) == (11, 8, 7)
