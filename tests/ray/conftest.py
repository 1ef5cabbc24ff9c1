"""A real Ray head on 127.0.0.1 for the Ray backend's tests, and process bookkeeping by pid.

The head runs as ``ray start --head --block`` in a child process on free ports with its own temp
dir and its own token (token auth on), so it never touches another Ray on this machine; at the end
its whole process tree is stopped by pid (never ``ray stop``, which would stop every Ray here).
While these tests run, pytest is a child subreaper: whatever a launcher leaves behind is
re-parented to pytest, so "no Ray process of that run remains" is checked exactly, by pid.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from launcher import procutil
from launcher.procutil import free_port, pid_alive, wait_gone

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
_PR_SET_CHILD_SUBREAPER = 36


def descendants(root: int) -> set[int]:
    return set(procutil.descendants(root))


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def live_orphans(baseline: set[int], exclude_trees: tuple[int, ...] = ()) -> list[int]:
    """Live processes under pytest that were not there before (subtrees of ``exclude_trees`` aside).
    Reaps re-parented zombies so they do not pile up."""
    mine = descendants(os.getpid())
    for root in exclude_trees:
        mine -= descendants(root) | {root}
    for pid in mine - baseline:
        if _is_zombie(pid):
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    return sorted(p for p in mine - baseline if pid_alive(p))


def wait_no_orphans(baseline: set[int], exclude_trees: tuple[int, ...] = (), timeout_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = live_orphans(baseline, exclude_trees)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = live_orphans(baseline, exclude_trees)
    return left


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture(scope="package", autouse=True)
def subreaper() -> Iterator[None]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def launch(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class RayHead:
    def __init__(self, proc: subprocess.Popen, address: str, env: dict[str, str], temp_dir: Path) -> None:
        self.proc, self.address, self.env, self.temp_dir = proc, address, env, temp_dir

    def rest(self, path: str) -> object:
        import json

        req = urllib.request.Request(self.address + path, headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())


@pytest.fixture(scope="package")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayHead]:
    temp_dir = Path(tempfile.mkdtemp(prefix="gplray-", dir="/tmp"))  # short: unix socket paths
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_TMPDIR": str(temp_dir),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    dash = free_port()
    ports = {
        "--port": free_port(),
        "--dashboard-port": dash,
        "--ray-client-server-port": free_port(),
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
        "--metrics-export-port": free_port(),
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(),
    }
    argv = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
        "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1", "--include-dashboard", "true",
        "--num-cpus", "4", "--num-gpus", "0", "--temp-dir", str(temp_dir), "--disable-usage-stats",
        "--object-store-memory", str(256 * 1024**2),
        *(f"{k}={v}" for k, v in ports.items()),
    ]
    log = open(temp_dir / "head.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    head = RayHead(proc, f"http://127.0.0.1:{dash}", env, temp_dir)
    tree: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while True:
            tree |= descendants(proc.pid)
            try:
                head.rest("/api/jobs/")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"ray head did not come up: {(temp_dir / 'head.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield head
    finally:
        tree |= descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its processes on SIGTERM
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        tree |= {p for p in descendants(os.getpid()) if str(temp_dir) in cmdline(p)}
        for pid in wait_gone([p for p in tree if pid_alive(p)], 10):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_gone(list(tree), 5)
        live_orphans(set())  # reap
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
