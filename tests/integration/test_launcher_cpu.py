"""result.json's phases.launcher_cpu_s: the launcher's own CPU seconds before the first rank is
spawned and after the last has exited, by phase (what benchmarks/launcher_cpu.py holds to a budget)."""

from __future__ import annotations

import json

from launcher.control.cpuclock import AFTER_EXIT, BEFORE_SPAWN
from tests.conftest import REPO, launch
from tests.integration.faultkit import pythonpath


def test_a_run_records_the_launchers_own_cpu_by_phase(tmp_path):
    done = launch(str(REPO / "benchmarks" / "jobs" / "allreduce.yaml"), "--quiet", "--out", str(tmp_path), env={"PYTHONPATH": pythonpath()})
    assert done.returncode == 0, done.stderr
    (found,) = tmp_path.glob("*/*/result.json")
    phases = json.loads(found.read_text())["phases"]
    assert {"spawn", "import", "aggregate"} <= set(phases)  # the stage's phases are still there
    cpu = phases["launcher_cpu_s"]
    assert set(cpu) == {"before_spawn", "after_exit", "total", "by_phase"}
    by_phase = cpu["by_phase"]
    assert set(BEFORE_SPAWN) | set(AFTER_EXIT) | {"running"} == set(by_phase)
    assert all(isinstance(v, float) and v >= 0 for v in by_phase.values())
    # the interpreter and the imports alone are tens of milliseconds: counted (the budget on these
    # figures is benchmarks/launcher_cpu.py's, never a bound in a test)
    assert cpu["before_spawn"] > 0.01 and cpu["after_exit"] >= 0
    assert abs(cpu["before_spawn"] - sum(by_phase[p] for p in BEFORE_SPAWN)) < 0.01
    assert abs(cpu["after_exit"] - sum(by_phase[p] for p in AFTER_EXIT)) < 0.01
    assert cpu["total"] >= cpu["before_spawn"] + cpu["after_exit"]
