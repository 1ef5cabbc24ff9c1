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


def _slurm_dry_run(tmp_path, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200", **env_extra}
    return subprocess.run(
        [sys.executable, "-m", "launcher", "jobs/matmul_scaling.yaml", "--backend", "slurm", "--dry-run", "--set", "resources.nodes=2",
         "--set", "scaling.workers=[2,4]", "--set", "resources.cpu_workers=2", "--out", str(tmp_path / "runs")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_slurm_dry_run_without_slurm_prints_the_script_and_says_what_it_could_not_check(tmp_path):
    """No Slurm client here at all (as on a laptop): the sbatch script and every node's srun line
    are still printed, on placeholder nodes, with one line saying the partition was not checked."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").symlink_to(sys.executable)
    done = _slurm_dry_run(tmp_path, {"PATH": str(bare)})
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "#SBATCH --nodes=2" in out and "#SBATCH --ntasks-per-node=1" in out and "#SBATCH --cpus-per-task=2" in out
    assert "[NODE1] $ srun --nodes=1 --ntasks=1 --nodelist=NODE1" in out and "[NODE2] $ srun" in out and "--partition" not in out
    assert "note: could not reach Slurm (sinfo: command not found" in out and "the nodes shown are placeholders" in out
    assert "dry run: nothing was started" in out and not (tmp_path / "runs").exists()


def test_a_slurm_dry_run_with_no_controller_to_ask_says_so_in_slurms_own_words(tmp_path):
    """Slurm's commands are installed but no controller is configured (CI, a login node whose
    slurm.conf is elsewhere): sinfo's own message, and the script all the same."""
    import shutil

    import pytest

    if shutil.which("sinfo") is None:
        pytest.skip("needs Slurm's client commands (apt-get install slurm-wlm)")
    done = _slurm_dry_run(tmp_path, {"SLURM_CONF": str(tmp_path / "no-such-slurm.conf")})
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --nodes=2" in done.stdout and "note: could not reach Slurm (sinfo -h -N" in done.stdout, done.stdout


def test_piped_dry_run_prints_every_log_path_whole_on_one_line(tmp_path):
    """Piped at 80 columns, a log path in the rank table was folded mid-word
    (``runs/matmul_s│caling/<run-id>/world1/logs/ran│k0.log``): each is on a line of its own."""
    out = tmp_path / "team runs" / "a directory name long enough to fill most of a line by itself"
    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-m", "launcher", "jobs/matmul_scaling.yaml", "--dry-run", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    paths = [f"{out}/matmul_scaling/<run-id>/world{ws}/logs/rank{r}.log" for ws in (1, 2) for r in range(ws)]
    for path in paths:  # the scaling run's two stages: world 1 (rank 0), world 2 (ranks 0, 1)
        assert sum(line.endswith(f"log: {path}") for line in lines) == 1, done.stdout
    assert not any("│" in line and "logs" in line for line in lines), done.stdout  # no path left in a table
    assert all(len(line) <= 80 for line in lines if line[:1] in "┃│┏┡└━─"), done.stdout  # the tables fit
