"""Issue 9: a run whose ranks are all on this machine listens on loopback alone.

torch.distributed's sockets are unauthenticated: the rendezvous store (a TCPStore server, hosted by
node 0's torchrun agent, or by rank 0 itself where no agent is: Ray, the seam's subprocess engine),
gloo's pair listeners and NCCL's bootstrap. For a stage on one machine the store listens on the
rendezvous address alone (127.0.0.1, through ``TCPStore(master_listen_fd=...)``: torch's own server
binds ``::``) and gloo and NCCL on ``lo`` (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``).

The real runs hold every rank, its group made and used, until the test has read the listening
sockets of every process of the run (``psutil``, by pid, the launcher's descendants); the job
(``hold``) is this module's. NCCL needs a GPU and is not run here.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil
import pytest

from launcher.procutil import wait_gone
from tests.conftest import REPO, pids_mentioning
from tests.integration.faultkit import pythonpath

READY_WAIT_S = 300.0  # a guard against a run that never gets its ranks ready, not a measurement


def hold(ctx: Any) -> dict[str, Any]:
    """The job: the group made and used once; then each rank says so and holds its sockets until
    the test has read them (the ``go`` file), and uses the group once more."""
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    _ready(Path(ctx.param("dir")), ctx.rank)
    _wait_for_go(Path(ctx.param("dir")), float(ctx.param("max_s", READY_WAIT_S)))
    dist.all_reduce(t)
    return {"sum": float(t[0])}


def _ready(directory: Path, rank: int) -> None:
    names = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT")
    info = {"pid": os.getpid(), **{k: os.environ.get(k) for k in names}}
    tmp = directory / f".ready{rank}"
    tmp.write_text(json.dumps(info))
    tmp.rename(directory / f"ready{rank}.json")


def _wait_for_go(directory: Path, max_s: float) -> None:
    deadline = time.monotonic() + max_s
    while not (directory / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


SCRIPT = """\
import os, sys, time, json
from pathlib import Path
import torch, torch.distributed as dist
sys.path.insert(0, {repo!r})
from tests.integration.test_loopback_only import _ready, _wait_for_go

