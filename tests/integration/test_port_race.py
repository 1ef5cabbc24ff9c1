"""Issue 6: the rendezvous port the launcher chose is taken by another process before the agent
binds it (the agent spends a second or more importing torch in between). The launcher notices
the agent's EADDRINUSE and runs the stage again on a freshly chosen port, not as a restart.

The race itself cannot be timed from outside, so the port chooser is made to hand out a port
that a socket of this test already listens on; the agent, its bind failure and the retry are real.
"""

from __future__ import annotations

import io
import json
import socket

import pytest

import launcher.control.nodes
from launcher import run_job
from launcher.procutil import free_port
from tests.conftest import REPO, pids_mentioning
from tests.integration.faultkit import pythonpath

JOB = REPO / "benchmarks" / "jobs" / "allreduce.yaml"


@pytest.fixture
def taken_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _quiet_ui():
    from rich.console import Console

    from launcher.ui.console import RunUI

    return RunUI(Console(file=io.StringIO()), quiet=True)


def test_a_port_taken_before_the_agent_binds_it_is_replaced(tmp_path, taken_port, monkeypatch):
    handed_out = []

    def first_taken_then_free(host: str = "127.0.0.1") -> int:
        handed_out.append(taken_port if not handed_out else free_port(host))
        return handed_out[-1]

    monkeypatch.setattr(launcher.control.nodes, "free_port", first_taken_then_free)
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.setenv("PYTHONPATH", pythonpath())
    result = run_job(JOB, out=tmp_path / "runs", events=_quiet_ui())
    assert result.status == "succeeded", result.data.get("failure")
    stage = result.run_dir / "world2"
    assert handed_out[0] == taken_port and len(handed_out) == 2
    assert {r["rendezvous"] for r in result.data["ranks"]} == {f"127.0.0.1:{handed_out[1]}"}
    assert result.data["stages"][0]["restarts"] == 0  # a lost port race is not a restart
    first_try = "\n".join(p.read_text() for p in (stage / "port-retry1" / "logs").glob("*.log"))
    assert f"rendezvous port {taken_port} is already in use" in first_try
    assert pids_mentioning(str(tmp_path)) == []


def test_a_port_that_stays_taken_fails_with_a_clear_reason(tmp_path, taken_port, monkeypatch):
    monkeypatch.setattr(launcher.control.nodes, "free_port", lambda host="127.0.0.1": taken_port)
    monkeypatch.setenv("PYTHONPATH", pythonpath())
    result = run_job(JOB, out=tmp_path / "runs", events=_quiet_ui())
    assert result.status == "failed"
    assert f"rendezvous port {taken_port} on" in result.data["failure"]["summary"]
    assert "already in use" in result.data["failure"]["summary"]
    stage = result.run_dir / "world2"
    assert sorted(p.name for p in stage.glob("port-retry*")) == ["port-retry1", "port-retry2", "port-retry3"]
    assert json.loads((result.run_dir / "result.json").read_text())["status"] == "failed"
    assert pids_mentioning(str(tmp_path)) == []
