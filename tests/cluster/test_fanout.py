"""The fan-out to many hosts: logins opened in parallel, one per host, a network check whose
rounds do not grow with the hosts, and a launcher whose own CPU per host stays small.

No wall-clock budget here: on a busy 2-core CI machine 8 hosts' logins and torch imports share
two cores with everything else, and a wall time says more about the neighbours than about the
launcher (``benchmarks/multihost_scale.py`` measures it, 2 to 32 hosts). What is asserted is what
the launcher controls: parallelism, logins per host, rounds, and its own CPU seconds per host.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, cast

import pytest

from launcher.backends.ssh import link as link_module
from launcher.backends.ssh.link import HostLinks
from launcher.backends.ssh.netcheck import ring_rounds
from launcher.spec.cluster import HostConfig
from tests.cluster.conftest import REPO, NetnsCluster, missing_tools, netns_rig, remove_stale_sets

WIDE_HOSTS = 8
# The launcher's CPU (its own process and its ssh clients) per host for a preflight with the
# network check: 0.09-0.11 s measured from 2 to 32 hosts (most of it the ssh client's key
# exchange); a per-host cost that grew with the hosts, or a serial step per host, would show.
PREFLIGHT_CPU_PER_HOST_S = 0.3


class _Host:
    def __init__(self, name: str) -> None:
        self.name = name

    def model_dump_json(self) -> str:
        return self.name


def test_logins_start_in_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every host's login is started from its own thread: 8 opens that each wait for all 8 to
    be under way complete (one at a time, the first would wait for the others forever)."""
    barrier = threading.Barrier(WIDE_HOSTS, timeout=20)
    opened: list[str] = []

    def fake_open(self: Any) -> None:
        try:
            barrier.wait()
            opened.append(self.host.name)
        finally:
            self.opened.set()

    monkeypatch.setattr(link_module.HostLink, "open", fake_open)
    links = HostLinks()
    try:
        hosts = cast("list[HostConfig]", [_Host(f"h{k}") for k in range(WIDE_HOSTS)])
        got = links.open_all(hosts)
        assert [link.host.name for link in got] == [h.name for h in hosts]
        assert sorted(opened) == sorted(h.name for h in hosts)
        assert links.get(hosts[0]) is got[0]  # one connection per host: a second get reuses it
    finally:
        links.close(wait_s=0.0)


def test_ring_rounds_do_not_grow() -> None:
    """Two rounds (one with 2 hosts) at any size; each host sends once and receives once per round."""
    for count in (2, 3, 8, 32, 128):
        rounds = ring_rounds(count)
        assert len(rounds) == (1 if count == 2 else 2)
        for pairs in rounds:
            assert sorted(src for src, _ in pairs) == list(range(count))
            assert sorted(dst for _, dst in pairs) == list(range(count))


PREFLIGHT = """\
import json, resource, sys, time
from launcher.backends.ssh import connection_scope, preflight_reports
from launcher.backends.ssh.netcheck import network_check
from launcher.spec.cluster import load_cluster
cluster = load_cluster(sys.argv[1])
cpu0 = time.process_time()
with connection_scope() as links:
    reports = preflight_reports(cluster)
    check = network_check(cluster.hosts, links, budget_s=3.0)
children = resource.getrusage(resource.RUSAGE_CHILDREN)
print("RESULT " + json.dumps({"problems": [p for r in reports for p in r.problems], "links": len(check.links),
                              "unreachable": list(check.unreachable), "cpu_s": time.process_time() - cpu0 + children.ru_utime + children.ru_stime}))
"""


@pytest.fixture(scope="module")
def wide_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    """A rig of its own (8 hosts), beside the session's 3-host one (other namespace names)."""
    reason = missing_tools()
    if reason:
        pytest.skip(reason)
    remove_stale_sets()
    with netns_rig(tmp_path_factory.mktemp("wide"), count=WIDE_HOSTS, prefix=f"glt-{os.getpid()}-w") as cluster:
        yield cluster


@pytest.mark.slow
def test_preflight_and_a_job_on_8_hosts(wide_cluster: NetnsCluster, tmp_path: Path) -> None:
    """8 hosts: the preflight and the network check pass (16 links, in two rounds), one login
    per host, the launcher's CPU per host within budget; then a job at world 8 runs on them."""
    import subprocess

    cluster = wide_cluster
    cfg = cluster.cluster_yaml(tmp_path / "cluster.yaml")
    before = [cluster.logins(h) for h in cluster.hosts]
    done = subprocess.run(cluster.ns_cmd(sys.executable, "-c", PREFLIGHT, str(cfg)), cwd=REPO, capture_output=True, text=True, timeout=180)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert done.returncode == 0 and line is not None, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(line[len("RESULT ") :])
    assert result["problems"] == [] and result["unreachable"] == []
    assert result["links"] == 2 * WIDE_HOSTS
    assert [cluster.logins(h) - n for h, n in zip(cluster.hosts, before)] == [1] * WIDE_HOSTS
    assert result["cpu_s"] / WIDE_HOSTS <= PREFLIGHT_CPU_PER_HOST_S, result

    before = [cluster.logins(h) for h in cluster.hosts]
    job = REPO / "benchmarks" / "jobs" / "allreduce.yaml"
    ran = cluster.launch(
        str(job), "--cluster", str(cfg), "--set", f"resources.nodes={WIDE_HOSTS}", "--set", "resources.cpu_workers=1",
        "--set", f"scaling.workers=[{WIDE_HOSTS}]", "--set", f"env.PYTHONPATH={REPO}", "--no-metrics",
        "--out", str(cluster.out_dir(tmp_path.name)), timeout=480,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert [cluster.logins(h) - n for h, n in zip(cluster.hosts, before)] == [1] * WIDE_HOSTS
    assert cluster.wait_clean() == {}, cluster.describe(cluster.leftovers())
