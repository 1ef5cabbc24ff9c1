"""The preflight's network check over real SSH between namespace hosts: every link of the ring,
each way, has a figure within the budget; a host whose link is throttled (``tc`` token bucket on
its eth0) is named, its links called slow, and the check still takes its budget, not longer."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from tests.cluster.conftest import NetnsCluster
from tests.conftest import REPO
from tests.netns import sh

pytestmark = pytest.mark.slow

BUDGET_S = 3.0

CHECK_SNIPPET = textwrap.dedent(
    """\
    import json, sys, time
    from launcher.backends.ssh import _parallel, connection_scope
    from launcher.backends.ssh.netcheck import network_check
    from launcher.spec.cluster import load_cluster
    cluster = load_cluster(sys.argv[1])
    with connection_scope() as links:
        _parallel(lambda host: links.get(host).call("free-port"), cluster.hosts)  # logged in: the check alone is timed
        t0 = time.monotonic()
        check = network_check(cluster.hosts, links, budget_s=float(sys.argv[2]))
        wall = time.monotonic() - t0
    print(json.dumps({"wall_s": wall, **check.to_dict()}))
    """
)


def _check(cluster: NetnsCluster, tmp_path: Any) -> dict[str, Any]:
    cfg = cluster.cluster_yaml(tmp_path / "cluster.yaml")
    done = subprocess.run(cluster.ns_cmd(sys.executable, "-c", CHECK_SNIPPET, str(cfg), str(BUDGET_S)), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def _print_links(title: str, data: dict[str, Any]) -> None:
    links = ", ".join(f"{x['src']}->{x['dst']} {x['gbit_s']:.3g}" if x["gbit_s"] is not None else f"{x['src']}->{x['dst']} -" for x in data["links"])
    print(f"{title}: wall {data['wall_s']:.2f}s (check {data['seconds']:.2f}s), Gbit/s: {links}")  # noqa: T201
    for line in (*data["slow"], *data["unreachable"]):
        print(f"  {line}")  # noqa: T201


def test_every_link_of_the_ring_has_a_figure(clean_after: NetnsCluster, tmp_path):
    data = _check(clean_after, tmp_path)
    _print_links("3 hosts", data)
    pairs = sorted((x["src"], x["dst"]) for x in data["links"])
    assert pairs == [("h1", "h2"), ("h1", "h3"), ("h2", "h1"), ("h2", "h3"), ("h3", "h1"), ("h3", "h2")]
    assert all(x["error"] is None and x["gbit_s"] > 0 and x["latency_ms"] > 0 for x in data["links"]), data["links"]
    assert data["slow"] == [] and data["unreachable"] == [] and data["bad_hosts"] == []
    assert data["median_gbit_s"] > 0.1
    # its budget is plan_timing's (tests/unit/test_netcheck.py::test_both_rounds_fit_the_budget); the wall time is printed
    assert clean_after.wait_clean() == {}


def test_a_throttled_host_is_named_and_the_check_keeps_its_budget(clean_after: NetnsCluster, tmp_path):
    victim = clean_after.hosts[1]
    tbf = ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "50mbit", "burst", "64kb", "latency", "100ms"]
    sh(*clean_after.ns_cmd(*tbf, ns=victim.ns))
    try:
        data = _check(clean_after, tmp_path)
    finally:
        sh(*clean_after.ns_cmd("tc", "qdisc", "del", "dev", "eth0", "root", ns=victim.ns), check=False)
    _print_links("3 hosts, h2 throttled to 50 Mbit/s", data)
    assert data["bad_hosts"] == [victim.name], data
    slow_from_victim = {x["dst"] for x in data["links"] if x["src"] == victim.name and x["gbit_s"] < 0.5 * data["median_gbit_s"]}
    assert slow_from_victim == {"h1", "h3"}, data["links"]  # tbf shapes what h2 sends: both its outgoing links
    assert len(data["slow"]) == 2 and all(line.startswith(f"slow link {victim.name} <-> ") for line in data["slow"]), data["slow"]
    assert all(x["gbit_s"] < 0.06 for x in data["links"] if x["src"] == victim.name)  # 50 Mbit/s, give or take the burst
    # What reaches h2 is not shaped, but h2's answers (SYN-ACKs, ACKs, ping echoes) queue behind
    # its own bulk send in the same full token bucket: a link into it comes out slow, or, when a
    # SYN-ACK is dropped twice, without an answer in time. Either way it is h2 that is named.
    assert all(line.startswith(f"{victim.name}: no answer on eth0 from ") for line in data["unreachable"]), data["unreachable"]
    assert clean_after.wait_clean() == {}
