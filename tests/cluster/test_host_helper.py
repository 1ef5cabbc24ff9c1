"""The SSH transport's pieces without a network (fast): the host helper's requests and heartbeat,
the launcher's connection to it (through a stand-in ``ssh`` that runs the remote command here),
host loss by a closed connection or by silence, the agent wrapper's own silence timeout and the
phases it keeps for a rank it stops, and the diagnosis of a lost host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.backends.ssh import HostLinks, SshError
from launcher.control.diagnosis import HOST_LOST, explain_failure
from launcher.protocol import RankError, RankReport, RankStatus, StagePaths
from launcher.records import FailureReason
from launcher.procutil import read_json
from tests.cluster.conftest import REPO
from tests.integration.faultkit import pythonpath
from tests.waiting import poll

# Runs the remote command of an ssh argv here: every option is ignored, "--" DEST CMD is `sh -c CMD`.
FAKE_SSH = """#!/bin/sh
while [ "$1" != "--" ]; do shift; done
shift 2
exec sh -c "$1"
"""


def _host(name: str = "h1", silence_s: float = 1.0) -> SimpleNamespace:
    return SimpleNamespace(
        name=name, address="127.0.0.1", destination="127.0.0.1", port=22, user=None, python=sys.executable, strict_host_key_checking="yes",
        connect_timeout_s=3, ssh_config="none", known_hosts=None, key=None, ssh_options={}, heartbeat_timeout_s=silence_s,
    )


@pytest.fixture
def links(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", pythonpath())
    monkeypatch.chdir(REPO)
    pool = HostLinks()
    yield pool
    dirs = {link.control_path.parent for link in pool.links()}
    pool.close(wait_s=2)
    assert not [d for d in dirs if d.exists()], "the control socket directory outlived close()"
    for pid in pool.master_pids():
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], f"{pid} outlived close()"


def test_the_helper_answers_requests_on_one_connection(links, tmp_path):
    host = _host(silence_s=30.0)
    link = links.get(host)
    assert 1024 <= link.call("free-port", bind="127.0.0.1")["port"] <= 65535
    stage = tmp_path / "run" / "world2"
    link.call("prepare", stage=str(stage), config=json.dumps({"job": "x"}))
    assert json.loads((stage / "worker.json").read_text()) == {"job": "x"}
    (stage / "reports").mkdir()
    (stage / "reports" / "rank1.json").write_text('{"rank": 1}')
    assert link.call("fetch", stage=str(stage), ranks=[0, 1]) == {"files": {"reports/rank1.json": '{"rank": 1}'}}
    with pytest.raises(SshError, match="unknown request 'nope'"):
        link.call("nope")
    assert links.get(host) is link  # the same connection, however often asked
    sockets = link.control_path.parent
    assert sockets.stat().st_mode & 0o777 == 0o700  # the control socket's directory is ours alone
    # heartbeats keep a quiet host alive: with no request, something is still heard from it (its
    # beat lines) and it is not lost (silence_s = 30 here: a loaded machine's beats come late, not that late)
    quiet_since = link.heard
    assert poll(lambda: link.heard > quiet_since, 30.0), "no heartbeat from a quiet host"  # a hang guard
    assert link.lost() is None


def test_a_closed_connection_is_a_lost_host_at_once(links):
    link = links.get(_host())
    link.call("free-port")
    os.kill(link.proc.pid, signal.SIGKILL)  # the stand-in ssh exec'd the helper: the connection is gone
    assert link.settle(wait_s=2.0) == "connection closed"
    with pytest.raises(SshError, match=r"lost host h1 \(connection closed\)"):
        link.call("free-port")


def test_a_host_that_falls_silent_is_lost_after_its_timeout(links):
    link = links.get(_host(silence_s=1.0))
    link.call("free-port")
    os.kill(link.proc.pid, signal.SIGSTOP)  # alive, connected, and says nothing
    try:
        lost = poll(link.lost, 60.0, 0.05)  # a hang guard: lost after silence_s = 1 s
        assert lost == "no answer for 1 s"  # lost by its silence, not by a closed connection
        assert time.monotonic() - link.heard > 1.0  # and only after the silence was as long as that
    finally:
        os.kill(link.proc.pid, signal.SIGCONT)


def test_a_login_that_fails_is_explained_not_lost(links):
    host = _host()
    host.python = "/nonexistent/python3"
    link = links.get(host)
    with pytest.raises(SshError, match="python: /nonexistent/python3 not found there"):
        link.call("preflight")
    assert link.lost() is None  # it never answered: a preflight problem, not a lost host


def test_the_helper_exits_when_the_launcher_falls_silent(tmp_path):
    helper = subprocess.Popen(
        [sys.executable, "-m", "launcher.runtime.hostagent", "serve", "--silence-s", "1"], cwd=REPO,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert helper.stdout.readline().strip() == "gpulaunch-beat"
        assert helper.wait(timeout=60) == 3  # 60 s: a hang guard (its --silence-s is 1)
    finally:
        if helper.poll() is None:
            helper.kill()


# Each phase lasts 1 s, ten of the wrapper's beacon reads (0.1 s), so that it sees every one;
# the times it wrote go to PATH.times too, for the test to compare the wrapper's stamps with.
FAKE_RANK = """\
import json, os, sys, time
path = sys.argv[1]
written = {}
for phase in ("starting", "importing", "rendezvous", "pg_init", "running"):
    tmp = path + ".tmp"
    written[phase] = time.time()
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "phase": phase, "steps": 0, "t": written[phase]}, f)
    with open(path + ".times.tmp", "w") as f:
        json.dump(written, f)
    os.replace(path + ".times.tmp", path + ".times")
    os.replace(tmp, path)
    if phase != "running":
        time.sleep(1.0)
