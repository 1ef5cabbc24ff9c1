"""Ray's metrics and the launcher's endpoint share names and labels: Ray actors export the names of
launcher.metric_names through ``ray.util.metrics`` (Ray puts ``ray_`` in front), a real
Prometheus scrapes them with the config Ray generates (its service-discovery file, ``job="ray"``),
and the rate of Ray's counter (the dashboard's fallback, docs/monitoring.md) and the dashboard's
folded queries find one series per rank, the launcher's endpoint scraped beside them or not.

Slow (an embedded Ray starts in a child process, its own temp dir and token, never ~/.ray)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")
pytest.importorskip("prometheus_client")

from launcher.monitoring.endpoint import MetricsEndpoint, RankSample, StageSample
from tests.monitoring.conftest import wait_for
from tests.ports import unshared_port
from tests.integration.faultkit import pythonpath

pytestmark = pytest.mark.slow

JOB = "ray_names_test"
RUN_ID = "run-ray"
STEP_S = 0.025

DRIVER = r'''
import os, socket, sys, time
import ray
from launcher import metric_names as me

temp_dir, stop_file, job, run_id, step_s, dash_port = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]), int(sys.argv[6])
ray.init(num_cpus=2, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=dash_port,
         _temp_dir=temp_dir, log_to_driver=False)

@ray.remote(num_cpus=0)
class Rank:
    """What the Ray backend's actor does: the shared names, labels and buckets, host numbers only."""
    def __init__(self, world_size, rank):
        from ray.util.metrics import Counter, Gauge, Histogram
        self.tags = me.rank_tags(job, run_id, world_size, rank, socket.gethostname())
        keys = me.RANK_LABELS
        self.steps = Counter(me.STEPS.name, description=me.STEPS.help, tag_keys=keys)
        self.step_time = Gauge(me.STEP_TIME.name, description=me.STEP_TIME.help, tag_keys=keys)
        self.straggler = Gauge(me.STRAGGLER.name, description=me.STRAGGLER.help, tag_keys=keys)
        self.hist = Histogram(me.STEP_SECONDS.name, description=me.STEP_SECONDS.help,
                              boundaries=list(me.STEP_SECONDS_BUCKETS), tag_keys=keys)
        self.rank = rank

    def run(self, seconds):
        # the steps the clock says were done (one per step_s), not one batch per loop: a loaded
        # machine's late wake-ups do not lower the rate
        start = time.monotonic()
        end, done = start + seconds, 0
        while time.monotonic() < end:
            time.sleep(0.1)
            n = int((time.monotonic() - start) / step_s) - done
            done += n
            if n > 0:
                self.steps.inc(n, tags=self.tags)
            for _ in range(n):
                self.hist.observe(step_s, tags=self.tags)
            self.step_time.set(step_s, tags=self.tags)
            self.straggler.set(1.0 if self.rank == 1 else 0.0, tags=self.tags)
        return True

ranks = [Rank.remote(2, k) for k in range(2)]
refs = [r.run.remote(240) for r in ranks]
print("READY", ray.get_runtime_context().get_node_id(), flush=True)
deadline = time.monotonic() + 240
while not os.path.exists(stop_file) and time.monotonic() < deadline:
    time.sleep(0.2)
