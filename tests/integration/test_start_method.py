"""Issue 7: entrypoint ranks are forked from one forkserver per node that has imported torch
(``start_method: forkserver``, the default), or start as fresh interpreters (``spawn``, plain
torchrun's way). Both give the same job the same result; only the process tree differs."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import launch, pids_mentioning
from tests.integration.faultkit import pythonpath


def _lineage_spec(tmp_path, start_method: str):
    spec = {
        "name": f"lineage-{start_method}",
        "entrypoint": "tests.integration.lineage:run",
        "resources": {"cpu_workers": 2},
        "start_method": start_method,
        "env": {"PYTHONPATH": pythonpath()},
        "timeouts": {"run_s": 120},
    }
    path = tmp_path / f"{start_method}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ranks_start_the_way_the_spec_says_and_compute_the_same(tmp_path, start_method):
    done = launch(str(_lineage_spec(tmp_path, start_method)), "--out", str(tmp_path / "runs"), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    assert [r["status"] for r in ranks] == ["ok", "ok"]
    lineage = [r["result"] for r in ranks]
    assert [x["sum"] for x in lineage] == [3.0, 3.0]  # the all-reduce of 1 + 2 on both ranks
    stage_dir = result["run_dir"] + "/world2"
    assert {x["stage_dir_env"] for x in lineage} == {stage_dir}
    parents = {x["parent_pid"] for x in lineage}
    if start_method == "forkserver":
        # both ranks are children of the same server, a fork of the agent that had imported torch
        # and the runtime: named for what it does, the agent's command line, the agent its parent
        assert len(parents) == 1
        assert lineage[0]["parent_name"] == "gpulaunch-ranks"
        assert "launcher.runtime.agent" in lineage[0]["parent_cmdline"]
        assert lineage[0]["grandparent_cmdline"] == lineage[0]["parent_cmdline"]
    else:
        assert len(parents) == 1 and "launcher.runtime.agent" in lineage[0]["parent_cmdline"]
        assert "--start-method=spawn" in lineage[0]["parent_cmdline"]
    for rank in ranks:
        assert rank["phases"]["spawned"] <= rank["phases"]["started"] <= rank["phases"]["imported"]
        assert rank["phases"]["imported"] <= rank["phases"]["first_step"] <= rank["phases"]["finished"]
    assert pids_mentioning(result["run_dir"]) == []
