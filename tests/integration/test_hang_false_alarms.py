"""No false alarm: twenty real runs, four at a time on this 2-core machine, with pauses shorter
than ``hang_s``, irregular steps and a rank that finishes early; none may be reported hung. (Its
own file: a long unit that pytest-xdist runs beside the injected hangs of test_hangs.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.integration.faultkit import child_env, result_of
from tests.integration.test_hangs import hang_spec

pytestmark = pytest.mark.slow

FALSE_ALARM_RUNS = 20
AT_ONCE = 4


def test_no_false_alarm_in_twenty_runs_with_pauses_irregular_steps_and_an_early_finisher(tmp_path):
    """Twenty runs, four at a time on this 2-core machine: every rank pauses hang_s/2 once (a
    checkpoint), steps take 20-120 ms at random; every fifth run, rank 1 finishes early and the
    others step on alone for longer than hang_s. None may be reported hung."""
    hang_s = 5.0
    specs = []
    for i in range(FALSE_ALARM_RUNS):
        if i % 5 == 4:
            params = {"hang": "early", "rank": 1, "at": 5, "steps": 120, "step_s": 0.06}
        else:
            params = {"hang": "pause", "at": 10, "pause_s": hang_s / 2, "steps": 25, "step_s": 0.02, "jitter_s": 0.1}
        specs.append(hang_spec(tmp_path, f"calm{i}", params=params, hang_s=hang_s))
    statuses = {}
    for batch in range(0, FALSE_ALARM_RUNS, AT_ONCE):
        procs = {
            spec.stem: subprocess.Popen([sys.executable, "-m", "launcher", str(spec), "--out", str(tmp_path / "runs"), "--no-metrics"],
                                        cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            for spec in specs[batch : batch + AT_ONCE]
        }
        try:
            for name, proc in procs.items():
                proc.wait(timeout=180)
                statuses[name] = result_of(next((tmp_path / "runs" / name).iterdir()))["status"]
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert statuses == {f"calm{i}": "succeeded" for i in range(FALSE_ALARM_RUNS)}, statuses