ray.shutdown()
print("DONE", flush=True)
'''


def test_ray_and_the_endpoint_share_names_and_labels_under_rays_generated_config(tmp_path, start_prometheus):
    temp_dir = Path(tempfile.mkdtemp(prefix="glmon-", dir="/tmp"))  # short: Ray's unix socket paths
    stop_file = tmp_path / "stop"
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {
        **os.environ, "PYTHONPATH": pythonpath(), "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),  # a token of its own: no ~/.ray/auth_token
        "RAY_metrics_report_interval_ms": "1000",  # workers report to the node's agent every second
    }
    log = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(temp_dir), str(stop_file), JOB, RUN_ID, str(STEP_S), str(unshared_port())],
                              env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    endpoint = MetricsEndpoint()
    try:
        wait_for(lambda: driver.poll() is not None or "READY" in (tmp_path / "driver.log").read_text(), 120, "the embedded Ray")
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]

        # Ray's own generated Prometheus config (file SD on its nodes, job "ray"), scraping every
        # second instead of every 10 s, plus a job for the launcher's endpoint of the same run
        generated = temp_dir / "session_latest" / "metrics" / "prometheus" / "prometheus.yml"
        wait_for(generated.exists, 60, "Ray's generated prometheus.yml")
        config = yaml.safe_load(generated.read_text())
        (ray_job,) = config["scrape_configs"]
        assert ray_job["job_name"] == "ray" and ray_job["file_sd_configs"][0]["files"][0].endswith("prom_metrics_service_discovery.json")
        config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
        endpoint.start()
        config["scrape_configs"].append({"job_name": "gpulaunch", "static_configs": [{"targets": [endpoint.target]}]})
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        endpoint.update(StageSample(JOB, RUN_ID, "ray", 2, 0, tuple(
            RankSample(k, "launcher-side-name", "running", 100, STEP_S, STEP_S, 0.01, k == 1) for k in range(2)), samples_per_step=None))
        prom = start_prometheus(tmp_path / "prometheus.yml")

        # the rate of Ray's counter per rank, the step rate docs/monitoring.md falls back to for Ray (a 1 m window: Ray's config scrapes every 10 s)
        ray_rate_query = f'sum by (gpulaunch_job, run_id, world_size, rank) (rate(ray_gpulaunch_steps_total{{gpulaunch_job="{JOB}"}}[1m]))'
        wait_for(lambda: len(prom.query(ray_rate_query)) == 2 and all(float(r["value"][1]) > 0 for r in prom.query(ray_rate_query)),
                 90, "both ranks' Ray step counters, scraped twice")
        full = f'count_over_time(ray_gpulaunch_steps_total{{gpulaunch_job="{JOB}"}}[5s]) >= 5'
        wait_for(lambda: len(prom.query(full)) == 2, 60, "5 s of scrapes")
        rates = {r["metric"]["rank"]: float(r["value"][1]) for r in prom.query(ray_rate_query.replace("[1m]", "[5s]"))}
        assert set(rates) == {"0", "1"} and all(0.2 / STEP_S < v < 1.5 / STEP_S for v in rates.values()), rates

        raw = prom.query(f'ray_gpulaunch_steps_total{{gpulaunch_job="{JOB}"}}')
        for r in raw:
            labels = r["metric"]
            assert labels["job"] == "ray"  # Prometheus's (from Ray's SD file): no clash with gpulaunch_job
            assert {k: labels[k] for k in ("gpulaunch_job", "run_id", "world_size")} == {"gpulaunch_job": JOB, "run_id": RUN_ID, "world_size": "2"}
            assert labels["rank"] in {"0", "1"} and labels["node"]

        # the dashboard's selectors match both sources; its folds give one series per rank
        both = prom.query(f'{{__name__=~"(ray_)?gpulaunch_steps_total", gpulaunch_job="{JOB}"}}')
        assert {r["metric"]["__name__"] for r in both} == {"gpulaunch_steps_total", "ray_gpulaunch_steps_total"}
        folded = prom.query(f'max by (gpulaunch_job, run_id, world_size, rank) ({{__name__=~"(ray_)?gpulaunch_step_time_seconds", gpulaunch_job="{JOB}"}})')
        assert {r["metric"]["rank"]: float(r["value"][1]) for r in folded} == {"0": pytest.approx(STEP_S), "1": pytest.approx(STEP_S)}
        stragglers = prom.query(f'max by (gpulaunch_job, run_id, world_size, rank) ({{__name__=~"(ray_)?gpulaunch_straggler", gpulaunch_job="{JOB}"}})')
        assert {r["metric"]["rank"]: float(r["value"][1]) for r in stragglers} == {"0": 0.0, "1": 1.0}
        p50 = prom.query(f'histogram_quantile(0.5, sum by (gpulaunch_job, run_id, world_size, rank, le) '
                         f'(rate({{__name__=~"(ray_)?gpulaunch_step_seconds_bucket", gpulaunch_job="{JOB}"}}[30s])))')
        assert len(p50) == 2 and all(0.02 <= float(r["value"][1]) <= 0.05 for r in p50), p50  # the 20-50 ms bucket
        print(f"\nPromQL: {ray_rate_query}\nanswer: {prom.query(ray_rate_query)}\n5 s window: {rates}")
    finally:
        endpoint.close()
        stop_file.touch()
        try:
            driver.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(driver.pid, signal.SIGKILL)  # the driver's own session: Ray's processes it started
            driver.wait(10)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
