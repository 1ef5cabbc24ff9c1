"""A whole host lost mid-run, recovered in place: its ranks start again on the spare host of the
cluster file while the other host's ranks keep their processes, and the state comes from their
memory (``launcher.backends.host_inplace``). Each namespace host's run directory is its own
tmpfs: the spare has nothing of the run but what the launcher and the survivors send it.

Timing-proof: the lost host's rank 2 stops at a fixed step (``in_place_job.py``'s ``stall_at``),
its peers waiting for it, and the test powers that host off then (every process of it, its sshd
included); the steps and the data order are fixed, and the model is compared bit for bit with an
uninterrupted run of the same world. The deadlines are hang guards only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import NetnsCluster
from tests.cluster.test_in_place_multihost import HANG_GUARD_S, in_place_spec
from tests.cluster.test_multihost import assert_clean

pytestmark = pytest.mark.slow


def _result(out: Path, name: str) -> dict[str, Any]:
    (run_dir,) = (out / name).iterdir()
    result: dict[str, Any] = json.loads((run_dir / "result.json").read_text())
    return result


def _hashes(result: dict[str, Any]) -> set[str]:
    return {r["result"]["model_sha256"] for r in result["ranks"]}


def test_a_lost_host_is_recovered_in_place_on_the_spare_host(netns_cluster: NetnsCluster, tmp_path: Path) -> None:
    cluster = netns_cluster
    h1, h2, h3 = cluster.hosts[:3]
    two = cluster.cluster_yaml(tmp_path / "two.yaml", hosts=[h1, h2])
    out = cluster.out_dir(f"{tmp_path.name}-clean")
    done = cluster.launch(str(in_place_spec(tmp_path, "clean", tmp_path / "clean.stalled")), "--cluster", str(two), "--out", str(out), "--no-metrics", timeout=HANG_GUARD_S + 60)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    uninterrupted = _result(out, "clean")
    assert_clean(cluster)

    with_spare = cluster.cluster_yaml(tmp_path / "spare.yaml", hosts=[h1, h2, h3])  # resources.nodes: 2, so h3 stands by
    out = cluster.out_dir(f"{tmp_path.name}-lost")
    marker = tmp_path / "lost.stalled"
    proc = cluster.popen_launch(str(in_place_spec(tmp_path, "lost", tmp_path / "lost.stalled", stall_at=17, victim=2)), "--cluster", str(with_spare), "--out", str(out),
                                "--no-metrics", stdout=-1, stderr=-2)  # fmt: skip
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:] if proc.poll() is not None else "no stall"
            time.sleep(0.1)
        cluster.power_off(h2)  # rank 2 (stalled at step 17) and rank 3, their agent, h2's sshd and run directory
        output, _ = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cluster.power_on(h2)
    assert proc.returncode == 0, output[-6000:]
    result = _result(out, "lost")
    stage = result["stages"][0]
    assert stage["status"] == "succeeded" and stage["restarts"] == 0 and len(stage["attempts"]) == 1, stage  # no restart of the group
    (recovery,) = stage["recoveries"]
    assert recovery["path"] == "in_place" and recovery["dead_ranks"] == [2, 3], recovery
    assert recovery["resumed_step"] == 17 and recovery["steps_lost"] == 0 and recovery["state_bytes"] > 0, recovery
    assert recovery["replacements"] == ["spare host h3", "spare host h3"], recovery
    ranks = {r["rank"]: r for r in result["ranks"]}
    hosts = {rank: ranks[rank]["host"] for rank in ranks}
    assert hosts == {0: "h1", 1: "h1", 2: "h3", 3: "h3"}, hosts  # the lost host's ranks run on the spare
    assert all(ranks[r]["result"]["first_step"] == 0 and ranks[r]["result"]["gen"] == 1 for r in (0, 1))  # the survivors kept their processes
    assert all(ranks[r]["result"]["first_step"] == 17 and ranks[r]["result"]["gen"] == 1 for r in (2, 3))
    assert "start on the spare host h3" in output and "rank(s) 2, 3 lost; recovered in place" in output, output[-4000:]
    assert _hashes(result) == _hashes(uninterrupted)  # bit for bit
    assert_clean(cluster)
