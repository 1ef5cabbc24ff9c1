"""The rendezvous port race over SSH: the port the launcher picked on the first host is taken
before that host's agent binds it. The agent's exit code 98 must come back through ssh and the
remote wrapper, and the stage must run again on a new port chosen on that host.

As in tests/integration/test_port_race.py, the race cannot be timed from outside: the launcher
runs through a small driver that hands out, once, a port that a process of this test already
listens on in the first host's namespace. Everything else (ssh, the remote agent and its bind
failure, the retry) is real.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cluster.conftest import REPO, NetnsCluster
from tests.cluster.test_multihost import TINY, assert_clean

pytestmark = pytest.mark.slow

# Replaces launcher.backends.ssh.remote_free_port for its first call only; argv: PORT LAUNCH-ARGS...
DRIVER = """\
import sys
import launcher.backends.ssh as cluster
real, taken = cluster.remote_free_port, [int(sys.argv[1])]
handed_out = []
def first_taken_then_real(target):
    handed_out.append(taken.pop() if taken else real(target))
    print(f"driver: port {handed_out[-1]} for {target.name}", file=sys.stderr, flush=True)
    return handed_out[-1]
cluster.remote_free_port = first_taken_then_real
from launcher.ui.cli import main
sys.exit(main(sys.argv[2:]))
"""

HOLDER = """\
import socket, sys
sock = socket.socket()
sock.bind((sys.argv[1], 0))
sock.listen()
print(sock.getsockname()[1], flush=True)
sys.stdin.read()  # hold the port until the test closes our stdin
"""


@pytest.fixture
def port_held_on_first_host(netns_cluster: NetnsCluster):
    first = netns_cluster.hosts[0]
    holder = subprocess.Popen(
        netns_cluster.ns_cmd(sys.executable, "-c", HOLDER, first.address, ns=first.ns),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )

    def release() -> None:
        if holder.poll() is None:
            holder.stdin.close()
            try:
                holder.wait(10)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait(10)

    try:
        yield int(holder.stdout.readline()), release
    finally:
        release()


def test_a_port_lost_on_a_remote_host_is_replaced_there(netns_cluster, port_held_on_first_host, tmp_path, clean_after):
    taken, release_port = port_held_on_first_host
    cfg = netns_cluster.cluster_yaml(tmp_path / "cluster.yaml")
    out = netns_cluster.out_dir(tmp_path.name)  # each host's run directory is its own
    done = subprocess.run(
        netns_cluster.ns_cmd(
            sys.executable, "-c", DRIVER, str(taken),
            "jobs/matmul_scaling.yaml", "--cluster", str(cfg), "--out", str(out), *TINY,
        ),
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    handed = [int(line.split()[2]) for line in done.stderr.splitlines() if line.startswith("driver: port ")]
    assert handed[0] == taken and len(handed) == 2 and handed[1] != taken, done.stderr[-2000:]
    (run_dir,) = (out / "matmul_scaling").iterdir()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "succeeded" and result["world_size"] == 3
    first = netns_cluster.hosts[0].address
    assert {r["rendezvous"] for r in result["ranks"]} == {f"{first}:{handed[1]}"}
    assert result["stages"][0]["restarts"] == 0  # a lost port race is not a restart
    stage = run_dir / "world3"
    assert sorted(p.name for p in stage.glob("port-retry*")) == ["port-retry1"]
    first_try = "\n".join(p.read_text() for p in (stage / "port-retry1" / "logs").glob("*.log"))
    assert f"rendezvous port {taken} is already in use" in first_try, first_try[-2000:]
    release_port()
    assert_clean(netns_cluster, timeout_s=10)
