"""A SIGTERM to ``launch`` running an embedded Ray stops the run as on every other backend: the
ranks torn down, the run marked interrupted, exit 130, nothing left. ``ray.init`` installs its own
SIGTERM handler (it would exit at once, with no result written); the launcher keeps its own."""

from __future__ import annotations

import os
import signal

import pytest

from launcher.procutil import pid_alive, wait_gone
from tests.integration.faultkit import Launched, describe, result_of, wait_no_pids, write_spec

pytestmark = pytest.mark.slow


@pytest.mark.usefixtures("no_ray_driver")
def test_a_sigterm_to_launch_with_an_embedded_ray_ends_the_run_interrupted(tmp_path) -> None:
    spec = write_spec(tmp_path, params={"fault": "sleep"}, backend="ray")
    run = Launched(spec, tmp_path / "runs")
    try:
        workers = run.wait_running(2, timeout_s=300)  # a hang guard: Ray's start on a loaded machine
        assert all(pid_alive(pid) for pid in workers.values())
        os.kill(run.pid, signal.SIGTERM)
        rc = run.wait(120)
        out = run.output()
        assert rc == 130, out
        result = result_of(run.run_dir())
        assert result["status"] == "interrupted", out
        assert result["failure"]["reason"] == "interrupted" and "SIGTERM" in result["failure"]["summary"]
        assert "Traceback" not in out, out
        assert wait_gone(list(workers.values()), 10) == [], "a rank's actor outlived the run"
        left, _ = wait_no_pids(str(run.out), 10)
        assert left == [], f"left behind after SIGTERM:\n{describe(left)}"
    finally:
        run.close()
