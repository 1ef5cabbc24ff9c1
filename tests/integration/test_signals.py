"""Issue 6: the launcher itself is sent SIGINT, SIGTERM or SIGKILL while its workers run.

SIGINT/SIGTERM: exit 130, the run marked interrupted, logs kept, nothing left in the process
table. SIGKILL (no handler can run): the agent and every worker still disappear on their own,
through parent-death signals. How long each took is recorded (``record``), not asserted."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.conftest import pids_mentioning
from tests.integration.faultkit import Launched, describe, record, result_of, wait_no_pids, write_spec

# A hang guard, not a speed figure: the workers sleep for an hour, so without parent-death
# signals they would still be there at any bound; with them they go in seconds, even loaded.
ORPHAN_BOUND_S = 120


@pytest.fixture(params=["forkserver", "spawn"])
def sleeper(tmp_path, request):
    spec = write_spec(tmp_path, params={"fault": "sleep"}, start_method=request.param)
    run = Launched(spec, tmp_path / "runs")
    yield run
    run.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupting_the_launcher_stops_everything_and_exits_130(sleeper, sig):
    workers = sleeper.wait_running(2)
    run_dir = sleeper.run_dir()
    assert set(workers.values()) <= set(pids_mentioning(str(run_dir)))
    t0 = time.monotonic()
    os.kill(sleeper.pid, sig)
    rc = sleeper.wait(60)
    record(f"{sig.name} to launcher -> launcher exit", time.monotonic() - t0)
    out = sleeper.output()
    assert rc == 130, out
    result = result_of(run_dir)
    assert result["status"] == "interrupted"
    assert result["failure"]["reason"] == "interrupted" and sig.name in result["failure"]["summary"]
    assert "SignalException" not in out and "Traceback" not in out
    assert (run_dir / "world2" / "logs" / "rank0.log").read_text().startswith("faulty: rank 0")
    left, _ = wait_no_pids(str(sleeper.out), 60)  # a hang guard: the launcher stopped them before it exited
    assert left == [], f"left behind after {sig.name}:\n{describe(left)}"


def test_sigkill_of_the_launcher_leaves_no_agent_and_no_worker(sleeper):
    workers = sleeper.wait_running(2)
    before = set(pids_mentioning(str(sleeper.out)))
    assert set(workers.values()) <= before and sleeper.pid in before and len(before) >= 4  # launcher, agent, 2 ranks
    os.kill(sleeper.pid, signal.SIGKILL)
    assert sleeper.wait(60) == -signal.SIGKILL  # 60 s: a hang guard
    left, waited = wait_no_pids(str(sleeper.out), ORPHAN_BOUND_S)
    record("SIGKILL to launcher -> last worker gone", waited)
    assert left == [], f"orphans {ORPHAN_BOUND_S}s after the launcher was SIGKILLed:\n{describe(left)}"


def test_a_second_signal_stops_at_once():
    """The first Ctrl-C asks for an orderly teardown; a second one (teardown waiting on a host
    that does not answer) ends the launcher at once. What it started dies with it, as after the
    SIGKILL above."""
    from launcher.control.api import _stop_on_signals
    from launcher.control.runloop import StopRequest

    stop = StopRequest()
    # what the test runner started with: Python's default, or SIG_IGN when run in the background
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(KeyboardInterrupt), _stop_on_signals(stop):
        os.kill(os.getpid(), signal.SIGINT)
        assert stop and stop.reason == "SIGINT"  # the first: teardown requested, nothing raised
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)  # the handler runs at the next bytecode boundary
    assert {sig: signal.getsignal(sig) for sig in before} == before  # handlers restored