time.sleep(600)
"""


def test_the_wrapper_stops_its_agent_when_the_launcher_falls_silent(tmp_path):
    """No ping for --silence-s: the wrapper stops the agent and its ranks by itself, and writes a
    `stopped` report with the phases its rank's beacon showed."""
    paths = StagePaths(tmp_path / "world1")
    paths.progress_dir.mkdir(parents=True)
    paths.worker_config.write_text(json.dumps({"entrypoint": "x:run"}))
    slot = {"rank": 0, "local_rank": 0, "node_rank": 0, "world_size": 1, "host": "h1", "device": "cpu"}
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "launcher.runtime.hostagent", "agent", "--stage", str(paths.root), "--silence-s", "3", "--grace-s", "1",
         "--", sys.executable, "-c", FAKE_RANK, str(paths.progress(0))],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    last_word = time.monotonic()  # the wrapper hears each word after this (its silence counts from then)
    wrapper.stdin.write(json.dumps({"env": {}, "ranks": [slot]}) + "\n")
    wrapper.stdin.flush()
    try:
        # the launcher's pings until the rank runs (however long a loaded machine takes), then none
        deadline = time.monotonic() + 120  # a hang guard
        while (read_json(paths.progress(0)) or {}).get("phase") != "running":
            assert wrapper.poll() is None and time.monotonic() < deadline, f"the rank never ran (wrapper exit {wrapper.poll()})"
            last_word = time.monotonic()
            wrapper.stdin.write("\n")
            wrapper.stdin.flush()
            time.sleep(0.2)
        wrapper.wait(timeout=120)  # stdin stays open: only the silence can stop it (120 s: a hang guard)
        waited = time.monotonic() - last_word
        out = wrapper.stdout.read()
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
        wrapper.stdin.close()
    assert wrapper.returncode == 143 and waited >= 3, (wrapper.returncode, waited)  # the silence was honoured
    assert "no word from the launcher for 3 s" in out  # stopped by the silence, not by EOF or a signal
    report = RankReport.from_dict(json.loads(paths.report(0).read_text()))
    assert report.status == RankStatus.STOPPED and report.last_phase == "running" and report.host == "h1"
    stamps = report.phases
    assert list(stamps) == ["started", "spawned", "imported", "joined", "pg_ready"], stamps
    assert stamps["spawned"] <= stamps["started"] < stamps["imported"] < stamps["joined"] < stamps["pg_ready"]
    # each stamp is the time of the beacon that first showed its phase, as the rank wrote it
    written = json.loads(Path(f"{paths.progress(0)}.times").read_text())
    assert (stamps["started"], stamps["imported"], stamps["joined"], stamps["pg_ready"]) == (
        written["starting"], written["rendezvous"], written["pg_init"], written["running"]), (stamps, written)


def _report(rank: int, host: str, status: RankStatus, error: RankError | None = None) -> RankReport:
    return RankReport(rank=rank, local_rank=0, node_rank=rank, world_size=3, host=host, device="cpu", status=status, error=error)


def test_a_lost_host_is_the_root_cause_its_ranks_lost_with_it_the_rest_collateral():
    reports = [
        _report(0, "h1", RankStatus.FAILED, RankError("DistBackendError", "Connection closed by peer [10.0.0.2]:4242", "tb", 100.0)),
        _report(1, "h2", RankStatus.FAILED, RankError(HOST_LOST, "lost host h2 (connection closed)", "", 100.5)),
        _report(2, "h3", RankStatus.STOPPED),
    ]
    failure = explain_failure(FailureReason.FAILED, reports, [], detail="agent on h1 exited with 1")
    assert failure.summary == "lost host h2 (connection closed): ranks [1] lost with h2"
    assert failure.root_cause is not None and (failure.root_cause.host, failure.root_cause.rank) == ("h2", 1)
    assert failure.collateral_ranks == (0, 2)


def test_a_rank_that_failed_on_its_own_before_a_host_was_lost_stays_the_root_cause():
    reports = [
        _report(0, "h1", RankStatus.FAILED, RankError("ValueError", "bad batch", "tb", 100.0)),
        _report(1, "h2", RankStatus.FAILED, RankError(HOST_LOST, "lost host h2 (no answer for 5 s)", "", 101.0)),
        _report(2, "h3", RankStatus.STOPPED),
    ]
    failure = explain_failure(FailureReason.FAILED, reports, [])
    assert failure.root_cause is not None and failure.root_cause.type == "ValueError"
    assert failure.collateral_ranks == (2,)  # rank 1 was lost with its host, not stopped by the error
