"""Stragglers named while they happen: real torchrun runs of a synchronous DDP job in which one
rank does extra work before its all-reduce. The launcher must flag that rank and no other, live
(a console line, ``gpulaunch_straggler`` on its /metrics endpoint) and in result.json, naming host,
rank and device; with no extra work on any rank nothing is flagged."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from tests.conftest import REPO
from tests.integration.faultkit import pythonpath

SPEC = """\
name: straggler
entrypoint: tests.monitoring.straggler_job:run
params: {{slow_rank: {slow_rank}, extra_s: {extra_s}, duration_s: {duration_s}, sections: {sections}, idle_s: {idle_s}}}
resources: {{cpu_workers: {world}}}
monitoring: {{straggler_hold_s: 1.0}}
"""


class LiveRun:
    """``launch SPEC`` in a child process; its output read as it comes, its /metrics polled."""

    def __init__(self, tmp_path: Path, **params: object) -> None:
        spec = tmp_path / "straggler.yaml"
        spec.write_text(SPEC.format(**{"idle_s": 0.0, **params}))
        self.out_dir = tmp_path / "runs"
        self.lines: list[str] = []
        self.straggler_gauge: dict[str, float] = {}  # rank -> the last gpulaunch_straggler value seen as 1
        env = {**os.environ, "PYTHONPATH": pythonpath(), "COLUMNS": "200", "GPULAUNCH_PROM_SD_DIR": str(tmp_path / "sd")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher", str(spec), "--out", str(self.out_dir)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def metrics_url(self) -> str | None:
        found = [m.group(1) for line in self.lines if (m := re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", line))]
        return found[0] if found else None

    def wait(self, timeout_s: float = 120) -> dict:
        """Poll /metrics until the run ends; the result.json it wrote."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            url = self.metrics_url()
            if url:
                self._scrape(url)
            time.sleep(0.25)
        try:
            self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, 9)
        self._reader.join(timeout=5)
        assert self.proc.returncode == 0, "\n".join(self.lines[-40:])
        (result,) = self.out_dir.glob("straggler/*/result.json")
        return json.loads(result.read_text())

    def _scrape(self, url: str) -> None:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return  # not up yet, or already closed
        for m in re.finditer(r'^gpulaunch_straggler\{([^}]*)\} (\S+)$', text, re.M):
            rank = re.search(r'rank="(\d+)"', m.group(1)).group(1)  # type: ignore[union-attr]
            self.straggler_gauge[rank] = max(self.straggler_gauge.get(rank, 0.0), float(m.group(2)))


def stage_host(result: dict, rank: int) -> str:
    return next(r["host"] for r in result["ranks"] if r["rank"] == rank)


def test_ddp_job_names_its_slow_rank_live_and_in_result_json(tmp_path):
    run = LiveRun(tmp_path, slow_rank=1, extra_s=0.03, duration_s=5.0, sections="false", world=3)
    result = run.wait()
    (stage,) = result["stages"]
    flagged = stage["stragglers"]
    assert [s["rank"] for s in flagged] == [1], flagged
    (s,) = flagged
    assert s["device"] == "cpu" and s["host"] == stage_host(result, 1)
    # its own work per step holds the extra 30 ms; its peers' is a small fraction of it
    assert s["work_s"] > 0.02 and s["peers_median_s"] < s["work_s"] / 2 and s["ratio"] > 2, s
    assert s["flagged_after_s"] < stage["wall_s"]
    # live: one console line naming it, and the endpoint's gauge up for rank 1 only
    live = [line for line in run.lines if "straggler: rank 1 on" in line]
    assert live and "(cpu)" in live[0], run.lines
    assert not any(re.search(r"straggler: rank [02] ", line) for line in run.lines)
    assert run.straggler_gauge.get("1") == 1.0 and run.straggler_gauge.get("0") == 0.0 and run.straggler_gauge.get("2") == 0.0, run.straggler_gauge
    # the summary repeats it after the run
    assert any(line.startswith("straggler (world 3): rank 1 on") for line in run.lines), run.lines[-20:]


def test_job_that_marks_its_own_work_names_its_slow_rank(tmp_path):
    """No DDP: the job all-reduces by hand and wraps its compute in ``ctx.metrics.work()``."""
    result = LiveRun(tmp_path, slow_rank=0, extra_s=0.03, duration_s=4.0, sections="true", world=2).wait()
    (stage,) = result["stages"]
    assert [s["rank"] for s in stage["stragglers"]] == [0], stage["stragglers"]


def test_balanced_ddp_job_flags_no_one(tmp_path):
    # 30 ms asleep between steps, outside the ranks' own work: the same measurement on less CPU
    run = LiveRun(tmp_path, slow_rank=1, extra_s=0.0, duration_s=4.0, sections="false", world=2, idle_s=0.03)
    result = run.wait()
    (stage,) = result["stages"]
    assert stage["stragglers"] == []
    assert not any(re.search(r"straggler( \(world \d+\))?: rank", line) for line in run.lines), run.lines
    assert run.straggler_gauge and set(run.straggler_gauge.values()) == {0.0}, run.straggler_gauge
