"""A real Ray head on 127.0.0.1 for the Ray backend's tests, and process bookkeeping by pid.

The head runs as ``ray start --head --block`` in a child process on free ports with its own temp
dir and its own token (token auth on), so it never touches another Ray on this machine; at the end
its whole process tree is stopped by pid (never ``ray stop``, which would stop every Ray here).
``ray_cluster`` adds more nodes on the same machine for multi-node tests. While these tests run,
pytest is a child subreaper: whatever a launcher leaves behind is re-parented to pytest, so "no Ray process of that run remains" is checked exactly, by pid.

``ray_driver`` connects this pytest process itself to the session's head as a Ray driver (as a
notebook's ``ray.init(address=...)`` would), once, so the tests of the backend's behaviour call
``launcher.run_job`` in-process on a Ray that is already running instead of starting one per test.
Every other test runs with no Ray initialized in this process (``no_ray_driver`` says so where the
subject is the embedded Ray's lifecycle).
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
from launcher.procutil import pid_alive, wait_gone
from tests.ports import unshared_port
from tests.integration.faultkit import pythonpath

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[2]
_PR_SET_CHILD_SUBREAPER = 36
# the root pids of the clusters ``ray_cluster`` runs: their trees start and stop workers of their
# own while a test runs (actors, job supervisors), which are not a launcher's leftovers
_CLUSTER_ROOTS: set[int] = set()
_LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray keeps 127.0.0.1 (no swap for the machine's address)


def descendants(root: int) -> set[int]:
    return set(procutil.descendants(root))


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def live_orphans(baseline: set[int], exclude_trees: tuple[int, ...] = ()) -> list[int]:
    """Live processes under pytest that were not there before (subtrees of ``exclude_trees`` and of
    the running ``ray_cluster`` heads and nodes aside). Reaps re-parented zombies so they do not pile up."""
    mine = descendants(os.getpid())
    for root in (*exclude_trees, *_CLUSTER_ROOTS):
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
        env={**os.environ, "PYTHONPATH": pythonpath(), **(env or {})},
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

    def actors(self, name_prefix: str) -> list[dict]:
        """Every actor whose name starts with ``name_prefix``, dead ones included."""
        actors = self.rest("/api/v0/actors?limit=1000")["data"]["result"]["result"]
        return [a for a in actors if a.get("name", "").startswith(name_prefix)]

    def live_placement_groups(self, name_prefix: str) -> list[dict]:
        """The placement groups whose name starts with ``name_prefix`` and that are not REMOVED."""
        groups = self.rest("/api/v0/placement_groups?limit=1000")["data"]["result"]["result"]
        return [g for g in groups if g.get("name", "").startswith(name_prefix) and g.get("state") != "REMOVED"]

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
    return {name: unshared_port() for name in names}


@contextlib.contextmanager
def ray_cluster(head_cpus: int = 4, worker_cpus: tuple[int, ...] = ()) -> Iterator[RayHead]:
    """A Ray head on 127.0.0.1 (``head_cpus`` CPUs, no GPU) and one more node per ``worker_cpus``
    entry on the same machine, token auth on, free ports, its own temp dir. On exit every process
    of it is stopped, by pid. A head alone listens on 127.0.0.1 only, as an embedded Ray does
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``; Ray refuses more nodes then, so a cluster of
    several nodes keeps Ray's default: its servers listen on every interface, token auth on)."""
    temp_dir = Path(tempfile.mkdtemp(prefix="gplray-", dir="/tmp"))  # short: unix socket paths
    env = {
        # not what a connected ``RayDriver`` put in this process's environment (RAY_ADDRESS, the
        # loopback-only flag, which makes the other nodes of a cluster refuse to start)
        **{k: v for k, v in os.environ.items() if k not in _DRIVER_ENV},
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_TMPDIR": str(temp_dir),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_USAGE_STATS_ENABLED": "0",
        **({} if worker_cpus else {_LOOPBACK_ONLY_ENV: "0"}),
    }
    common = ("--node-ip-address", "127.0.0.1", "--num-gpus", "0", "--disable-usage-stats", "--object-store-memory", str(256 * 1024**2))
    dash, gcs = unshared_port(), unshared_port()
    head_argv = _ray_argv(
        "--head", "--dashboard-host", "127.0.0.1", "--include-dashboard", "true", "--num-cpus", str(head_cpus),
        "--temp-dir", str(temp_dir), *common,
        port=gcs, dashboard_port=dash, ray_client_server_port=unshared_port(), **_node_ports(),
    )
    logs = [open(temp_dir / "head.log", "w")]  # noqa: SIM115
    procs = [subprocess.Popen(head_argv, env=env, stdout=logs[0], stderr=subprocess.STDOUT, start_new_session=True)]
    _CLUSTER_ROOTS.add(procs[0].pid)
    head = RayHead(procs[0], f"http://127.0.0.1:{dash}", env, temp_dir)
    head.gcs_address = f"127.0.0.1:{gcs}"
    tree: set[int] = set()  # every pid of the cluster seen while it started
    try:
        _wait_until(lambda: _answers(head), procs, temp_dir, tree)
        # the other nodes once the head answers: a node started beside it gives up on a GCS that a
        # loaded machine has not brought up within Ray's own connect timeout, and the cluster is short
        for k, cpus in enumerate(worker_cpus, 1):
            logs.append(open(temp_dir / f"node{k}.log", "w"))  # noqa: SIM115
            argv = _ray_argv(f"--address={head.gcs_address}", "--num-cpus", str(cpus), *common, **_node_ports())
            procs.append(subprocess.Popen(argv, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True))
            _CLUSTER_ROOTS.add(procs[-1].pid)
        if worker_cpus:
            _wait_until(lambda: len(head.alive_nodes()) == 1 + len(worker_cpus), procs, temp_dir, tree)
        yield head
    finally:
        try:
            if DRIVER.head is head:  # this process must not stay a driver of a cluster that is going away
                DRIVER.disconnect()
        finally:
            _kill_cluster(procs, temp_dir, tree)
            _CLUSTER_ROOTS.difference_update(p.pid for p in procs)
            live_orphans(set())  # reap
            for log in logs:
                log.close()
            shutil.rmtree(temp_dir, ignore_errors=True)


