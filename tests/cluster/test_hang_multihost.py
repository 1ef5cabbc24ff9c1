"""A hang on another host, named from the launching machine.

Two SSH hosts with private run directories (neither is the launching host), a world-4 job (two
ranks a host); rank 3, on the second host, hangs at step 20 in each of the four ways of ``hang_job.py``
(sleeps forever, skips a collective, is frozen with SIGSTOP, deadlocks on a lock). The stall is seen in the live stream, every rank's evidence is gathered on its
own host by the host helper (py-spy, the ranks' flight recorders) over the run's one connection
per host, and the diagnosis names rank 3 on h2 with its line of the job; nothing is left running.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.cluster.conftest import REPO, NetnsCluster
from tests.integration.test_hangs import CASES, line_of

pytestmark = pytest.mark.slow
HANG_S = 6


@pytest.mark.parametrize("hang", sorted(CASES))
def test_a_hang_on_a_remote_host_names_the_rank_its_host_and_line(netns_cluster: NetnsCluster, clean_after, tmp_path: Path, hang: str) -> None:
    cluster = netns_cluster
    spec = tmp_path / f"hang2-{hang}.yaml"
    spec.write_text(yaml.safe_dump({
        "name": f"hang2-{hang}", "entrypoint": "tests.integration.hang_job:run",
        "params": {"hang": hang, "rank": 3, "at": 20},
        "resources": {"nodes": 2, "cpu_workers": 2},
        "timeouts": {"hang_s": HANG_S, "run_s": 300},
        "env": {"PYTHONPATH": str(REPO)},
    }))  # fmt: skip
    cfg = cluster.cluster_yaml(tmp_path / "cluster.yaml", hosts=cluster.hosts[:2])
    out = cluster.out_dir(f"hang2-{hang}")
    done = cluster.launch(str(spec), "--cluster", str(cfg), "--out", str(out), "--no-metrics", timeout=240)
    print(done.stdout[-1500:])  # the console's diagnosis, as a user sees it
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    (result_file,) = out.glob(f"hang2-{hang}/*/result.json")
    result = json.loads(result_file.read_text())
    assert result["status"] == "hung"
    info = result["failure"]["hang"]
    why, marker = CASES[hang]
    (culprit,) = info["culprits"]
    assert (culprit["rank"], culprit["host"], culprit["line"]) == (3, "h2", line_of(marker)) and why in culprit["why"], info
    assert f"HUNG: rank 3 on h2 (cpu) {why}" in " ".join(done.stdout.split()), done.stdout[-3000:]
    # every rank's evidence came back to the launching machine, from both hosts
    evidence = [json.loads((Path(info["evidence_dir"]) / f"evidence_rank{r}.json").read_text()) for r in range(4)]
    assert [(e["rank"], e["host"]) for e in evidence] == [(0, "h1"), (1, "h1"), (2, "h2"), (3, "h2")]
    assert all(e["threads"] for e in evidence), [e["note"] for e in evidence]
    assert {g["collective"] for g in info["groups"] if 3 not in g["ranks"]} == {info["groups"][-1]["collective"]}
    assert cluster.wait_clean() == {}, cluster.describe(cluster.leftovers())
