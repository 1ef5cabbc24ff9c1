"""The preflight's verdict in a real run over SSH: one host's link throttled with ``tc``, a spare in
the cluster file; `launch` names the slow links and the host, leaves it out, starts the job on the
other two (the spare in its place), and keeps every link's figure in ``result.json``."""

from __future__ import annotations

import json

import pytest

from tests.cluster.conftest import NetnsCluster
from tests.cluster.test_multihost import TINY, assert_clean
from tests.netns import sh

pytestmark = pytest.mark.slow


def test_a_host_with_a_slow_link_is_left_out_and_the_spare_takes_its_place(clean_after: NetnsCluster, tmp_path):
    cluster = clean_after
    cfg = cluster.cluster_yaml(tmp_path / "cluster.yaml")  # h1 h2 h3; resources.nodes: 2 -> h3 is the spare
    out = cluster.out_dir(tmp_path.name)
    victim = cluster.hosts[1]
    sh(*cluster.ns_cmd("tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "50mbit", "burst", "64kb", "latency", "100ms", ns=victim.ns))
    try:
        done = cluster.launch("jobs/matmul_scaling.yaml", "--cluster", str(cfg), "--out", str(out), "--no-metrics",
                              *TINY, "--set", "resources.nodes=2")
    finally:
        sh(*cluster.ns_cmd("tc", "qdisc", "del", "dev", "eth0", "root", ns=victim.ns), check=False)
    said = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "h2 left out (slow link h2 <-> " in said and "the spare h3 takes its place" in said, said[-3000:]
    assert "network: 6 links between 3 hosts" in said
    (run_dir,) = (out / "matmul_scaling").iterdir()
    result = json.loads((run_dir / "result.json").read_text())
    assert sorted({r["host"] for r in result["ranks"]}) == ["h1", "h3"]
    pre = result["preflight"]
    assert pre["hosts"] == ["h1", "h3"] and pre["spares"] == []
    (left,) = pre["left_out"]
    assert left["host"] == "h2" and left["replaced_by"] == "h3"
    assert pre["network"]["bad_hosts"] == ["h2"] and len(pre["network"]["links"]) == 6
    assert_clean(cluster)


def test_too_few_good_hosts_start_nothing_and_exit_2(clean_after: NetnsCluster, tmp_path):
    cluster = clean_after
    cfg = cluster.cluster_yaml(tmp_path / "cluster.yaml")
    out = cluster.out_dir(tmp_path.name)
    victim = cluster.hosts[1]
    sh(*cluster.ns_cmd("tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "50mbit", "burst", "64kb", "latency", "100ms", ns=victim.ns))
    try:
        done = cluster.launch("jobs/matmul_scaling.yaml", "--cluster", str(cfg), "--out", str(out), "--no-metrics", *TINY)  # all 3 needed
    finally:
        sh(*cluster.ns_cmd("tc", "qdisc", "del", "dev", "eth0", "root", ns=victim.ns), check=False)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "error: h2: slow link h2 <-> " in done.stderr and "2 of the 3 host(s) the job needs passed; nothing was started" in done.stderr
    assert "Traceback" not in done.stderr and not (out / "matmul_scaling").exists()
    assert_clean(cluster)
