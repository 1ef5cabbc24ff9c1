"""An elastic world over SSH (``resources.nodes: 1..2``, no spare in the cluster file): a host lost
mid-run, and the job goes on on the survivor at half the world size, resumed from its last
checkpoint (the survivor's own copy: each host's run directory is private), the result saying
which attempt ran at which size."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.cluster.conftest import NetnsCluster
from tests.cluster.test_spare_host import _result, _spec, power_off_h1_once_h2_has_step_8
from tests.jobs.conftest import TINY_TRAIN

pytestmark = pytest.mark.slow

SETS = ["entrypoint=tests.jobs.killed_train:run", "params.kill_at=-1", "params.epochs=6", "scaling=null", "resources.nodes=1..2",
        "params.step_sleep_s=0.25", *TINY_TRAIN]


def test_a_lost_host_without_a_spare_leaves_the_survivor_at_half_the_world(netns_cluster: NetnsCluster, tmp_path: Path, clean_after):
    cfg = netns_cluster.cluster_yaml(tmp_path / "cluster.yaml", hosts=netns_cluster.hosts[:2])  # h1 h2: no spare
    out = netns_cluster.out_dir(tmp_path.name)
    sets = [a for s in (*SETS, f"params.marker={tmp_path / 'unused'}") for a in ("--set", s)]
    proc = netns_cluster.popen_launch(str(_spec(tmp_path)), "--cluster", str(cfg), "--out", str(out), "--no-metrics", *sets,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = power_off_h1_once_h2_has_step_8(netns_cluster, proc, out)
    assert proc.returncode == 0, output[-4000:]
    assert "h1 lost and no spare host is left: the job goes on with 1 host(s) (elastic, at least 1)" in output
    result = _result(out)
    first, second = result["stages"][0]["attempts"]
    assert (first["world_size"], first["failure_class"], first["restarted"]) == (2, "host_lost", True), first
    assert second["world_size"] == 1 and second["status"] == "succeeded" and second["resumed_step"] >= 8, second
    assert [(r["host"], r["world_size"]) for r in result["ranks"]] == [("h2", 1)]
    trained = result["ranks"][0]["result"]
    # resumed by epochs (world size 2's step 8 is epoch 2), then trained to the end at world size 1
    assert trained["start_epoch"] >= 2 and trained["steps"] == 6 * trained["batches_per_epoch"], trained
    left = netns_cluster.wait_clean()
    assert not left, netns_cluster.describe(left)