def _kill_cluster(procs: list[subprocess.Popen], temp_dir: Path, tree: set[int]) -> None:
    """SIGKILL every process of a ``ray_cluster``, by pid, all at once: the cluster is the fixture's
    alone and its temp dir goes with it (``ray start --block`` on SIGTERM stops its processes one
    after the other, a second or more each, and a raylet whose GCS went first waits for it). Again
    for a process started meanwhile (re-parented to pytest, the subreaper; known by the temp dir)."""
    for _ in range(5):
        found = {p for proc in procs if proc.poll() is None for p in (proc.pid, *descendants(proc.pid))}
        found |= {p for p in (*descendants(os.getpid()), *tree) if str(temp_dir) in cmdline(p)}
        if not found:
            return
        ticks = {p: procutil.process_start_ticks(p) for p in found}  # against pid reuse
        for pid in found:
            if procutil.process_start_ticks(pid) == ticks[pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in procs:
            proc.wait()
        wait_gone(list(found), 5)
        live_orphans(set())  # reap the ones re-parented to pytest


def _answers(head: RayHead) -> bool:
    try:
        head.rest("/api/jobs/")
    except OSError:
        return False
    return True


def _wait_until(ready: Callable[[], bool], procs: list[subprocess.Popen], temp_dir: Path, tree: set[int], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        for proc in procs:
            tree |= descendants(proc.pid)
        if ready():
            return
        exited = [(p.args[3], p.returncode) for p in procs if p.poll() is not None]
        if exited or time.monotonic() > deadline:
            logs = "\n".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in sorted(temp_dir.glob("*.log")))
            pytest.fail(f"ray did not come up ({'exited: ' + str(exited) if exited else f'not ready after {timeout_s:g}s'}):\n{logs}")
        time.sleep(0.5)


@pytest.fixture(scope="package")
def ray_head() -> Iterator[RayHead]:
    with ray_cluster() as head:
        yield head


# --- this pytest process as a Ray driver on the session's head ---------------------------------------

_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# what ray.init sets in the driver's environment, put back on disconnect (later `launch` children inherit it)
_DRIVER_ENV = (*_AUTH_ENV, "PYTHONBREAKPOINT", "RAY_ADDRESS", _LOOPBACK_ONLY_ENV)
DRIVER_NAMESPACE = "gpulaunch-tests"


class RayDriver:
    """The pytest process connected to one ``RayHead`` with the head's token; reconnects cheaply
    (the first ``ray.init`` of a process is the slow one). Ray caches its auth mode and token when
    it is imported, so they are refreshed the way Ray's own tests do (``authentication_test_utils``)."""

    def __init__(self) -> None:
        self.head: RayHead | None = None
        self._saved: dict[str, str | None] = {}

    def connect(self, head: RayHead) -> None:
        import logging

        import ray
        from ray._private import authentication_test_utils as auth
        from ray._private import ray_constants

        if self.head is head and ray.is_initialized():
            return
        self.disconnect()
        assert not ray.is_initialized(), "another Ray is initialized in this process"
        self._saved = {k: os.environ.get(k) for k in _DRIVER_ENV}
        auth.set_auth_mode("token")
        auth.set_env_auth_token(head.env["RAY_AUTH_TOKEN"])
        auth.reset_auth_token_state()
        # A loopback-only head: this process must not swap 127.0.0.1 for the machine's address
        # either (Ray read the variable when it was imported; the launcher's embedded Ray does the
        # same). Ray puts the driver's working directory on its workers' sys.path: started in the
        # checkout, the ranks import the tests' workloads (tests.integration.faulty,
        # tests.ray.threads_job) wherever pytest itself was started from.
        loopback = head.env.get(_LOOPBACK_ONLY_ENV) == "0"
        saved_flag = ray_constants.ENABLE_RAY_CLUSTER
        if loopback:
            os.environ[_LOOPBACK_ONLY_ENV] = "0"
            ray_constants.ENABLE_RAY_CLUSTER = False
        try:
            with contextlib.chdir(REPO):
                ray.init(address=head.gcs_address, namespace=DRIVER_NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
        finally:
            ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        self.head = head

    def disconnect(self) -> None:
        import ray
        from ray._private import authentication_test_utils as auth

        if ray.is_initialized():
            ray.shutdown()
        if self.head is not None:
            for key, value in self._saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            auth.reset_auth_token_state()  # after the shutdown: see reset_auth_token_state
            self.head = None


DRIVER = RayDriver()  # one per process: Ray allows one connection; ``ray_cluster`` disconnects it before stopping


@pytest.fixture
def driver() -> RayDriver:
    """The process's ``RayDriver``, for a test that connects it (to ``ray_head`` or another cluster)."""
    return DRIVER


@pytest.fixture(autouse=True)
def _driver_only_where_asked(request: pytest.FixtureRequest) -> None:
    """A test that does not ask for ``driver`` (or ``ray_driver``) runs with no Ray initialized in
    this process, whatever ran before it: ``run_job`` there starts an embedded Ray, as it would for
    a user. Reconnecting later costs a few milliseconds."""
    if "driver" not in request.fixturenames:
        DRIVER.disconnect()


@pytest.fixture
def ray_driver(driver: RayDriver, ray_head: RayHead) -> Iterator[RayHead]:
    """This process is a Ray driver on the session's head: ``launcher.run_job(..., backend="ray")``
    reuses that connection (it neither starts nor stops a Ray). Every test leaves no actor and no
    placement group of its job behind (checked by the test, which knows the job's name)."""
    driver.connect(ray_head)
    yield ray_head


@pytest.fixture
def no_ray_driver() -> None:
    """No Ray is initialized in this process, so ``run_job`` and ``launch`` start an embedded one."""
    DRIVER.disconnect()
    import ray

    assert not ray.is_initialized()


def assert_ray_run_left_nothing(head: RayHead, job: str, pids: list[int]) -> None:
    """No actor and no placement group of ``job`` is alive on ``head`` and the ranks' processes
    (``pids``, as they reported them) are gone: the backend removed what it created."""
    assert wait_gone([p for p in pids if pid_alive(p)], 10) == [], "a rank's process is still alive"
    deadline = time.monotonic() + 10
    while (head.live_actors(f"{job}-rank") or head.live_placement_groups(f"{job}-world")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert head.live_actors(f"{job}-rank") == [], "an actor of the run is still alive"
    assert head.live_placement_groups(f"{job}-world") == [], "a placement group of the run is still there"
