"""Issue 37 on Ray: ``launch JOB --address URL --detach`` returns at once with the run id while
the Ray job runs on; ``launch attach RUN --address URL`` follows it with the same live view as a
foreground run (in a pseudo-terminal: the progress line; then the summary, exit 0, the run
directory brought home under ``--out``); Ctrl-C detaches (exit 0, the job still RUNNING) and
``launch stop RUN --address URL`` stops it. Every command is run as a user types it, as a
subprocess against a real Ray head on 127.0.0.1.

The job steps until the test creates its release file, so "still running" is never a race with
a job that ends by itself. Time limits here are hang guards only."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from tests.integration.faultkit import pythonpath
from tests.ray.conftest import REPO, RayHead, launch

pytestmark = pytest.mark.slow

HOLDER = (REPO / "tests" / "holder_job.py").read_text()  # the job's own code, shipped with it
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


class Terminal:
    """``launch ARGS`` in a pseudo-terminal (as a user's shell runs it): its output, read as it comes."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", *args], cwd=REPO, env={**env, "COLUMNS": "160", "LINES": "40", "TERM": "xterm"},
            stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
        )  # fmt: skip
        os.close(slave)
        self.master, self.data = master, bytearray()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                return
            if not chunk:
                return
            self.data += chunk

    def text(self) -> str:
        return ANSI.sub("", bytes(self.data).decode(errors="replace"))

    def wait_for(self, what: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s  # a hang guard
        while what not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no {what!r} (exit {self.proc.poll()}):\n{self.text()[-4000:]}")
            time.sleep(0.2)

    def wait(self, timeout_s: float = 180) -> int:
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launch still running after {timeout_s}s:\n{self.text()[-4000:]}") from None
        self._reader.join(10)
        return rc

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(10)
        os.close(self.master)


@pytest.fixture
def holder(tmp_path: Path) -> Path:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "holder_job.py").write_text(HOLDER)
    (job_dir / "holder.yaml").write_text(
        "name: holder\nentrypoint: holder_job:run\nbackend: ray\n"
        f"params: {{release: {json.dumps(str(tmp_path / 'release'))}}}\n"
        "resources: {cpu_workers: 2}\ntimeouts: {rendezvous_s: 60, run_s: 600}\n"
    )
    return job_dir / "holder.yaml"


@pytest.fixture
def user_env(ray_head: RayHead, holder: Path) -> Iterator[dict[str, str]]:
    """The environment a user's shell has: the head's token, the job's code importable here (its
    entrypoint is checked before submitting). Every Ray job the test left running is stopped."""
    env = {**os.environ, **ray_head.env, "PYTHONPATH": f"{holder.parent}{os.pathsep}{pythonpath()}", "PYTHONUNBUFFERED": "1"}
    yield env
    for job in ray_head.rest("/api/jobs/"):
        if (job.get("metadata") or {}).get("job_name") == "holder" and job.get("status") in ("PENDING", "RUNNING"):
            launch("stop", job["submission_id"], "--address", ray_head.address, env=env)


def detach(holder: Path, head: RayHead, env: dict[str, str], out: Path) -> str:
    """``launch holder.yaml --address URL --detach``: the run id it printed."""
    done = launch(str(holder), "--address", head.address, "--detach", "--out", str(out), env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(r"^run (\S+) \(Ray job holder-\1\) goes on on the cluster; follow it: launch attach \1 --address (\S+)", done.stdout, re.MULTILINE)
    assert found and found.group(2) == head.address, done.stdout + done.stderr
    assert f"launch status|logs|stop {found.group(1)} --address {head.address}" in done.stdout
    return found.group(1)


def status(run_id: str, head: RayHead, env: dict[str, str]) -> str:
    done = launch("status", run_id, "--address", head.address, "--json", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return str(json.loads(done.stdout)["status"])


def test_detach_then_attach_shows_the_run_live_to_its_summary(ray_head: RayHead, holder: Path, user_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_id = detach(holder, ray_head, user_env, out)
    assert status(run_id, ray_head, user_env) in ("PENDING", "RUNNING")  # back at once: the job goes on

    attach = Terminal("attach", run_id, "--address", ray_head.address, "--out", str(out), env=user_env)
    try:
        attach.wait_for("▶ holder: world size 2 on cpu (ray)")
        assert status(run_id, ray_head, user_env) == "RUNNING"
        attach.wait_for("world 2 ·")  # the live progress line, on a terminal
        attach.wait_for("holder: rank 1 step")
        (tmp_path / "release").touch()
        assert attach.wait() == 0, attach.text()[-4000:]
        shown = attach.text()
        assert "@gpulaunch" not in shown and "Traceback" not in shown, shown[-4000:]
        assert "succeeded" in shown, shown[-4000:]
    finally:
        attach.close()
    result = json.loads((out / "holder" / run_id / "result.json").read_text())  # brought home, as a foreground run's
    assert (result["run_id"], result["status"], result["world_size"]) == (run_id, "succeeded", 2)
    assert status(run_id, ray_head, user_env) == "SUCCEEDED"

    # attached again once it has ended: its summary and exit code at once
    again = launch("attach", run_id, "--address", ray_head.address, "--out", str(tmp_path / "again"), env=user_env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "succeeded" in again.stdout + again.stderr
    assert (tmp_path / "again" / "holder" / run_id / "result.json").is_file()


def test_ctrl_c_detaches_and_launch_stop_stops(ray_head: RayHead, holder: Path, user_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "out"
    run_id = detach(holder, ray_head, user_env, out)
    attach = Terminal("attach", run_id, "--address", ray_head.address, "--out", str(out), env=user_env)
    try:
        attach.wait_for("holder: rank 0 step")
        os.killpg(attach.proc.pid, signal.SIGINT)  # Ctrl-C at the terminal: its foreground process group
        assert attach.wait() == 0, attach.text()[-4000:]
        shown = attach.text()
        assert f"detached: Ray job holder-{run_id} goes on (launch attach {run_id} --address {ray_head.address} follows it again, " \
               f"launch stop {run_id} --address {ray_head.address} stops it)" in shown, shown[-4000:]  # fmt: skip
        assert "Traceback" not in shown, shown[-4000:]
    finally:
        attach.close()
    time.sleep(1.0)  # were the job stopped by the detach, it would say so by now
    assert status(run_id, ray_head, user_env) == "RUNNING"

    stopped = launch("stop", run_id, "--address", ray_head.address, env=user_env)
    assert (stopped.returncode, stopped.stdout) == (0, f"{run_id}: STOPPED\n"), stopped.stdout + stopped.stderr
    assert status(run_id, ray_head, user_env) == "STOPPED"
