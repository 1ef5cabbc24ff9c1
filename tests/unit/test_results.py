"""aggregate() is pure: stage outcomes in, the versioned result document out."""

from __future__ import annotations

from pathlib import Path

from launcher.devices import NodeInventory
from launcher.plan import NodeTarget, make_plans
from launcher.results import aggregate, stage_phases, summarize
from launcher.spec import load_job
from launcher.supervisor import StageOutcome


def _plan(tmp_path: Path, workers: int):
    spec = tmp_path / "j.yaml"
    spec.write_text(f"name: j\nentrypoint: launcher.workloads.matmul:run\nparams: {{sizes: [100], iters: 10}}\nresources: {{cpu_workers: {workers}}}\n")
    node = NodeTarget("h", "127.0.0.1", NodeInventory("h", 4), "python3")
    (plan,) = make_plans(load_job(spec), [node], run_dir=tmp_path, master_port=1)
    return plan


def _report(rank: int, world: int, ms: float, t0: float) -> dict:
    return {
        "rank": rank, "local_rank": rank, "world_size": world, "host": "h", "device": "cpu", "status": "ok",
        "phases": {"spawned": t0 + 0.5, "started": t0 + 0.6, "imported": t0 + 1.5, "joined": t0 + 1.6, "pg_ready": t0 + 1.7,
                   "first_step": t0 + 1.8, "finished": t0 + 2.0},
        "metrics": {"steps": 10, "values": {}, "times_ms": {"matmul/100": [ms]}},
        "result": {"threads": 4 // world}, "error": None,
    }


def test_phases_follow_the_slowest_rank():
    t0 = 1000.0
    reports = [_report(0, 2, 1.0, t0), _report(1, 2, 1.0, t0 + 0.25)]
    phases = stage_phases(t0, reports)
    assert phases == {"spawn": 0.75, "import": 1.0, "rendezvous": 0.1, "pg_init": 0.1, "run": 0.3, "to_first_step": 2.05}


def test_a_phase_no_rank_finished_is_where_they_stopped_and_a_script_has_no_rendezvous_phases():
    t0 = 1000.0
    stuck = _report(0, 2, 1.0, t0)  # timed out waiting for a rank that never came
    stuck["phases"] = {k: v for k, v in stuck["phases"].items() if k in ("spawned", "started", "imported", "finished")}
    stuck["phases"]["finished"] = t0 + 4.5
    assert stage_phases(t0, [stuck]) == {"spawn": 0.5, "import": 1.0, "rendezvous": 3.0, "pg_init": None, "run": None,
                                         "to_first_step": None}
    script = _report(0, 1, 1.0, t0)
    del script["phases"]["joined"], script["phases"]["pg_ready"]
    assert stage_phases(t0, [script], script=True) == {"spawn": 0.5, "import": 1.0, "rendezvous": None, "pg_init": None,
                                                       "run": 0.5, "to_first_step": 1.8}


def test_scaling_efficiency_and_failure_free_status(tmp_path):
    t0 = 1000.0
    one = StageOutcome(_plan(tmp_path, 1), "succeeded", t0, t0 + 3, reports=[_report(0, 1, 10.0, t0)])
    two = StageOutcome(_plan(tmp_path, 2), "succeeded", t0, t0 + 3, reports=[_report(r, 2, 20.0, t0) for r in (0, 1)])
    result = aggregate([one, two], job="j", run_id="r", backend="torchrun", spec={}, spec_hash="x",
                       entrypoint="launcher.workloads.matmul:run", params={"sizes": [100], "iters": 10}, started_at=t0)
    assert result["schema_version"] == 1 and result["status"] == "succeeded"
    assert result["world_sizes"] == [1, 2] and len(result["ranks"]) == 3
    rows = {r["workers"]: r for r in result["scaling"]}
    one_rank = 2 * 100**3 * 10 / 0.010 / 1e9  # GFLOP/s of 10 matmuls of 100x100 in 10 ms
    assert abs(rows[1]["gflops"] - one_rank) < 1e-3
    assert abs(rows[2]["gflops"] - one_rank) < 1e-3  # each of two ranks at half the speed
    assert rows[2]["efficiency"] == 0.5
    assert result["ranks"][0]["timeline_s"]["first_step"] == 1.8


def test_a_failed_stage_makes_the_run_failed_and_keeps_its_failure(tmp_path):
    t0 = 1000.0
    ok = StageOutcome(_plan(tmp_path, 1), "succeeded", t0, t0 + 1, reports=[_report(0, 1, 10.0, t0)])
    bad = StageOutcome(_plan(tmp_path, 2), "failed", t0, t0 + 1, reports=[_report(0, 2, 20.0, t0)],
                       failure={"reason": "failed", "summary": "rank 1 ..."})
    result = aggregate([ok, bad], job="j", run_id="r", backend="torchrun", spec={}, spec_hash="x",
                       entrypoint=None, params={}, started_at=t0)
    assert result["status"] == "failed" and result["failure"]["summary"] == "rank 1 ..."
    assert [s["status"] for s in result["stages"]] == ["succeeded", "failed"]


def test_a_workload_summary_that_raises_is_noted_and_the_results_stay(tmp_path):
    t0 = 1000.0
    one = StageOutcome(_plan(tmp_path, 1), "succeeded", t0, t0 + 3, reports=[_report(0, 1, 10.0, t0)])
    result = aggregate([one], job="j", run_id="r", backend="torchrun", spec={}, spec_hash="x",
                       entrypoint="launcher.workloads.matmul:run", params={"sizes": [64], "iters": 10, "retired": 1}, started_at=t0)
    # e.g. `launch report` on a run whose params the workload no longer accepts
    assert result["status"] == "succeeded" and len(result["ranks"]) == 1
    assert result["summary"]["error"].startswith("ValidationError: ")
    assert result["summary"]["steps_per_rank"] == 10


def test_a_workload_whose_own_import_fails_says_so_in_the_summary(tmp_path, monkeypatch):
    (tmp_path / "gl_needs_dep.py").write_text("import gl_no_such_dependency\n\n\ndef run(ctx):\n    return {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    summary = summarize({"ranks": [], "stages": []}, "gl_needs_dep:run", {})
    assert summary["error"] == "importing the workload: ModuleNotFoundError: No module named 'gl_no_such_dependency'"
    assert "error" not in summarize({"ranks": [], "stages": []}, "gl_not_on_this_machine:run", {})
