"""Piped ``--dry-run`` output keeps every command on one line: it can be copied and run as is."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from tests.conftest import REPO


def test_piped_dry_run_commands_are_whole_lines_that_shlex_can_split(tmp_path):
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-m", "launcher", "jobs/matmul_scaling.yaml", "--dry-run", "--out", str(tmp_path / "a dir")],
                          cwd=REPO, env=env, capture_output=True, text=True, check=True)
    commands = [ln for ln in done.stdout.splitlines() if " $ torchrun " in ln]
    assert len(commands) == 2  # one per stage of the scaling run
    for line in commands:
        argv = shlex.split(line.partition(" $ ")[2])
        assert argv[0] == "torchrun" and argv[-1].endswith("worker.json") and "--nproc-per-node" in line
        assert any(a.startswith("--log-dir=") and "a dir" in a for a in argv)  # a quoted path survives whole
    assert any(len(line) > 80 for line in commands)  # longer than the terminal, and still one line
