"""The checkpoint benchmarks run at a tiny size and write their JSON with the fields BENCHMARKS.md
reads (``benchmarks/checkpoint_io.py``, ``benchmarks/resume_time.py``). No timing is asserted:
timings on a shared CI machine mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _run(tmp_path, script: str, *args: str, timeout: float = 240) -> dict:
    out = tmp_path / f"{script}.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{script}.py"), "--smoke", "--out", str(out), *args],
                          cwd=tmp_path, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "smoke" and data["machine"]["cores"] >= 1 and data["machine"]["loadavg_at_end"]
    return data


def test_checkpoint_io_smoke(tmp_path):
    data = _run(tmp_path, "checkpoint_io", "--dir", str(tmp_path))
    (size,) = data["io"].values()
    assert size["state_bytes"] > 0 and len(size["loadavg_1min_per_rep"]) == 1
    for name in ("plain", "dcp", "ctx", "ctx_sharded"):
        v = size["variants"][name]
        assert v["save_s"]["n"] == 1 and v["load_s"]["n"] == 1 and v["save_gbps"]["median"] > 0 and v["bytes_on_disk"] > 0, name
    for name in ("plain_fsync", "sha256"):
        assert size["variants"][name]["save_s"]["n"] == 1, name
    for key in ("ctx_save", "ctx_load", "ctx_sharded_save", "ctx_sharded_load"):
        r = size["ctx_over_best_baseline"][key]
        assert r["paired"]["n"] == 1 and r["of_medians"] > 0 and r["faster_baseline"] in ("plain", "dcp"), key
    steps = data["steps"]
    assert set(steps["step_us"]) == {"plain", "should_stop", "saving"} and steps["saves"] >= 1
    assert set(steps["over_plain"]) == {"should_stop", "saving"} and steps["should_stop_net_us"]["n"] == 1
    assert data["verdicts"]
    assert list(tmp_path.glob("glb-ckpt-*")) == []  # its checkpoints are gone


def _check_resume_table(part: dict, hosts: int) -> None:
    resume, cold = part["runs"]["resume"], part["runs"]["cold"]
    assert len(resume) == len(cold) == 1
    assert resume[0]["resumed_step"] == 8 and resume[0]["attempts"] == 2 and resume[0]["failure_class"] == "rank_lost"
    assert cold[0]["attempts"] == 1 and len(resume[0]["hosts"]) == hosts
    t = part["table"]
    for key in (
        "resume_death_to_first_step_s",
        "cold_launch_to_first_step_s",
        "cold_stage_to_first_step_s",
        "resume_over_cold_launch",
        "resume_over_cold_stage",
    ):
        assert t[key]["n"] == 1 and t[key]["median"] > 0, key
    assert set(t["resume_segments_s"]) == {"detect_and_stop", "restart_decision", "spawn", "rendezvous_and_pg", "job_start_to_first_step"}
    assert set(t["cold_segments_s"]) == {"launcher_start", "spawn", "rendezvous_and_pg", "job_start_to_first_step"}
    assert isinstance(t["resume_over_cold_launch_goal_met"], bool)


def test_resume_time_smoke_on_this_machine(tmp_path):
    data = _run(tmp_path, "resume_time", "--no-ssh", "--no-proposal")
    assert data["errors"] == {} and "ssh" not in data
    _check_resume_table(data["local"], hosts=1)


@pytest.mark.slow
def test_resume_time_smoke_over_ssh(tmp_path):
    from tests.cluster.conftest import missing_tools

    reason = missing_tools()
    if reason:
        pytest.skip(reason)
    data = _run(tmp_path, "resume_time", "--no-local", "--no-proposal")
    assert data["errors"] == {} and "local" not in data
    _check_resume_table(data["ssh"], hosts=2)
