"""Every rank seen live on the launching machine when none of them runs there.

Two SSH hosts with private run directories (neither is the launching host), a world-4 DDP job
(two ranks a host) in which every rank does 20 ms of its own work a step (a few ms of noise on a
loaded machine is then no straggler) and rank 3, on the second host, 40 ms more. While
it runs: the launcher's ``/metrics`` has every rank with its host's ``node`` label, and the second
host's step counters grow between two scrapes; the console's live line (on a terminal: ``script``
gives the launcher one) counts all four ranks; the straggler is named, with its host, while the
run is live and again in result.json. Nothing of this is read from a host's disk: it all comes
over each host's one SSH connection, in the agent's output (the stage's live channel).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import REPO, NetnsCluster
from tests.cluster.terminal import TerminalRun

pytestmark = pytest.mark.slow

SPEC = """\
name: live2
entrypoint: tests.monitoring.straggler_job:run
params: {{slow_rank: 3, extra_s: 0.04, base_s: 0.02, duration_s: {duration_s}, sections: false, idle_s: 0.0}}
resources: {{nodes: 2, cpu_workers: 2}}
monitoring: {{straggler_hold_s: 1.0}}
env: {{PYTHONPATH: {repo}}}
"""
def _steps_of_every_rank(run: TerminalRun, deadline: float) -> dict[tuple[str, str], float]:
    while time.monotonic() < deadline and run.proc.poll() is None:
        if run.metrics_url():
            steps = run.scrape().get("gpulaunch_steps_total", {})
            if len(steps) == 4 and all(v > 0 for v in steps.values()):
                return steps
        time.sleep(0.5)
    raise AssertionError(f"no live step counts for four ranks: {run.text[-3000:]}")


def test_every_rank_on_two_remote_hosts_is_live_on_the_launching_machine(netns_cluster: NetnsCluster, tmp_path: Path) -> None:
    cluster = netns_cluster
    spec = tmp_path / "live2.yaml"
    spec.write_text(SPEC.format(duration_s=14, repo=REPO))
    cfg = cluster.cluster_yaml(tmp_path / "cluster.yaml", hosts=cluster.hosts[:2])
    out = cluster.out_dir("live2")
    run = TerminalRun(cluster, str(spec), "--cluster", str(cfg), "--out", str(out))
    try:
        first = _steps_of_every_rank(run, time.monotonic() + 90)
        time.sleep(2.0)
        second = run.scrape()
        second_text = run.last_scrape
        flagged_live = run.scrape().get("gpulaunch_straggler", {})
        for _ in range(20):  # the flag needs straggler_hold_s of steady figures after the warm-up
            if flagged_live.get(("3", "h2")) == 1.0 or run.proc.poll() is not None:
                break
            time.sleep(0.5)
            flagged_live = run.scrape().get("gpulaunch_straggler", {})
        live_text = run.text
        code = run.wait(120)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    assert code == 0, run.text[-3000:]
    # /metrics while it ran: all four ranks, labelled with their hosts, neither of them this one
    assert sorted(first) == [("0", "h1"), ("1", "h1"), ("2", "h2"), ("3", "h2")], first
    grown = {key: second["gpulaunch_steps_total"][key] - first[key] for key in first}
    assert grown[("2", "h2")] > 0 and grown[("3", "h2")] > 0 and grown[("0", "h1")] > 0, grown
    # the console's live line counted all four ranks running
    assert re.search(r"world 4 · 4 running · steps \d+", live_text), live_text[-3000:]
    # the straggler, named with its host while the run was live: on the console and on /metrics
    assert flagged_live.get(("3", "h2")) == 1.0 and not any(v for k, v in flagged_live.items() if k[0] != "3"), flagged_live
    assert re.search(r"straggler: rank 3 on h2 \(cpu\): own work [\d.]+ ms per step", live_text), live_text[-3000:]
    # and in result.json: that rank, and no other
    (result_file,) = out.glob("live2/*/result.json")
    result = json.loads(result_file.read_text())
    (stage,) = result["stages"]
    assert [(s["rank"], s["host"]) for s in stage["stragglers"]] == [(3, "h2")], stage["stragglers"]
    # the others' own work is base_s and more (the margin that keeps a preempted rank from looking slow)
    assert stage["stragglers"][0]["peers_median_s"] >= 0.02, stage["stragglers"]
    flag = stage["stragglers"][0]
    assert flag["work_s"] > 0.03
    # flagged within straggler_hold_s + 5 s of the ranks' first step (its figure needs 20 steps first)
    stepping_for = flag["flagged_after_s"] - stage["phases"]["to_first_step"]
    assert 0 < stepping_for < 1.0 + 5.0, (flag, stage["phases"])
    excerpt = "\n".join(line for line in second_text.splitlines() if line.startswith(("gpulaunch_steps_total{", "gpulaunch_rank_state{")))
    print(f"live from two remote hosts: steps grew by {grown} in 2 s; rank 3 flagged {stepping_for:.1f} s after the first step\n"  # noqa: T201
          f"{excerpt}\nstraggler gauge while live: {flagged_live}")
