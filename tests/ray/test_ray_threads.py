"""Threads per rank on a Ray cluster of two nodes (both on 127.0.0.1): each rank gets its own
node's CPUs divided by the ranks placed on that node, not the whole cluster's CPUs divided by the
world size; the spec's env.OMP_NUM_THREADS wins; resources.nodes > 1 gets a Ray-specific error."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path
from typing import Iterator

import pytest

from tests.ray.conftest import RayHead, launch, ray_cluster

pytestmark = pytest.mark.slow
NODE_CPUS = 4  # each of the two nodes; the cluster has 8


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[RayHead]:
    with ray_cluster(head_cpus=NODE_CPUS, worker_cpus=(NODE_CPUS,)) as head:
        yield head


def _spec(tmp_path: Path, extra: str = "") -> Path:
    spec = tmp_path / "threads.yaml"
    spec.write_text(
        "name: threads\nentrypoint: tests.ray.threads_job:run\nbackend: ray\n"
        "resources: {cpu_workers: 2}\nscaling: {workers: [2]}\ntimeouts: {rendezvous_s: 60, run_s: 120}\n" + extra
    )
    return spec


def _connected(head: RayHead, spec: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    """The launcher as a driver connected to the cluster: what a submitted Ray job runs."""
    return launch(str(spec), "--out", str(out), *args, env={**head.env, "GPULAUNCH_RAY_CONNECT": "1", "RAY_ADDRESS": head.gcs_address})


def _ranks(out: Path) -> list[dict]:
    [found] = out.glob("threads/*/result.json")
    result = json.loads(found.read_text())
    assert result["status"] == "succeeded", result.get("failure")
    return sorted(result["ranks"], key=lambda r: r["rank"])


def test_packed_ranks_share_their_own_nodes_cpus_not_the_clusters(two_nodes: RayHead, tmp_path: Path) -> None:
    assert len(two_nodes.alive_nodes()) == 2
    run = _connected(two_nodes, _spec(tmp_path), tmp_path / "out")
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    ranks = _ranks(tmp_path / "out")
    per_node = Counter(r["result"]["node_id"] for r in ranks)
    assert list(per_node.values()) == [2], "placement pack should put both ranks on one node"
    cores = len(os.sched_getaffinity(0))  # the node's CPUs as Ray counts them, capped by real cores
    for r in ranks:
        expected = max(1, min(NODE_CPUS, cores) // per_node[r["result"]["node_id"]])
        # the plan alone would give 8 cluster CPUs / world size 2 = 4 to each rank on a 4-CPU node
        assert r["result"] == {**r["result"], "omp": str(expected), "torch_threads": expected, "ctx_threads": expected}, r


def test_the_specs_omp_num_threads_wins(two_nodes: RayHead, tmp_path: Path) -> None:
    run = _connected(two_nodes, _spec(tmp_path, "env: {OMP_NUM_THREADS: '3'}\n"), tmp_path / "out")
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-3000:]
    for r in _ranks(tmp_path / "out"):
        assert (r["result"]["omp"], r["result"]["torch_threads"], r["result"]["ctx_threads"]) == ("3", 3, 3), r


def test_several_nodes_is_a_ray_specific_error_inside_the_cluster(two_nodes: RayHead, tmp_path: Path) -> None:
    run = _connected(two_nodes, _spec(tmp_path), tmp_path / "out", "--set", "resources.nodes=2")
    assert run.returncode == 2, run.stderr[-3000:] + run.stdout[-3000:]
    assert "resources.nodes: 1" in run.stderr and "resources.cpu_workers: 4" in run.stderr and "ray.placement: spread" in run.stderr
    assert "--cluster" not in run.stderr and "Traceback" not in run.stderr
