"""A launcher killed outright (SIGKILL: nothing of it runs to clean up) leaves its file-SD entry
behind, and Prometheus would show its target down for ever; the next launch removes it when it
writes its own, because the entry names a launcher that is gone. Real launches, in a directory of
the test's own (GPULAUNCH_PROM_SD_DIR), never the shared /tmp/gpulaunch/prom_sd/."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from launcher.monitoring import endpoint as metrics_endpoint
from launcher.procutil import kill_now
from tests.conftest import REPO, pids_mentioning
from tests.monitoring.conftest import wait_for
from tests.waiting import wait_empty
from tests.integration.faultkit import pythonpath

SPEC = """\
name: {name}
entrypoint: tests.monitoring.stepper_job:run
params: {{seconds: {seconds}, step_s: 0.05}}
resources: {{cpu_workers: 1}}
scaling: {{workers: [1]}}
"""


def start_launch(tmp_path: Path, name: str, seconds: float, sd_dir: Path) -> tuple[subprocess.Popen, Path]:
    """``launch`` of a one-rank stepper in a child process of its own session; its --out dir."""
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(SPEC.format(name=name, seconds=seconds))
    out = tmp_path / f"runs-{name}"
    env = {**os.environ, metrics_endpoint.SD_DIR_ENV: str(sd_dir), "PYTHONPATH": pythonpath()}
    with open(tmp_path / f"{name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launcher", str(spec), "--out", str(out), "--quiet"],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, out


def entry_of(sd_dir: Path, name: str) -> Path | None:
    found = sorted(sd_dir.glob(f"{name}-*.json"))
    return found[0] if found else None


def steps_served(entry: Path) -> float:
    """The steps the entry's endpoint reports (0 until the rank steps, or if it does not answer)."""
    try:
        (group,) = json.loads(entry.read_text())
        with urllib.request.urlopen(f"http://{group['targets'][0]}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except (OSError, ValueError):
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("gpulaunch_steps_total{"))


def test_the_next_launch_removes_the_entry_of_a_launcher_killed_outright(tmp_path):
    sd_dir = tmp_path / "prom_sd"
    shared = metrics_endpoint.DEFAULT_SD_DIR
    shared_before = {p.name for p in shared.glob("*.json")} if shared.is_dir() else set()
    killed, killed_out = start_launch(tmp_path, "killed", 600, sd_dir)
    nxt = None
    try:
        entry = wait_for(lambda: entry_of(sd_dir, "killed"), 120, "the first launch's discovery entry")
        wait_for(lambda: steps_served(entry) > 0, 120, "the first launch's rank stepping, seen on its endpoint")
        owner = json.loads(entry.read_text())[0]["labels"]
        assert owner[metrics_endpoint.SD_PID_LABEL] == str(killed.pid)  # the entry names its launcher

        os.kill(killed.pid, signal.SIGKILL)  # outright: no finally, no atexit, no close()
        assert killed.wait(30) == -signal.SIGKILL
        assert entry.exists()  # left behind: nothing of that launcher is left to remove it

        nxt, _ = start_launch(tmp_path, "next", 2, sd_dir)
        mine = wait_for(lambda: entry_of(sd_dir, "next"), 120, "the second launch's discovery entry")
        assert not entry.exists()  # removed when the second launch wrote its own
        assert sorted(p.name for p in sd_dir.glob("*.json")) == [mine.name]
        assert nxt.wait(240) == 0, (tmp_path / "next.log").read_text()[-3000:]
        assert not list(sd_dir.glob("*.json"))  # the second run is over: its entry went with it
    finally:
        for proc in (killed, nxt):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # each in a session of its own
                proc.wait(30)
        # the killed launcher's ranks go with it (parent-death signal); whatever did not is stopped here
        left = wait_empty(lambda: pids_mentioning(str(killed_out)), 60)
        if left:
            kill_now(left)
    appeared = {p.name for p in shared.glob("*.json")} - shared_before if shared.is_dir() else set()
    assert not [n for n in appeared if n.startswith(("killed-", "next-"))], appeared  # never the directory a real Prometheus reads
