"""A real Ray head on 127.0.0.1 for the Ray backend's tests, and process bookkeeping by pid.

The head runs as ``ray start --head --block`` in a child process on free ports with its own temp
dir and its own token (token auth on), so it never touches another Ray on this machine; at the end
its whole process tree is stopped by pid (never ``ray stop``, which would stop every Ray here).
``ray_cluster`` adds more nodes on the same machine for multi-node tests. While these tests run,
pytest is a child subreaper: whatever a launcher leaves behind is re-parented to pytest, so "no Ray process of that run remains" is checked exactly, by pid.
"""

from __future__ import annotations

import contextlib
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
from typing import Callable, Iterator

import psutil
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
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
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
    """The command line as one string ("" once the process is gone)."""
    return " ".join(procutil.cmdline(pid))


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
        self.gcs_address = ""

    def rest(self, path: str) -> object:
        import json

        req = urllib.request.Request(self.address + path, headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def live_actors(self, name_prefix: str) -> list[dict]:
        """The actors whose name starts with ``name_prefix`` and that are not DEAD."""
        actors = self.rest("/api/v0/actors?limit=1000")["data"]["result"]["result"]
        return [a for a in actors if a.get("name", "").startswith(name_prefix) and a.get("state") != "DEAD"]

    def alive_nodes(self) -> list[dict]:
        try:
            nodes = self.rest("/api/v0/nodes?limit=100")["data"]["result"]["result"]
        except (OSError, KeyError, TypeError):
            return []
        return [n for n in nodes if n.get("state") == "ALIVE"]


def _ray_argv(*args: str, **ports: int) -> list[str]:
    return [str(Path(sys.executable).parent / "ray"), "start", "--block", *args, *(f"--{k.replace('_', '-')}={v}" for k, v in ports.items())]


def _node_ports() -> dict[str, int]:
    names = ("node_manager_port", "object_manager_port", "metrics_export_port", "dashboard_agent_listen_port",
             "dashboard_agent_grpc_port", "runtime_env_agent_port")
    return {name: free_port() for name in names}


@contextlib.contextmanager
def ray_cluster(head_cpus: int = 4, worker_cpus: tuple[int, ...] = ()) -> Iterator[RayHead]:
    """A Ray head on 127.0.0.1 (``head_cpus`` CPUs, no GPU) and one more node per ``worker_cpus``
    entry on the same machine, token auth on, free ports, its own temp dir. On exit every process
    of it is stopped, by pid."""
    temp_dir = Path(tempfile.mkdtemp(prefix="gplray-", dir="/tmp"))  # short: unix socket paths
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_TMPDIR": str(temp_dir),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    common = ("--node-ip-address", "127.0.0.1", "--num-gpus", "0", "--disable-usage-stats", "--object-store-memory", str(256 * 1024**2))
    dash, gcs = free_port(), free_port()
    head_argv = _ray_argv(
        "--head", "--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--num-cpus", str(head_cpus),
        "--temp-dir", str(temp_dir), *common,
        port=gcs, dashboard_port=dash, ray_client_server_port=free_port(), **_node_ports(),
    )
    logs = [open(temp_dir / "head.log", "w")]  # noqa: SIM115
    procs = [subprocess.Popen(head_argv, env=env, stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True)]
    head = RayHead(procs[0], f"http://127.0.0.1:{dash}", env, temp_dir)
    head.gcs_address = f"127.0.0.1:{gcs}"
    tree: set[int] = set()
    try:
        _wait_until(lambda: _answers(head), procs, temp_dir / "head.log", tree)
        for k, cpus in enumerate(worker_cpus, 1):
            logs.append(open(temp_dir / f"node{k}.log", "w"))  # noqa: SIM115
            argv = _ray_argv(f"--address={head.gcs_address}", "--num-cpus", str(cpus), *common, **_node_ports())
            procs.append(subprocess.Popen(argv, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True))
            _wait_until(lambda k=k: len(head.alive_nodes()) == k + 1, procs, temp_dir / f"node{k}.log", tree)
        yield head
    finally:
        for proc in procs:
            tree |= descendants(proc.pid)
        for proc in reversed(procs):
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
        for log in logs:
            log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _answers(head: RayHead) -> bool:
    try:
        head.rest("/api/jobs/")
    except OSError:
        return False
    return True


def _wait_until(ready: Callable[[], bool], procs: list[subprocess.Popen], log: Path, tree: set[int], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for proc in procs:
            tree |= descendants(proc.pid)
        if ready():
            return
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            pytest.fail(f"ray did not come up: {log.read_text()[-2000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="package")
def ray_head() -> Iterator[RayHead]:
    with ray_cluster() as head:
        yield head
