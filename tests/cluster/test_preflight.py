"""Preflight over real SSH: every host checked in parallel, each failure names its host, and
nothing is started when any check fails."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from launcher.backends.ssh import local_torch_version
from tests.cluster.conftest import NetnsCluster
from tests.conftest import REPO

pytestmark = pytest.mark.slow

PREFLIGHT_SNIPPET = textwrap.dedent(
    """\
    import importlib, json, sys, threading, time
    from launcher.backends.ssh import preflight, remote_free_port
    checks = importlib.import_module("launcher.backends.ssh.preflight")
    from launcher.spec.cluster import load_cluster
    # every host's check waits here until all 3 are under way: checked one after another, the
    # first would wait alone and the barrier break (BrokenBarrierError: a failed preflight)
    together = threading.Barrier(3, timeout=60)
    passed = []
    real_check_host = checks.check_host
    def check_host(*args, **kwargs):
        together.wait()
        passed.append(threading.get_ident())
        return real_check_host(*args, **kwargs)
    checks.check_host = check_host
    t0 = time.monotonic()
    nodes = preflight(load_cluster(sys.argv[1]))
    t1 = time.monotonic()
    port = remote_free_port(nodes[0])
    print(json.dumps({"seconds": t1 - t0, "port_seconds": time.monotonic() - t1, "port": port, "threads": len(set(passed)),
                      "nodes": [[n.name, n.address, n.ifname, n.inventory.cpu_count, n.inventory.gpu_count] for n in nodes]}))
    """
)


def test_preflight_checks_every_host_in_parallel(netns_cluster: NetnsCluster, tmp_path):
    cfg = netns_cluster.cluster_yaml(tmp_path / "cluster.yaml")
    done = subprocess.run(
        netns_cluster.ns_cmd(sys.executable, "-c", PREFLIGHT_SNIPPET, str(cfg)), cwd=REPO, capture_output=True, text=True, timeout=300
    )  # 300 s: a hang guard
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert [n[:3] for n in data["nodes"]] == [["h1", "10.231.7.11", "eth0"], ["h2", "10.231.7.12", "eth0"], ["h3", "10.231.7.13", "eth0"]]
    assert all(n[3] >= 1 and n[4] == 0 for n in data["nodes"])  # the remote discovery ran there
    assert 1024 <= data["port"] <= 65535
    assert data["threads"] == 3, data  # in parallel: the 3 checks were under way at once, each in its own thread
    print(f"preflight of 3 hosts: {data['seconds']:.2f}s; rendezvous port pick: {data['port_seconds']:.2f}s")  # noqa: T201


def _fake_old_torch_python(tmp_path) -> str:
    """A Python for which importlib.metadata reports torch 1.0.0 (a mismatched host)."""
    site = tmp_path / "oldtorch"
    dist = site / "torch-1.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 1.0.0\n")
    wrapper = tmp_path / "python-oldtorch"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_every_failing_host_is_named_and_nothing_starts(netns_cluster: NetnsCluster, tmp_path):
    h1, h2, h3 = netns_cluster.hosts
    cfg = netns_cluster.cluster_yaml(
        tmp_path / "cluster.yaml",
        [
            {"name": "h1", "address": h1.address},
            {"name": "h2", "address": h2.address, "ifname": "ib0"},  # an interface it lacks
            {"name": "h3", "address": h3.address, "python": _fake_old_torch_python(tmp_path)},  # old torch
            {"name": "ghost", "address": "10.231.7.99", "connect_timeout_s": 2},  # no such host
            {"name": "nopython", "address": h1.address, "python": "/nonexistent/bin/python3"},
        ],
    )
    done = netns_cluster.launch(
        "jobs/matmul_scaling.yaml", "--cluster", str(cfg), "--out", str(tmp_path / "runs"), "--set", "resources.nodes=5", "--set", "scaling.workers=[5]",
    )
    assert done.returncode != 0
    err = done.stderr
    assert "h2: ifname: network interface 'ib0' not found" in err, err
    assert "h3: torch 1.0.0 does not match torch" in err and local_torch_version() in err, err
    # ssh's own connect timeout (connect_timeout_s) ended the ghost's check, not the preflight's timeout_s
    assert "ghost: unreachable over SSH (" in err and "10.231.7.99:22): ssh: connect to host 10.231.7.99 port 22: Connection timed out" in err, err
    assert "nopython: python: /nonexistent/bin/python3 not found" in err, err
    assert not [ln for ln in err.splitlines() if ln.startswith("h1")], err  # the healthy host is not blamed
    assert "nothing was started" in err
    assert not (tmp_path / "runs").exists()
    assert not netns_cluster.wait_clean()  # a hang guard: whatever the preflight started is ending
