"""timeouts.rendezvous_s bounds the rendezvous; timeouts.collective_s bounds each collective.

Real 2-rank CPU jobs (torchrun, gloo) in which one rank is late: rank 0 sleeps before an
all-reduce that rank 1 already waits in (as while saving a checkpoint), or rank 1 is late to
the rendezvous itself. No timing asserts: each case asserts how the run ended and why.
"""

from __future__ import annotations

import io
from pathlib import Path

import yaml

from launcher import run_job
from tests.conftest import pids_mentioning
from tests.integration.faultkit import pythonpath


def _quiet_ui():
    from rich.console import Console

    from launcher.ui.console import RunUI

    return RunUI(Console(file=io.StringIO()), quiet=True)


def _run(tmp_path: Path, monkeypatch, timeouts: dict, params: dict, env: dict | None = None):
    spec = {
        "name": "slow_collective",
        "entrypoint": "tests.integration.slow_collective:run",
        "params": params,
        "resources": {"nodes": 1, "cpu_workers": 2, "device": "cpu"},
        "timeouts": timeouts,
        "env": env or {},
    }
    path = tmp_path / "slow_collective.yaml"
    path.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("PYTHONPATH", pythonpath())
    result = run_job(path, out=tmp_path / "runs", events=_quiet_ui())
    assert pids_mentioning(str(tmp_path)) == []
    return result


def test_a_collective_may_wait_longer_than_the_rendezvous_timeout(tmp_path, monkeypatch):
    """rank 0 takes 6 s to reach the all-reduce, twice rendezvous_s: the job still succeeds."""
    result = _run(tmp_path, monkeypatch, {"rendezvous_s": 3, "run_s": 120}, {"late_rank": 0, "sleep_s": 6})
    assert result.status == "succeeded", result.data.get("failure")
    assert [r["result"] for r in result.data["ranks"]] == [{"sum": 2.0}, {"sum": 2.0}]


def test_collective_s_bounds_the_wait_in_a_collective(tmp_path, monkeypatch):
    """The same late rank with collective_s=2 (rendezvous_s generous): rank 1's all-reduce times out."""
    result = _run(
        tmp_path, monkeypatch, {"rendezvous_s": 60, "collective_s": 2, "run_s": 120}, {"late_rank": 0, "sleep_s": 6}
    )
    assert result.status == "failed"
    failure = result.data["failure"]
    assert failure["reason"] == "failed"  # a rank's own error, not the run_s watchdog
    root = failure["root_cause"]
    assert root["rank"] == 1, failure
    assert "Timed out" in root["message"] and "2000ms" in root["message"], root["message"]


def test_the_rendezvous_stays_bounded_by_rendezvous_s(tmp_path, monkeypatch):
    """rank 1 reaches the rendezvous 30 s late with rendezvous_s=3 and collective_s=600: rank 0 gives
    up waiting for it with a rendezvous error (not the run_s watchdog, not after collective_s)."""
    result = _run(
        tmp_path,
        monkeypatch,
        {"rendezvous_s": 3, "collective_s": 600, "run_s": 60},
        {"late_rank": 1, "sleep_s": 0},
        env={"SLOW_IMPORT_RANK": "1", "SLOW_IMPORT_S": "30"},
    )
    assert result.status == "failed"
    failure = result.data["failure"]
    assert failure["reason"] == "failed", failure["summary"]
    root = failure["root_cause"]
    assert root["rank"] == 0, failure
    assert "1 of 2 ranks arrived within timeouts.rendezvous_s=3s" in root["message"], root["message"]
