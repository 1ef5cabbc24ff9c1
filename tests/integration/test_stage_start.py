"""A later stage that cannot start (its first host stopped answering, say) must not lose the
stages that finished: the run reports them in result.json, says why the next one did not start,
and fails (exit 1), instead of ending on a bare error with no result.

The failure is injected at the port chooser, the step that asks the first host for a rendezvous
port (over SSH it raises exactly this error when the host is unreachable); the stages are real.
"""

from __future__ import annotations

import io
import json

import launcher.control.nodes
from launcher import run_job
from launcher.backends.ssh import PreflightError
from launcher.procutil import free_port
from tests.conftest import REPO, pids_mentioning
from tests.integration.faultkit import pythonpath

JOB = REPO / "benchmarks" / "jobs" / "allreduce.yaml"


def test_a_stage_that_cannot_start_keeps_the_finished_stages(tmp_path, monkeypatch):
    from rich.console import Console

    from launcher.ui.console import RunUI

    calls = []

    def first_host_gone_after_one_stage(host: str = "127.0.0.1") -> int:
        calls.append(host)
        if len(calls) > 1:
            raise PreflightError(["h1: cannot pick a rendezvous port: unreachable over SSH (10.0.0.1:22): timed out"])
        return free_port(host)

    monkeypatch.setattr(launcher.control.nodes, "free_port", first_host_gone_after_one_stage)
    monkeypatch.setenv("PYTHONPATH", pythonpath())
    shown = io.StringIO()
    result = run_job(JOB, overrides=["scaling.workers=[1,2]"], out=tmp_path / "runs", events=RunUI(Console(file=shown, width=200)))
    assert result.status == "failed"
    saved = json.loads((result.run_dir / "result.json").read_text())
    assert [(s["world_size"], s["status"]) for s in saved["stages"]] == [(1, "succeeded")]
    assert [r["world_size"] for r in saved["ranks"]] == [1] and saved["ranks"][0]["status"] == "ok"
    assert saved["failure"]["reason"] == "not_started"
    assert saved["failure"]["summary"].startswith("the stage of world size 2 could not start: h1: cannot pick")
    assert "could not start" in shown.getvalue()
    assert pids_mentioning(str(tmp_path)) == []
