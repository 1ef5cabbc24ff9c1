"""Every rank seen live on the launching machine when none of them runs there.

Two SSH hosts with private run directories (neither is the launching host), a world-4 DDP job
(two ranks a host) in which rank 3, on the second host, does 40 ms of extra work every step. While
it runs: the launcher's ``/metrics`` has every rank with its host's ``node`` label, and the second
host's step counters grow between two scrapes; the console's live line (on a terminal: ``script``
gives the launcher one) counts all four ranks; the straggler is named, with its host, while the
run is live and again in result.json. Nothing of this is read from a host's disk: it all comes
over each host's one SSH connection, in the agent's output (the stage's live channel).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import REPO, NetnsCluster

pytestmark = pytest.mark.slow

SPEC = """\
name: live2
entrypoint: tests.monitoring.straggler_job:run
params: {{slow_rank: 3, extra_s: 0.04, duration_s: {duration_s}, sections: false, idle_s: 0.0}}
resources: {{nodes: 2, cpu_workers: 2}}
monitoring: {{straggler_hold_s: 1.0}}
env: {{PYTHONPATH: {repo}}}
"""
SCRAPE = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class TerminalRun:
    """``launch`` in the launching host's namespace on a pseudo-terminal (``script``), as a user
    at a terminal runs it: rich draws the live line there. Its output is read as it comes."""

    def __init__(self, cluster: NetnsCluster, *args: str) -> None:
        self.cluster = cluster
        command = shlex.join([sys.executable, "-m", "launcher", *args])
        self.proc = subprocess.Popen(
            cluster.ns_cmd("script", "-qfec", command, "/dev/null"),
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "TERM": "xterm", "COLUMNS": "200", "LINES": "50", "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        self.text = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for chunk in iter(lambda: self.proc.stdout.read1(4096), b""):  # type: ignore[union-attr]
            self.text += ANSI.sub("", chunk.decode(errors="replace").replace("\r", "\n"))

    def metrics_url(self) -> str | None:
        found = re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", self.text)
        return found.group(1) if found else None

    def scrape(self) -> dict[tuple[str, str], dict[str, float]]:
        """metric name -> {(rank, node): value} of the live endpoint, read from the launching host."""
        url = self.metrics_url()
        assert url, self.text[-2000:]
        done = subprocess.run(self.cluster.ns_cmd(sys.executable, "-c", SCRAPE, url), capture_output=True, text=True, timeout=30)
        out: dict = {}
        for m in re.finditer(r'^(gpulaunch_\w+)\{([^}]*)\} (\S+)$', done.stdout, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            if "rank" in labels:
                out.setdefault(m.group(1), {})[(labels["rank"], labels.get("node", ""))] = float(m.group(3))
        return out

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout_s)
        self._reader.join(5)
        return code


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
    assert stage["stragglers"][0]["work_s"] > 0.03
    print(f"live from two remote hosts: steps grew by {grown} in 2 s; flagged {stage['stragglers'][0]['flagged_after_s']:.1f} s in")  # noqa: T201
