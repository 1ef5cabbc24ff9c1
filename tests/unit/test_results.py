"""aggregate() is pure: typed stage outcomes in, the versioned result document out; the job's
hooks run afterwards (results.hooks), and what they raise is noted, never lost."""

from __future__ import annotations

from launcher.protocol import RankReport, RankStatus
from launcher.records import Failure, FailureReason, RootCause, RunStatus, StageOutcome
from launcher.results.aggregate import aggregate, stage_phases
from launcher.results.hooks import run_summarize, workload_module


def _report(rank: int, world: int, ms: float, t0: float) -> RankReport:
    return RankReport.from_dict({
        "rank": rank, "local_rank": rank, "node_rank": 0, "world_size": world, "host": "h", "device": "cpu", "status": "ok",
        "phases": {"spawned": t0 + 0.5, "started": t0 + 0.6, "imported": t0 + 1.5, "joined": t0 + 1.6, "pg_ready": t0 + 1.7,
                   "first_step": t0 + 1.8, "finished": t0 + 2.0},
        "metrics": {"steps": 10, "values": {}, "times_ms": {"matmul/100": [ms]}},
        "result": {"threads": 4 // world}, "error": None,
    })


def _aggregate(stages, t0=1000.0, **kw):
    """result.json's document, from the record aggregate() built."""
    return aggregate(stages, job="j", run_id="r", backend="torchrun", spec={}, spec_hash="x", params={}, started_at=t0, **kw).to_dict()


def test_phases_follow_the_slowest_rank():
    t0 = 1000.0
    reports = [_report(0, 2, 1.0, t0), _report(1, 2, 1.0, t0 + 0.25)]
    phases = stage_phases(t0, reports)
    assert phases == {"spawn": 0.75, "import": 1.0, "rendezvous": 0.1, "pg_init": 0.1, "run": 0.3, "to_first_step": 2.05}


def test_a_phase_no_rank_finished_is_where_they_stopped_and_a_script_has_no_rendezvous_phases():
    t0 = 1000.0
    stuck = _report(0, 2, 1.0, t0)  # timed out waiting for a rank that never came
    stuck.phases = {k: v for k, v in stuck.phases.items() if k in ("spawned", "started", "imported", "finished")}
    stuck.phases["finished"] = t0 + 4.5
    assert stage_phases(t0, [stuck]) == {"spawn": 0.5, "import": 1.0, "rendezvous": 3.0, "pg_init": None, "run": None,
                                         "to_first_step": None}
    script = _report(0, 1, 1.0, t0)
    del script.phases["joined"], script.phases["pg_ready"]
    assert stage_phases(t0, [script], script=True) == {"spawn": 0.5, "import": 1.0, "rendezvous": None, "pg_init": None,
                                                       "run": 0.5, "to_first_step": 1.8}


def test_the_document_keeps_its_fields_and_every_rank_with_its_timeline():
    t0 = 1000.0
    one = StageOutcome(1, RunStatus.SUCCEEDED, t0, t0 + 3, reports=[_report(0, 1, 10.0, t0)], load_avg={"start": (1.0, 0.5, 0.2)})
    two = StageOutcome(2, RunStatus.SUCCEEDED, t0, t0 + 3, reports=[_report(r, 2, 20.0, t0) for r in (0, 1)])
    result = _aggregate([one, two], finished_at=t0 + 7)
    assert result["schema_version"] == 1 and result["status"] == "succeeded" and result["failure"] is None
    assert result["world_sizes"] == [1, 2] and result["world_size"] == 2 and len(result["ranks"]) == 3
    assert result["ranks"][0]["timeline_s"]["first_step"] == 1.8 and result["ranks"][0]["status"] == "ok"
    assert result["stages"][0]["load_avg"] == {"start": [1.0, 0.5, 0.2]} and "load_avg" not in result["stages"][1]
    assert result["wall_s"] == 7.0 and result["summary"] == {"steps_per_rank": 10}
    assert set(result) >= {"job", "run_id", "backend", "spec", "spec_hash", "params", "phases", "restarts", "stages"}


def test_a_failed_stage_makes_the_run_failed_and_keeps_its_failure():
    t0 = 1000.0
    ok = StageOutcome(1, RunStatus.SUCCEEDED, t0, t0 + 1, reports=[_report(0, 1, 10.0, t0)])
    root = RootCause(rank=1, host="h", local_rank=1, device="cpu", type="ValueError", message="boom")
    bad = StageOutcome(2, RunStatus.FAILED, t0, t0 + 1, reports=[_report(0, 2, 20.0, t0)],
                       failure=Failure(FailureReason.FAILED, root.line(), root, collateral_ranks=(0,)))
    result = _aggregate([ok, bad])
    assert result["status"] == "failed" and result["failure"]["summary"] == "rank 1 on h (cpu): ValueError: boom"
    assert result["failure"]["root_cause"]["type"] == "ValueError" and result["failure"]["collateral_ranks"] == [0]
    assert [s["status"] for s in result["stages"]] == ["succeeded", "failed"]
    assert result["stages"][1]["failure"] == result["failure"]


def test_the_record_is_frozen_typed_and_a_run_cut_short_says_why():
    import dataclasses

    import pytest

    t0 = 1000.0
    one = StageOutcome(1, RunStatus.SUCCEEDED, t0, t0 + 3, reports=[_report(0, 1, 10.0, t0)])
    stopped = Failure(FailureReason.INTERRUPTED, "stopped by SIGINT before the stage of world size 2")
    record = aggregate([one], job="j", run_id="r", backend="torchrun", spec={}, spec_hash="x", params={}, started_at=t0, cut_short=stopped)
    assert record.status == RunStatus.INTERRUPTED and record.stages[0].status == RunStatus.SUCCEEDED  # enums, not strings
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.status = RunStatus.SUCCEEDED  # type: ignore[misc]
    later = dataclasses.replace(record, run_dir="/runs/j/r", plots=("a.png",))
    doc = later.to_dict()
    assert (doc["status"], doc["failure"]["reason"], doc["run_dir"], doc["plots"]) == ("interrupted", "interrupted", "/runs/j/r", ["a.png"])
    assert "run_dir" not in record.to_dict() and record.plots == ()  # the first record is as it was


def test_a_workload_summary_that_raises_is_noted_and_the_results_stay():
    t0 = 1000.0
    result = _aggregate([StageOutcome(1, RunStatus.SUCCEEDED, t0, t0 + 3, reports=[_report(0, 1, 10.0, t0)])])
    module = workload_module("launcher.workloads.matmul:run")
    # e.g. `launch report` on a run whose params the workload no longer accepts
    summary = run_summarize(result, module, {"sizes": [64], "iters": 10, "retired": 1})
    assert summary["error"].startswith("ValidationError: ")
    assert result["status"] == "succeeded" and len(result["ranks"]) == 1


def test_a_workload_whose_own_import_fails_raises_and_a_missing_one_is_none(tmp_path, monkeypatch):
    (tmp_path / "gl_needs_dep.py").write_text("import gl_no_such_dependency\n\n\ndef run(ctx):\n    return {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import pytest

    with pytest.raises(ModuleNotFoundError, match="gl_no_such_dependency"):
        workload_module("gl_needs_dep:run")
    assert workload_module("gl_not_on_this_machine:run") is None


def _stopped(rank: int, t0: float, stamps: tuple[str, ...], last_phase: str | None) -> RankReport:
    """A rank stopped before it wrote its report (Ctrl-C): the phase stamps its beacons carried."""
    full = _report(rank, 2, 1.0, t0).phases
    return RankReport(rank=rank, local_rank=rank, node_rank=0, world_size=2, host="h", device="cpu", status=RankStatus.STOPPED,
                      phases={k: full[k] for k in stamps}, last_phase=last_phase)  # fmt: skip


def test_a_stage_stopped_while_its_ranks_ran_shows_every_phase_and_its_run_until_the_stop():
    t0 = 1000.0
    started = ("spawned", "started", "imported", "joined", "pg_ready", "first_step")
    reports = [_stopped(0, t0, started, "running"), _stopped(1, t0, started, "running")]
    stage = StageOutcome(2, RunStatus.INTERRUPTED, t0, t0 + 9.7, reports=reports,
                         failure=Failure(FailureReason.INTERRUPTED, "interrupted (SIGINT)"))  # fmt: skip
    phases = _aggregate([stage])["stages"][0]["phases"]
    assert phases == {"spawn": 0.5, "import": 1.0, "rendezvous": 0.1, "pg_init": 0.1, "run": 8.0, "to_first_step": 1.8}
    # stopped in the rendezvous: it lasted until the stop, and nothing after it happened
    waiting = [_stopped(r, t0, ("spawned", "started", "imported"), "rendezvous") for r in (0, 1)]
    assert stage_phases(t0, waiting, ended_at=t0 + 9.7) == {"spawn": 0.5, "import": 1.0, "rendezvous": 8.2, "pg_init": None,
                                                           "run": None, "to_first_step": None}  # fmt: skip
    # one rank still importing: the stage was in its import phase, whatever the other had done
    importing = [_stopped(0, t0, ("spawned", "started"), "importing"), _stopped(1, t0, ("spawned", "started", "imported"), "rendezvous")]
    assert stage_phases(t0, importing, ended_at=t0 + 9.7)["rendezvous"] is None
    script = [_stopped(0, t0, ("spawned", "started", "imported", "first_step"), "running")]
    assert stage_phases(t0, script, script=True, ended_at=t0 + 9.7)["run"] == 8.2


def test_phases_no_beacon_dated_stay_unknown_rather_than_one_phase_taking_the_whole_stage():
    t0 = 1000.0
    undated = [_stopped(0, t0, (), "running"), _stopped(1, t0, (), None)]
    assert set(stage_phases(t0, undated, ended_at=t0 + 9.7).values()) == {None}
    assert set(stage_phases(t0, undated[:1], ended_at=t0 + 9.7).values()) == {None}
