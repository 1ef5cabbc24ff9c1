"""A real Prometheus scrapes a live ``--backend ray`` run (embedded Ray) started as a user starts
it, with the repo's scrape config: the launcher's own endpoint (file SD in GPULAUNCH_PROM_SD_DIR)
and the embedded Ray's nodes (Ray's service-discovery file under its temp dir). Both give one
series per rank with the run's labels and plausible step rates, and the dashboards' fold of the
two sources (``max by (gpulaunch_job, run_id, world_size, rank)``) gives exactly one per rank.

Every process the run starts carries a marker in its environment (Ray's processes inherit the
launcher's), so that none can outlive the test unnoticed: checked after the run, killed by pid
on failure. Slow (an embedded Ray starts and stops)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

pytest.importorskip("ray")
pytest.importorskip("prometheus_client")

from tests.conftest import REPO
from tests.monitoring.conftest import wait_for
from tests.monitoring.test_prometheus_scrape import repo_scrape_config
from tests.integration.faultkit import pythonpath

pytestmark = pytest.mark.slow

JOB = "live_ray_metrics"
SPEC = f"""\
name: {JOB}
entrypoint: tests.monitoring.stepper_job:run
# a step every 20 ms for eight seconds, however fast the machine: several scrapes
params: {{seconds: 8, step_s: 0.02}}
resources: {{cpu_workers: 2}}
scaling: {{workers: [2]}}
"""
MARK = "GPULAUNCH_TEST_LIVE_RAY"  # in the environment of every process the run starts
FOLD = "gpulaunch_job, run_id, world_size, rank"


def marked_pids(mark: str) -> list[int]:
    """Live processes whose environment carries ``MARK=mark``: the launcher and all of Ray's."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(MARK) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
    return found


def kill_marked(mark: str) -> None:
    for _ in range(3):
        pids = marked_pids(mark)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=5)


def scrape_config(ray_tmp: Path, sd_dir: Path) -> Path:
    """The repo's config (1 s scrapes, file-SD paths moved: Ray's file is RAY_TMPDIR/ray/...), with
    Ray's file re-read every second instead of every 5: it is Ray's symlink into the session dir,
    and Ray replaces the file behind it, which Prometheus's directory watch does not see, so the
    node's metrics port (added a few seconds after Ray starts) would otherwise come up to 5 s late."""
    path = repo_scrape_config(ray_tmp, sd_dir)
    config = yaml.safe_load(path.read_text())
    (ray_job,) = [job for job in config["scrape_configs"] if job["job_name"] == "ray"]
    ray_job["file_sd_configs"][0]["refresh_interval"] = "1s"
    path.write_text(yaml.safe_dump(config))
    return path


