"""Threads per rank on a Ray cluster of two nodes (both on 127.0.0.1): each rank gets its own
node's CPUs divided by the ranks placed on that node, not the whole cluster's CPUs divided by the
world size; the spec's env.OMP_NUM_THREADS wins; resources.nodes > 1 gets a Ray-specific error.

The launcher runs in this process as the driver a submitted Ray job runs (connected to the
cluster, ``GPULAUNCH_RAY_CONNECT`` set): it plans on the cluster, not on this machine."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Iterator

import pytest

import launcher
from launcher.errors import LauncherError
from launcher.protocol import ENV_RAY_CONNECT
from tests.ray.conftest import RayDriver, RayHead, assert_ray_run_left_nothing, ray_cluster

pytestmark = pytest.mark.slow
NODE_CPUS = 4  # each of the two nodes; the cluster has 8


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[RayHead]:
    with ray_cluster(head_cpus=NODE_CPUS, worker_cpus=(NODE_CPUS,)) as head:
        yield head


@pytest.fixture
def connected(driver: RayDriver, two_nodes: RayHead, monkeypatch: pytest.MonkeyPatch) -> RayHead:
    """This process as the launcher inside a Ray job on ``two_nodes``: what a submitted job runs."""
    driver.connect(two_nodes)
    monkeypatch.setenv(ENV_RAY_CONNECT, "1")
    return two_nodes


def _spec(tmp_path: Path, extra: str = "") -> Path:
    spec = tmp_path / "threads.yaml"
    spec.write_text(
        "name: threads\nentrypoint: tests.ray.threads_job:run\nbackend: ray\n"
        "resources: {cpu_workers: 2}\nscaling: {workers: [2]}\ntimeouts: {rendezvous_s: 60, run_s: 120}\n" + extra
    )
    return spec


def _ranks(head: RayHead, spec: Path, out: Path, *overrides: str) -> list[dict]:
    run = launcher.run_job(spec, overrides=list(overrides), backend="ray", out=out, events=launcher.RunEvents())
    assert run.status == "succeeded" and run.exit_code == 0, run.data.get("failure")
    ranks = sorted(run.data["ranks"], key=lambda r: r["rank"])
    assert_ray_run_left_nothing(head, "threads", [r["pid"] for r in ranks])
    return ranks


def test_packed_ranks_share_their_own_nodes_cpus_not_the_clusters(connected: RayHead, tmp_path: Path) -> None:
    assert len(connected.alive_nodes()) == 2
    ranks = _ranks(connected, _spec(tmp_path), tmp_path / "out")
    per_node = Counter(r["result"]["node_id"] for r in ranks)
    assert list(per_node.values()) == [2], "placement pack should put both ranks on one node"
    cores = len(os.sched_getaffinity(0))  # the node's CPUs as Ray counts them, capped by real cores
    for r in ranks:
        expected = max(1, min(NODE_CPUS, cores) // per_node[r["result"]["node_id"]])
        # the plan alone would give 8 cluster CPUs / world size 2 = 4 to each rank on a 4-CPU node
        assert r["result"] == {**r["result"], "omp": str(expected), "torch_threads": expected, "ctx_threads": expected}, r


def test_the_specs_omp_num_threads_wins(connected: RayHead, tmp_path: Path) -> None:
    for r in _ranks(connected, _spec(tmp_path, "env: {OMP_NUM_THREADS: '3'}\n"), tmp_path / "out"):
        assert (r["result"]["omp"], r["result"]["torch_threads"], r["result"]["ctx_threads"]) == ("3", 3, 3), r


def test_several_nodes_is_a_ray_specific_error_inside_the_cluster(connected: RayHead, tmp_path: Path) -> None:
    with pytest.raises(LauncherError) as refused:
        launcher.run_job(_spec(tmp_path), overrides=["resources.nodes=2"], backend="ray", out=tmp_path / "out", events=launcher.RunEvents())
    message = str(refused.value)
    assert refused.value.exit_code == 2, message
    assert "resources.nodes: 1" in message and "resources.cpu_workers: 4" in message and "ray.placement: spread" in message
    assert "--cluster" not in message
    assert not (tmp_path / "out").exists()  # refused before anything ran
