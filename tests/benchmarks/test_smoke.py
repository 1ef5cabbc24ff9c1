"""The benchmarks run (smoke mode: tiny sizes, one repetition) and write their JSON.

No timing is asserted here: timings on a shared CI machine mean nothing. BENCHMARKS.md holds the
figures, measured with `python benchmarks/run_all.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


# a hang guard, not a time limit: six benchmarks one after the other take 1-2 min on a quiet
# 2-core machine and over 4 min beside a loaded suite (seen at load 15-18)
@pytest.mark.timeout(960)
def test_run_all_smoke_completes_and_writes_json(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run_all.py"), "--smoke", "--out-dir", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "all.json").read_text())
    assert summary["failed"] == {}, summary["failed"]
    for name in ("cli_latency", "recorder_overhead", "startup", "throughput", "scaling", "event_path"):
        data = json.loads((tmp_path / f"{name}.json").read_text())
        assert data["mode"] == "smoke"
        assert data["machine"]["cores"] >= 1
