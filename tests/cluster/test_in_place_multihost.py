"""Recovery in place across hosts: a rank SIGKILLed on one namespace host is replaced by that
host's keeper while the survivors, on both hosts, keep their processes; the keepers and the
ranks agree through the stage's store (each host's run directory is its own tmpfs: no host reads
another's files), and the state comes from a survivor on the other host.

Timing-proof as ``tests/integration/test_in_place.py``: the victim kills itself at a fixed step
(``in_place_job.py``), the steps and the data order are fixed, and the model is compared bit for
bit with an uninterrupted run of the same world on the same hosts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import REPO, NetnsCluster
from tests.cluster.test_multihost import assert_clean

pytestmark = pytest.mark.slow

HANG_GUARD_S = 400


def in_place_spec(tmp: Path, name: str, marker: Path, **params: Any) -> Path:
    """``in_place_job.py`` on 2 hosts x 2 ranks, one restart allowed: its spec file, ``marker``
    outside the hosts' private run roots (the fault's own record)."""
    spec = {
        "name": name,
        "entrypoint": "tests.integration.in_place_job:run",
        "params": {"steps": 30, "checkpoint_every": 10, "marker": str(marker), **params},
        "resources": {"nodes": 2, "cpu_workers": 2},
        "env": {"PYTHONPATH": str(REPO)},
        "max_restarts": 1,
        "timeouts": {"rendezvous_s": 120, "run_s": HANG_GUARD_S},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(spec))
    return path


def _run(cluster: NetnsCluster, tmp: Path, name: str, **params: Any) -> dict[str, Any]:
    spec = in_place_spec(tmp, name, tmp / f"{name}.killed", **params)
    cfg = cluster.cluster_yaml(tmp / "cluster.yaml", hosts=cluster.hosts[:2])
    out = cluster.out_dir(f"{tmp.name}-{name}")
    done = cluster.launch(str(spec), "--cluster", str(cfg), "--out", str(out), "--no-metrics", timeout=HANG_GUARD_S + 60)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (run_dir,) = (out / name).iterdir()
    result: dict[str, Any] = json.loads((run_dir / "result.json").read_text())
    result["_output"] = done.stdout + done.stderr
    assert_clean(cluster)
    return result


def _hashes(result: dict[str, Any]) -> set[str]:
    return {r["result"]["model_sha256"] for r in result["ranks"]}


@pytest.fixture(scope="module")
def uninterrupted(netns_cluster: NetnsCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    result = _run(netns_cluster, tmp_path_factory.mktemp("clean"), "clean")
    assert len(_hashes(result)) == 1 and result["stages"][0]["attempts"][0]["steps"] == 30
    return result


def test_a_rank_killed_on_one_host_is_replaced_in_place_from_a_survivor_on_the_other(
    netns_cluster: NetnsCluster, tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    result = _run(netns_cluster, tmp_path, "killed", kill_at=17, victim=3)  # rank 3: the second host's second rank

    killed = int((tmp_path / "killed.killed").read_text())  # the fault happened (the marker is outside the private run roots)
    stage = result["stages"][0]
    assert stage["status"] == "succeeded" and stage["restarts"] == 0 and len(stage["attempts"]) == 1, stage  # no restart of the group
    (recovery,) = stage["recoveries"]
    assert recovery["path"] == "in_place" and recovery["dead_ranks"] == [3], recovery
    assert recovery["resumed_step"] == 17 and recovery["steps_lost"] == 0 and recovery["state_bytes"] > 0, recovery
    ranks = {r["rank"]: r for r in result["ranks"]}
    hosts = {rank: ranks[rank]["host"] for rank in ranks}
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts  # the state (from rank 0) crossed hosts
    assert ranks[3]["result"]["first_step"] == 17 and ranks[3]["result"]["gen"] == 1 and ranks[3]["result"]["pid"] != killed
    assert all(ranks[r]["result"]["first_step"] == 0 and ranks[r]["result"]["gen"] == 1 for r in (0, 1, 2))  # the survivors kept their processes
    assert "rank(s) 3 lost; recovered in place" in result["_output"], result["_output"][-3000:]
    assert _hashes(result) == _hashes(uninterrupted)  # bit for bit


def test_a_rank_lost_during_a_save_is_recovered_in_place_and_that_checkpoint_given_up(
    netns_cluster: NetnsCluster, tmp_path: Path, uninterrupted: dict[str, Any]
) -> None:
    """Over hosts without a shared filesystem a save broadcasts the checkpoint to each host's
    writer, outside the job's ``live.run``. Rank 0 dies as its save of step 20 begins: rank 2
    (host 2's writer) is waiting for the broadcast then; it recovers there and gives that
    checkpoint up, the others recover in their next step, and the replacement of rank 0 (the
    state from rank 1) goes on at step 20 with them."""
    result = _run(netns_cluster, tmp_path, "insave", kill_in_save_at=20, victim=0)

    killed = int((tmp_path / "insave.killed").read_text())
    stage = result["stages"][0]
    assert stage["status"] == "succeeded" and stage["restarts"] == 0 and len(stage["attempts"]) == 1, stage
    (recovery,) = stage["recoveries"]
    assert recovery["path"] == "in_place" and recovery["dead_ranks"] == [0], recovery
    assert recovery["resumed_step"] == 20 and recovery["steps_lost"] == 0, recovery
    assert "h2:2 gpulaunch: the checkpoint of step 20 was cut short by a lost rank, recovered in place" in result["_output"], result["_output"][-3000:]
    ranks = {r["rank"]: r for r in result["ranks"]}
    assert ranks[0]["result"]["first_step"] == 20 and ranks[0]["result"]["pid"] != killed
    assert _hashes(result) == _hashes(uninterrupted)  # bit for bit
