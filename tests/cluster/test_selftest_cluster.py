"""`launch selftest --cluster FILE`: every host of the file at once, in one stage over SSH (real
sshd in network namespaces, each host with its own private run directory): each node's figures
and inventory come back, the all-reduce is measured within each node and across all of them,
and the straggler made on the last host is flagged from the launching machine."""

from __future__ import annotations

import json

import pytest

from tests.cluster.test_multihost import assert_clean

pytestmark = pytest.mark.slow


def test_selftest_runs_on_every_host_of_the_cluster_file(netns_cluster, tmp_path):
    cfg = netns_cluster.cluster_yaml(tmp_path / "cluster.yaml")
    out = netns_cluster.out_dir("selftest")
    done = netns_cluster.launch("selftest", "--quick", "--json", "--cluster", str(cfg), "--out", str(out), timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    hosts = {h.name for h in netns_cluster.hosts}
    assert set(report["machine"]) == hosts and report["passed"] is True
    figures = report["figures"]
    assert {f["host"] for f in figures if f["check"] == "matmul_fp32"} == hosts
    assert len([f for f in figures if f["check"] == "matmul_fp32"]) == 2 * len(hosts)  # two ranks per host
    assert {f["host"] for f in figures if f["check"] == "allreduce_node"} == hosts  # within each node
    (across,) = [f for f in figures if f["check"] == "allreduce_all"]
    assert f"over {2 * len(hosts)} ranks" in across["detail"] and across["value"] > 0
    (straggler,) = [c for c in report["checks"] if c["check"] == "straggler"]
    last = netns_cluster.hosts[-1].name  # the slowed rank is the last: on the last host
    assert straggler["passed"] and straggler["host"] == last and straggler["detail"].startswith(f"rank {2 * len(hosts) - 1} ")
    assert_clean(netns_cluster)
