"""Issue 9 on Ray: ``launch --backend ray`` with an embedded Ray listens on loopback alone, the
rank actors' torch.distributed sockets included (rank 0's actor serves the store: no torchrun agent
there; gloo on ``lo``), not only Ray's own servers.

The run is the held job of ``tests.integration.test_loopback_only``: while every rank holds its
group, the listening sockets of every process under the ``launch`` this test started are read by
pid (the embedded Ray's processes are its descendants; the rank actors among them are known by their
``ray::RankActor`` command line). No other Ray on this machine is touched.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.test_loopback_only import assert_loopback_only, held_launch
from tests.ray.conftest import descendants, wait_no_orphans

pytestmark = pytest.mark.slow


@pytest.mark.usefixtures("no_ray_driver")
def test_an_embedded_ray_run_listens_on_loopback_only(tmp_path: Path) -> None:
    baseline = descendants(os.getpid())
    with held_launch(tmp_path, "--backend", "ray") as (_, held):
        pass
    assert_loopback_only(held)
    actors = {pid for pid, cmd in held.cmdlines.items() if cmd.startswith("ray::RankActor")}
    assert actors == {info["pid"] for info in held.ranks.values()}, held.cmdlines
    assert held.holders(held.store) == [held.ranks[0]["pid"]]  # rank 0's actor serves the store
    assert all(held.seen[pid] for pid in actors)
    assert wait_no_orphans(baseline) == [], "a process of the embedded Ray is still alive"