dist.init_process_group("gloo")  # env://, as a torchrun script does
t = torch.ones(4)
dist.all_reduce(t)
_ready(Path({dir!r}), dist.get_rank())
_wait_for_go(Path({dir!r}), {max_s})
dist.all_reduce(t)
dist.destroy_process_group()
"""


# --- what is listening ------------------------------------------------------------------------------


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1, where a dual-stack socket bound 127.0.0.1
    return address.is_loopback


def listeners(pids: set[int]) -> dict[int, list[tuple[str, int]]]:
    """Every TCP socket each process listens on (IPv4 and IPv6), by pid; a process gone meanwhile has none."""
    found: dict[int, list[tuple[str, int]]] = {}
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        found[pid] = sorted({(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN})
    return found


def off_loopback(seen: dict[int, list[tuple[str, int]]]) -> dict[int, list[tuple[str, int]]]:
    return {pid: bad for pid, socks in seen.items() if (bad := [s for s in socks if not is_loopback(s[0])])}


def family(root: int) -> set[int]:
    try:
        return {root, *(p.pid for p in psutil.Process(root).children(recursive=True))}
    except psutil.Error:
        return set()


@dataclass
class Held:
    """What a held run showed while every rank held its sockets."""

    ranks: dict[int, dict[str, Any]]  # rank -> its ready file: pid, the ifnames and MASTER_* it saw
    seen: dict[int, list[tuple[str, int]]]  # pid -> its listening sockets
    cmdlines: dict[int, str] = field(default_factory=dict)

    @property
    def store(self) -> tuple[str, int]:
        info = self.ranks[0]
        return info["MASTER_ADDR"], int(info["MASTER_PORT"])

    def holders(self, address: tuple[str, int]) -> list[int]:
        return [pid for pid, socks in self.seen.items() if address in socks]


def wait_ready(directory: Path, world_size: int, running: Callable[[], bool], describe: Callable[[], str]) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + READY_WAIT_S
    while True:
        ready = sorted(directory.glob("ready*.json"))
        if len(ready) == world_size:
            return {int(p.stem.removeprefix("ready")): json.loads(p.read_text()) for p in ready}
        if not running() or time.monotonic() > deadline:
            pytest.fail(f"the ranks never got ready ({len(ready)} of {world_size}):\n{describe()}")
        time.sleep(0.1)


def hold_spec(directory: Path, backend: str = "torchrun") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    spec = directory / "hold.yaml"
    spec.write_text(
        "name: loopback_hold\n"
        "entrypoint: tests.integration.test_loopback_only:hold\n"
        f"params: {{dir: '{directory}', max_s: {READY_WAIT_S}}}\n"
        f"backend: {backend}\n"
        "resources: {nodes: 1, gpus_per_node: 0, cpu_workers: 2}\n"
        "scaling: {workers: [2]}\n"
        "timeouts: {rendezvous_s: 120}\n"
    )
    return spec


@contextlib.contextmanager
def held_launch(tmp_path: Path, *args: str) -> Iterator[tuple[subprocess.Popen[bytes], Held]]:
    """``launch`` a held run (the real console script, metrics endpoint on), read the listening
    sockets of every process under it once every rank is ready, then let the ranks finish. The run
    ends here whatever happens: SIGTERM, then SIGKILL by pid to what is left of it."""
    directory = tmp_path / "hold"
    spec = hold_spec(directory)
    log = tmp_path / "launch.log"
    env = {**os.environ, "PYTHONPATH": pythonpath(), "GPULAUNCH_PROM_SD_DIR": str(tmp_path / "sd")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", str(spec), "--out", str(tmp_path / "runs"), "--quiet", *args],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    tree: set[int] = set()
    try:
        ranks = wait_ready(directory, 2, lambda: proc.poll() is None, lambda: log.read_text()[-3000:])
        tree = family(proc.pid)
        held = Held(ranks, listeners(tree), {pid: _cmdline(pid) for pid in tree})
        (directory / "go").touch()
        proc.wait(timeout=180)
        yield proc, held
    finally:
        (directory / "go").touch()
        if proc.poll() is None:
            tree |= family(proc.pid)
            proc.send_signal(signal.SIGTERM)  # launch stops its run (and an embedded Ray) itself
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for pid in tree | family(proc.pid):
                    with contextlib.suppress(psutil.Error):
                        psutil.Process(pid).kill()
                proc.wait()
        wait_gone(sorted(tree), 30)
    assert proc.returncode == 0, log.read_text()[-3000:]


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def assert_loopback_only(held: Held) -> None:
    assert held.seen, "no process of the run was found"
    assert off_loopback(held.seen) == {}, {pid: held.cmdlines.get(pid, "")[:120] for pid in off_loopback(held.seen)}
    # what was read is the run's sockets: every rank's gloo listener, the store on the rendezvous
    for rank, info in held.ranks.items():
        assert held.seen.get(info["pid"]), f"rank {rank} (pid {info['pid']}) listens on nothing: its sockets were not seen"
        assert (info["GLOO_SOCKET_IFNAME"], info["NCCL_SOCKET_IFNAME"]) == ("lo", "lo")
    assert held.store[0] == "127.0.0.1" and held.holders(held.store), f"nothing listens on the store's {held.store}: {held.seen}"


# --- the environment and the store, unit by unit ----------------------------------------------------


def test_a_stage_on_this_machine_gets_loopback_and_one_across_nodes_its_interface(tmp_path: Path) -> None:
    from launcher.protocol import StagePaths
    from launcher.hardware.devices import NodeInventory
    from launcher.spec.cluster import HostConfig
    from launcher.stage.plan import NodeTarget, node_env

    paths = StagePaths(tmp_path)
    inventory = NodeInventory(hostname="h", cpu_count=4, gpus=(), source="test")
    here = NodeTarget("h", "127.0.0.1", inventory, sys.executable)
    env = node_env({}, here, 1, paths, multi_node=False)
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == ("lo", "lo")
    assert node_env({"GLOO_SOCKET_IFNAME": "eth9"}, here, 1, paths, multi_node=False)["GLOO_SOCKET_IFNAME"] == "eth9"  # the spec wins
    placed = NodeTarget("n", "10.0.0.2", inventory, sys.executable, ifname="eth1")
    assert node_env({}, placed, 1, paths, multi_node=True)["NCCL_SOCKET_IFNAME"] == "eth1"
    assert "GLOO_SOCKET_IFNAME" not in node_env({}, NodeTarget("n", "10.0.0.2", inventory, sys.executable), 1, paths, multi_node=True)
    remote = NodeTarget("r", "10.0.0.3", inventory, sys.executable, ifname="eth2", ssh=HostConfig(name="r", address="10.0.0.3"))
    assert node_env({}, remote, 1, paths, multi_node=False)["GLOO_SOCKET_IFNAME"] == "eth2"  # one host, but over SSH: its own interface


def test_ranks_a_scheduler_put_on_one_node_meet_on_its_loopback(tmp_path: Path) -> None:
    """Ray: the plan of the placement. One node: the rendezvous at 127.0.0.1 (rank 0's port) and
    gloo/NCCL on ``lo``, whatever the node's address; several nodes: rank 0's address, each node's interface."""
    from launcher.control.planning import make_plans, size_run
    from launcher.hardware.devices import NodeInventory
    from launcher.spec.model import load_job
    from launcher.stage.plan import NodeTarget, RankPlacement, place_ranks

    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("name: j\nentrypoint: launcher.workloads.matmul:run\nresources: {cpu_workers: 2}\n")
    spec = load_job(spec_file)
    pool = [NodeTarget("ray", "10.1.0.1", NodeInventory(hostname="ray", cpu_count=8, source="test"), sys.executable)]
    (plan,) = make_plans(spec, pool, size_run(spec, pool), run_dir=tmp_path / "run", master_port=41234)
    one = place_ranks(plan, [RankPlacement(r, "n-a", "a", "10.1.0.1", cpus=4, ifname="eth0", port=5555 if r == 0 else None) for r in (0, 1)])
    assert str(one.rendezvous) == "127.0.0.1:5555"
    assert {k: one.rank_env(one.ranks[1])[k] for k in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")} == {
        "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"
    }  # fmt: skip
    two = place_ranks(plan, [RankPlacement(0, "n-a", "a", "10.1.0.1", cpus=4, ifname="eth0", port=5555), RankPlacement(1, "n-b", "b", "10.1.0.2", cpus=4, ifname="eth1")])
    assert str(two.rendezvous) == "10.1.0.1:5555" and two.rank_env(two.ranks[1])["GLOO_SOCKET_IFNAME"] == "eth1"


def test_the_store_listens_on_the_address_it_is_given_and_nowhere_else() -> None:
    import torch.distributed as dist

    from launcher.runtime.rendezvous_store import serve_store, store_listener

    server = serve_store("127.0.0.1", 0, timedelta(seconds=10))
    assert server is not None
    port = server.port
    assert (("127.0.0.1", port)) in listeners({os.getpid()})[os.getpid()]
    assert not any(p == port and ip != "127.0.0.1" for ip, p in listeners({os.getpid()})[os.getpid()])
    client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
    client.set("k", "v")
    assert server.get("k") == b"v"
    # a port already taken: torch's own EADDRINUSE error, which the agent turns into a port retry
    with pytest.raises(dist.DistNetworkError, match="EADDRINUSE"):
        serve_store("127.0.0.1", port, timedelta(seconds=10))
    del client, server
    # a name, or an address this machine does not hold (TEST-NET-3): torch's own bind serves it
    assert store_listener("localhost", 0) is None and store_listener("203.0.113.7", 0) is None


# --- real runs ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_torchrun_run_on_one_machine_listens_on_loopback_only(tmp_path: Path) -> None:
    """``launch`` with two CPU ranks: the launcher (its /metrics), the agent (the store), the rank
    server and both ranks (gloo) listen on 127.0.0.1 alone while the group is up."""
    with held_launch(tmp_path) as (_, held):
        pass
    assert_loopback_only(held)
    # torchrun: node 0's agent serves the store, the ranks are its clients
    assert not set(held.holders(held.store)) & {info["pid"] for info in held.ranks.values()}
    assert pids_mentioning(str(tmp_path)) == []


@pytest.mark.slow
def test_rank0_serves_the_store_on_loopback_for_a_script_where_no_agent_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine without torchrun's agent (as Ray's): rank 0 serves the store, on the rendezvous
    address alone, and a ``script:``'s own ``init_process_group()`` joins it as a client."""
    import launcher
    from launcher import backends
    from tests.integration.subprocess_engine import SubprocessEngine

    monkeypatch.setattr(backends, "_ENGINES", dict(backends._ENGINES))  # put back as it was after the test
    backends.register_engine("subprocess", SubprocessEngine)
    directory = tmp_path / "hold"
    directory.mkdir()
    (tmp_path / "train.py").write_text(SCRIPT.format(repo=str(REPO), dir=str(directory), max_s=READY_WAIT_S))
    spec = tmp_path / "job.yaml"
    spec.write_text("name: loopback_script\nscript: train.py\nresources: {nodes: 1, gpus_per_node: 0, cpu_workers: 2}\nscaling: {workers: [2]}\n")
    before = family(os.getpid())
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = launcher.run_job(spec, backend="subprocess", out=tmp_path / "runs", events=launcher.RunEvents(), metrics=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            outcome["error"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        ranks = wait_ready(directory, 2, runner.is_alive, lambda: repr(outcome))
        tree = family(os.getpid()) - before
        held = Held(ranks, listeners(tree), {pid: _cmdline(pid) for pid in tree})
    finally:
        (directory / "go").touch()
        runner.join(180)
    assert "error" not in outcome, outcome
    assert outcome["result"].status == "succeeded", outcome["result"].data.get("failure")
    assert_loopback_only(held)
    assert held.holders(held.store) == [held.ranks[0]["pid"]]  # rank 0 serves it
    assert pids_mentioning(str(tmp_path)) == []


def test_an_address_off_loopback_is_named() -> None:
    seen = {1: [("127.0.0.1", 5), ("::", 6)], 2: [("::ffff:127.0.0.1", 7), ("::1", 8)], 3: [("0.0.0.0", 9)]}
    assert off_loopback(seen) == {1: [("::", 6)], 3: [("0.0.0.0", 9)]}
