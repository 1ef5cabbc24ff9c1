"""A real Prometheus scrapes a live endpoint, found through the repo's own scrape config
(configs/prometheus/prometheus.yml, its file-SD paths moved into tmp), and PromQL over the HTTP API
returns one series per rank with the right labels and plausible step times; every query of the
Grafana dashboard runs on it too."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("prometheus_client")

from launcher.monitoring.endpoint import SD_PID_LABEL, MetricsEndpoint, RankSample, StageSample
from tests.conftest import REPO
from tests.monitoring.conftest import wait_for

JOB = "monitoring_test"
STEPS_PER_S = 40.0
MEAN_STEP_S = 1 / STEPS_PER_S
DASHBOARD = REPO / "configs" / "grafana" / "dashboards" / "gpulaunch.json"


class Feeder:
    """What the run loop does: every 0.25 s, the ranks' progress as a StageSample (here made up:
    STEPS_PER_S steps a second on every rank; the last rank is a straggler)."""

    def __init__(self, endpoint: MetricsEndpoint, world_size: int) -> None:
        self.endpoint, self.world_size = endpoint, world_size
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> StageSample:
        steps = int((time.monotonic() - self.t0) * STEPS_PER_S)
        last = self.world_size - 1
        ranks = tuple(
            RankSample(rank=k, node=f"node{k % 2}", state="running", steps=steps, last_step_s=MEAN_STEP_S * (1 + 0.01 * k),
                       mean_step_s=MEAN_STEP_S + 0.001 * k, work_s=0.02 if k == last else 0.01, straggler=k == last)
            for k in range(self.world_size)
        )
        return StageSample(JOB, "run-7", "torchrun", self.world_size, restarts=0, ranks=ranks, samples_per_step=32)

    def _loop(self) -> None:
        while not self.stop.wait(0.25):
            self.endpoint.update(self.sample())

    def __enter__(self) -> "Feeder":
        self.endpoint.update(self.sample())
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


def repo_scrape_config(tmp_path: Path, sd_dir: Path) -> Path:
    """configs/prometheus/prometheus.yml as shipped, with a 1 s scrape and its file-SD paths in tmp."""
    config = yaml.safe_load((REPO / "configs" / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"gpulaunch", "ray"}
    (launcher_sd,) = jobs["gpulaunch"]["file_sd_configs"]
    assert launcher_sd["files"] == ["/tmp/gpulaunch/prom_sd/*.json"]  # where MetricsEndpoint writes by default
    launcher_sd["files"] = [str(sd_dir / "*.json")]
    (ray_sd,) = jobs["ray"]["file_sd_configs"]
    assert ray_sd["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]  # where Ray's head writes
    ray_sd["files"] = [str(tmp_path / "ray" / "prom_metrics_service_discovery.json")]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def dashboard_queries(rate_interval: str = "4s") -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target, Grafana's variables filled in as "All" does."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var in ("$gpulaunch_job", "$run_id", "$world_size"):
                expr = expr.replace(var, ".*")
            out.append((panel["title"], expr.replace("$__rate_interval", rate_interval)))
    return out


def by_rank(result: list[dict]) -> dict[str, float]:
    return {r["metric"]["rank"]: float(r["value"][1]) for r in result}


def test_prometheus_scrapes_one_series_per_rank_with_the_right_labels(tmp_path, start_prometheus):
    sd_dir = tmp_path / "prom_sd"
    endpoint = MetricsEndpoint()
    port = endpoint.start(sd_dir=sd_dir, sd_name=f"{JOB}-run-7")
    try:
        prom = start_prometheus(repo_scrape_config(tmp_path, sd_dir))
        with Feeder(endpoint, world_size=2):
            targets = wait_for(lambda: [t for t in prom.active_targets() if t["labels"].get("job") == "gpulaunch" and t["health"] == "up"],
                               30, "the endpoint as a healthy target (found through file SD)")
            assert targets[0]["scrapeUrl"] == f"http://127.0.0.1:{port}/metrics"
            # the entry names its launcher (see sweep_sd_dir); Prometheus keeps that out of the series
            assert targets[0]["discoveredLabels"][SD_PID_LABEL] == str(os.getpid()), targets[0]
            assert SD_PID_LABEL not in targets[0]["labels"]

            rate_q = f'rate(gpulaunch_steps_total{{gpulaunch_job="{JOB}"}}[5s])'
            full_window = f'count_over_time(gpulaunch_steps_total{{gpulaunch_job="{JOB}"}}[5s]) >= 5'
            wait_for(lambda: len(prom.query(full_window)) == 2, 30, "5 s of scrapes (a rate over a full window)")

            steps = prom.query(f'gpulaunch_steps_total{{gpulaunch_job="{JOB}"}}')
            assert len(steps) == 2  # one series per rank
            for r in steps:
                labels = dict(r["metric"])
                assert labels.pop("__name__") == "gpulaunch_steps_total"
                rank = labels["rank"]
                assert labels == {"gpulaunch_job": JOB, "run_id": "run-7", "world_size": "2", "rank": rank,
                                  "node": f"node{int(rank) % 2}", "job": "gpulaunch", "instance": f"127.0.0.1:{port}"}
                assert float(r["value"][1]) > 0

            folded_q = f'max by (gpulaunch_job, run_id, world_size, rank) ({rate_q})'
            rates = by_rank(prom.query(folded_q))
            print(f"\nPromQL: {folded_q}\nanswer: {prom.query(folded_q)}")
            assert set(rates) == {"0", "1"} and all(0.5 * STEPS_PER_S < v < 1.5 * STEPS_PER_S for v in rates.values()), rates
            step_time = by_rank(prom.query(f'gpulaunch_step_time_seconds{{gpulaunch_job="{JOB}"}}'))
            assert step_time == {"0": pytest.approx(MEAN_STEP_S), "1": pytest.approx(MEAN_STEP_S + 0.001)}
            gauge_rate = by_rank(prom.query(f'gpulaunch_steps_per_second{{gpulaunch_job="{JOB}"}}'))
            assert all(0.5 * STEPS_PER_S < v < 1.5 * STEPS_PER_S for v in gauge_rate.values()), gauge_rate
            # the dashboards' selector: matches the endpoint's names and Ray's (ray_ in front) alike
            both = prom.query(f'{{__name__=~"(ray_)?gpulaunch_straggler", gpulaunch_job="{JOB}"}}')
            assert by_rank(both) == {"0": 0.0, "1": 1.0}
            assert prom.query(f'gpulaunch_world_size{{gpulaunch_job="{JOB}"}}')[0]["value"][1] == "2"

            # every query of the Grafana dashboard parses and runs; the per-rank ones find both ranks
            for title, expr in dashboard_queries():
                result = prom.query(expr)
                if "gpulaunch_step_seconds_bucket" in expr:
                    assert result == [], title  # the per-step histogram comes from Ray actors only
                elif expr.startswith("max by (gpulaunch_job, run_id, world_size, rank"):  # one series per rank
                    assert {r["metric"].get("rank") for r in result} >= {"0", "1"}, (title, expr, result)
                else:
                    assert result, (title, expr)

        # a new stage (world size 3): the old stage's series go stale at the next scrape
        with Feeder(endpoint, world_size=3):
            def only_the_new_stage() -> bool:
                result = prom.query(f'gpulaunch_steps_total{{gpulaunch_job="{JOB}"}}')
                return len(result) == 3 and {r["metric"]["world_size"] for r in result} == {"3"}

            wait_for(only_the_new_stage, 30, "the world-size-3 series only")
            assert not prom.query(f'gpulaunch_step_time_seconds{{gpulaunch_job="{JOB}", world_size="2"}}')
            assert prom.query(f'gpulaunch_world_size{{gpulaunch_job="{JOB}"}}')[0]["value"][1] == "3"
    finally:
        endpoint.close()
    assert not list(sd_dir.glob("*.json"))  # the run is over: Prometheus stops looking for it