def series_by_rank(result: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for s in result:
        out.setdefault(s["metric"].get("rank", "?"), []).append(s)
    return out


def peak(series: dict) -> float:
    return max(float(v) for _, v in series["values"])


def test_prometheus_scrapes_every_rank_of_a_live_ray_run(tmp_path, start_prometheus):
    sd_dir = tmp_path / "prom_sd"
    sd_dir.mkdir()  # watched from Prometheus's start: the run's entry is seen at once
    ray_tmp = Path(tempfile.mkdtemp(prefix="glprom-", dir="/tmp"))  # short: Ray's unix socket paths
    (ray_tmp / "ray").mkdir()  # Ray's temp dir (RAY_TMPDIR/ray), watched from the start too
    mark = secrets.token_hex(8)
    spec = tmp_path / "live_ray.yaml"
    spec.write_text(SPEC)
    env = {
        **os.environ, "PYTHONPATH": pythonpath(), MARK: mark,
        "GPULAUNCH_PROM_SD_DIR": str(sd_dir),
        "RAY_TMPDIR": str(ray_tmp),  # the embedded Ray's files, its service-discovery file included
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),  # a token of its own, never ~/.ray's
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # 127.0.0.1 only (the launcher sets it too)
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_metrics_report_interval_ms": "1000",  # the actors report to the node's agent every second
    }
    log = tmp_path / "launch.log"
    started = time.time()
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "launcher", str(spec), "--backend", "ray", "--out", str(tmp_path / "runs"), "--quiet"],
                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        try:
            # Prometheus starts while the launcher brings Ray up: the launcher's endpoint and Ray's
            # nodes are both found through files, the shipped config's two jobs
            prom = start_prometheus(scrape_config(ray_tmp, sd_dir))
            proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        text = log.read_text()
        assert proc.returncode == 0, text[-3000:]
        ended = time.time()
        assert "Ray dashboard: http://127.0.0.1:" in text and "metrics: http://127.0.0.1:" in text, text[-3000:]

        # --- the launcher's endpoint: one series per rank with the run's labels --------------------
        # asked of the gpulaunch job: once in CI, Ray's service-discovery file named a port the
        # launcher's endpoint then held (Ray lists its agents' ports before they bind), and the
        # "ray" job scraped the endpoint too (the same series under job="ray")
        steps = prom.query_range(f'gpulaunch_steps_total{{gpulaunch_job="{JOB}", job="gpulaunch"}}', started, ended)
        by_rank = series_by_rank(steps)
        assert sorted(by_rank) == ["0", "1"] and all(len(v) == 1 for v in by_rank.values()), steps
        labels = {rank: s[0]["metric"] for rank, s in by_rank.items()}
        run_id = labels["0"]["run_id"]
        for lab in labels.values():
            assert lab["job"] == "gpulaunch" and lab["world_size"] == "2" and lab["run_id"] == run_id and lab["node"], lab
        (result_file,) = (tmp_path / "runs").rglob("result.json")
        result = json.loads(result_file.read_text())
        assert result["backend"] == "ray" and result["run_id"] == run_id, result_file
        final = {str(r["rank"]): r["metrics"]["steps"] for r in result["ranks"] if r["world_size"] == 2}
        # what Prometheus saw counts the ranks' steps: never more than they made in all
        assert all(0 < peak(by_rank[rank][0]) <= final[rank] for rank in final), (final, steps)
        # the rates Prometheus saw while the ranks stepped (two scrapes of a stepping rank make
        # one), asked for after the run so that a fast run cannot end between two polls
        rates = prom.query_range(f'rate(gpulaunch_steps_total{{gpulaunch_job="{JOB}", job="gpulaunch"}}[3s])', started, ended)
        launcher_peak = {s["metric"]["rank"]: peak(s) for s in rates}
        assert sorted(launcher_peak) == ["0", "1"] and all(0 < v < 1e6 for v in launcher_peak.values()), rates

        # --- the embedded Ray's metrics agent, found through Ray's service-discovery file ----------
        # asked of the run's span, not of Prometheus's targets now: the run is over, the launcher has
        # taken Ray's discovery link away, and a refresh since may already have dropped the targets
        ray_targets = prom.query_range('up{job="ray"}', started, ended)
        assert any(peak(s) == 1 for s in ray_targets), f"no target up from {ray_tmp / 'ray' / 'prom_metrics_service_discovery.json'}: {ray_targets}"
        ray_steps = prom.query_range(f'ray_gpulaunch_steps_total{{gpulaunch_job="{JOB}"}}', started, ended)
        assert sorted(series_by_rank(ray_steps)) == ["0", "1"], (ray_steps, ray_targets)
        for s in ray_steps:  # the same labels as the launcher's endpoint gives the same rank
            lab = s["metric"]
            assert {k: lab[k] for k in ("gpulaunch_job", "run_id", "world_size", "node")} == {
                k: labels[lab["rank"]][k] for k in ("gpulaunch_job", "run_id", "world_size", "node")}, (lab, labels)
        assert all(0 < peak(s) <= final[s["metric"]["rank"]] for s in ray_steps), (final, ray_steps)
        ray_rates = prom.query_range(f'sum by ({FOLD}) (rate(ray_gpulaunch_steps_total{{gpulaunch_job="{JOB}"}}[3s]))', started, ended)
        ray_peak = {s["metric"]["rank"]: peak(s) for s in ray_rates}
        assert sorted(ray_peak) == ["0", "1"] and all(0 < v < 1e6 for v in ray_peak.values()), ray_rates
        # the same steps counted twice (beacons read every 0.5 s, actors' reports every second)
        assert all(0.2 < ray_peak[k] / launcher_peak[k] < 5 for k in ray_peak), (ray_peak, launcher_peak)

        # --- the dashboards' fold of both sources: exactly one series per rank, all run long ------
        both = f'{{__name__=~"(ray_)?gpulaunch_steps_total", gpulaunch_job="{JOB}"}}'
        names = prom.query_range(f"count by (__name__) ({both})", started, ended)
        assert {s["metric"]["__name__"] for s in names} == {"gpulaunch_steps_total", "ray_gpulaunch_steps_total"}
        folded = prom.query_range(f"max by ({FOLD}) ({both})", started, ended)
        assert sorted(s["metric"]["rank"] for s in folded) == ["0", "1"], folded
        assert all(s["metric"]["world_size"] == "2" and s["metric"]["run_id"] == run_id for s in folded)
        readme = f"max by ({FOLD}) (rate({both}[3s]))"
        folded_rates = prom.query_range(readme, started, ended)
        assert sorted(s["metric"]["rank"] for s in folded_rates) == ["0", "1"], folded_rates
        print(f"\nsteps in result.json {final}; scrapes: endpoint {[len(s['values']) for s in steps]}, Ray {[len(s['values']) for s in ray_steps]}"
              f"\nlauncher endpoint peak steps/s {launcher_peak}\nRay actors peak steps/s {ray_peak}\n"
              f"{readme}: peak {({s['metric']['rank']: peak(s) for s in folded_rates})}\n"
              f"labels {labels}\nwall {ended - started:.1f}s")

        # --- the run is over: its discovery entries and every process of it are gone -------------
        assert not list(sd_dir.glob("*.json"))
        # Ray's discovery link went with the embedded Ray: Prometheus drops its targets rather than
        # keep scraping a dead cluster's ports (targets down) until the next Ray takes the link
        assert not (ray_tmp / "ray" / "prom_metrics_service_discovery.json").exists()
        gone = wait_for(lambda: not [t for t in prom.active_targets() if t["labels"].get("job") == "ray"], 60, "Prometheus dropping Ray's targets")
        assert gone is True
        assert wait_for(lambda: not marked_pids(mark), 10, "no process of the run left") is True
    finally:
        kill_marked(mark)
        shutil.rmtree(ray_tmp, ignore_errors=True)
