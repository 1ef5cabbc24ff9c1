"""Process identity: a pid read from a progress beacon is trusted only with its start time."""

from __future__ import annotations

import os
import subprocess
import sys

from launcher.procutil import process_start_ticks, stage_worker_pids, write_json_atomic


def test_stage_worker_pids_trusts_a_pid_only_with_its_recorded_start_time(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ticks = process_start_ticks(proc.pid)
        assert ticks is not None and ticks >= process_start_ticks(os.getpid())
        write_json_atomic(tmp_path / "progress" / "rank0.json", {"pid": proc.pid, "pid_start": ticks})
        write_json_atomic(tmp_path / "progress" / "rank1.json", {"pid": proc.pid, "pid_start": ticks - 1})  # a reused pid
        write_json_atomic(tmp_path / "progress" / "rank2.json", {"pid": proc.pid})  # no identity recorded
        assert stage_worker_pids(tmp_path) == {0: proc.pid}
    finally:
        proc.kill()
        proc.wait()
    assert stage_worker_pids(tmp_path) == {}
