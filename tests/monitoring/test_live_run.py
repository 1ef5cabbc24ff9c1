"""A real Prometheus scrapes a live torchrun run through the launcher's own endpoint: one series
per rank with the run's labels and plausible step rates, found through file discovery alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.conftest import REPO
from tests.monitoring.conftest import wait_for
from tests.monitoring.test_prometheus_scrape import repo_scrape_config
from tests.integration.faultkit import pythonpath

SPEC = """\
name: live_metrics
entrypoint: tests.monitoring.stepper_job:run
# a step every 20 ms for eight seconds, however fast the machine: several scrapes
params: {seconds: 8, step_s: 0.02}
resources: {cpu_workers: 2}
scaling: {workers: [2]}
"""


def test_prometheus_scrapes_every_rank_of_a_live_torchrun_run(tmp_path, start_prometheus):
    sd_dir = tmp_path / "prom_sd"
    sd_dir.mkdir()  # watched from Prometheus's start: a run's entry is seen at once
    prom = start_prometheus(repo_scrape_config(tmp_path, sd_dir))
    spec = tmp_path / "live.yaml"
    spec.write_text(SPEC)
    env = {**os.environ, "GPULAUNCH_PROM_SD_DIR": str(sd_dir), "PYTHONPATH": pythonpath()}
    started = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", str(spec), "--out", str(tmp_path / "runs"), "--quiet"],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        expr = 'max by (gpulaunch_job, run_id, world_size, rank, node) (gpulaunch_steps_total{gpulaunch_job="live_metrics"})'
        series = wait_for(lambda: (lambda r: r if len(r) == 2 and all(float(s["value"][1]) > 0 for s in r) else None)(prom.query(expr)),
                          timeout_s=90, what="a steps series per rank from the live run")
        assert sorted(s["metric"]["rank"] for s in series) == ["0", "1"]
        assert {s["metric"]["world_size"] for s in series} == {"2"} and all(s["metric"]["run_id"] for s in series)
    finally:
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    # the rates Prometheus saw while the ranks stepped (two scrapes of a stepping rank make one),
    # asked for after the run so that a fast run cannot end between two polls of this test
    rates = prom.query_range('rate(gpulaunch_steps_total{gpulaunch_job="live_metrics"}[3s])', started, time.time())
    assert sorted(s["metric"]["rank"] for s in rates) == ["0", "1"], rates
    for series in rates:
        peak = max(float(v) for _, v in series["values"])
        assert 0 < peak < 1e6, series
    assert "metrics: http://127.0.0.1:" in out
    assert not list(sd_dir.glob("*.json"))  # the run is over: its discovery entry is gone
