"""The step rates the docs (docs/monitoring.md) and the Grafana dashboard query are right from a run's first scrapes.

A real Prometheus (the repo's scrape config, 1 s scrapes) scrapes a real 30-second torchrun run
found through file discovery. After the run, every query of docs/monitoring.md and
every step-rate panel of the dashboard is asked at the time of each scrape (Prometheus's HTTP API,
an instant query at the scrape's own time stamp), from the third scrape that saw the ranks step
to the ranks' last step. Each must answer, within 10%, what the endpoint's own rate
(``gpulaunch_steps_per_second``) said at that scrape, and what the ranks really did: their step
rate over the same recent window, from the time of every step (the job writes them down), up to
the step the scrape's ``gpulaunch_steps_total`` counted (the beacons the endpoint had by then;
on a loaded machine they arrive a second or two late, while the ranks' own rate moves by 20%).

A scrape where the ranks' true rate itself moves by more than the tolerance within one beacon
interval of that step (a second's stall entering or leaving the window: 36 -> 49 steps/s from
one scrape to the next, seen once in CI) is not compared: the endpoint places a window's edge to
a beacon, so there its rate is right to within that jump only; at least two thirds of the
scrapes must be compared.

This is what ``rate(gpulaunch_steps_total[1m])`` failed: Prometheus divides by the whole minute,
so through a run's first minute it under-read (119, then 204 steps/s for a run at 558).
"""

from __future__ import annotations

import bisect
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time


from launcher.monitoring.endpoint import RATE_WINDOW_S
from tests.conftest import REPO
from tests.monitoring.conftest import Prometheus
from tests.monitoring.test_prometheus_scrape import dashboard_queries, repo_scrape_config
from tests.integration.faultkit import pythonpath

JOB = "step_rates"
SECONDS, STEP_S, SAMPLES_PER_STEP = 30, 0.02, 8
TOLERANCE = 0.10
BEACON_S = 0.5  # how often a rank writes its beacon (its step count, stamped with its own clock)
MONITORING_DOC = REPO / "docs" / "monitoring.md"

SPEC = f"""\
name: {JOB}
entrypoint: tests.monitoring.stepper_job:run
params: {{seconds: {SECONDS}, step_s: {STEP_S}, trace_dir: TRACE_DIR}}
resources: {{cpu_workers: 2}}
scaling: {{workers: [2]}}
monitoring: {{samples_per_step: {SAMPLES_PER_STEP}}}
"""


def doc_queries() -> list[str]:
    """Every query (one a line, ``#`` comments left out) of the ```promql blocks of the Monitoring
    page (docs/monitoring.md), its ``gpulaunch_job="..."`` made this test's job."""
    section = MONITORING_DOC.read_text()
    lines = [line.strip() for block in re.findall(r"```promql\n(.*?)```", section, re.S) for line in block.splitlines()]
    return [re.sub(r'gpulaunch_job="[^"]*"', f'gpulaunch_job="{JOB}"', q) for q in lines if q and not q.startswith("#")]


def step_rate_panels() -> list[tuple[str, str]]:
    return [(title, expr) for title, expr in dashboard_queries() if re.search(r"step rate|steps/s|samples/s", title, re.I)]


def expected(expr: str, labels: dict[str, str], per_rank: dict[str, float]) -> float:
    """What ``expr`` should answer for the series ``labels``, given each rank's steps/s: the rank's
    own (a per-rank series) or the query's outer aggregation of all of them; samples/s scaled."""
    scale = SAMPLES_PER_STEP if "samples_per_second" in expr else 1
    if "rank" in labels:
        return per_rank[labels["rank"]] * scale
    outer = re.match(r"\s*(min|max|sum|avg)\s+by", expr)
    assert outer, f"a query without a rank label needs an outer min/max/sum/avg by (...): {expr}"
    fold = {"min": min, "max": max, "sum": sum, "avg": statistics.mean}[outer.group(1)]
    return fold(per_rank.values()) * scale


def true_rate(steps: list[float], at: float) -> float:
    """A rank's steps/s over the RATE_WINDOW_S before ``at`` (or since its first step), from the
    time of every step it did."""
    since = max(at - RATE_WINDOW_S, steps[0])
    return (bisect.bisect_right(steps, at) - bisect.bisect_right(steps, since)) / (at - since)


def raw_samples(prom: Prometheus, selector: str, at: float) -> dict[str, list[tuple[float, float]]]:
    """rank -> [(scrape time, value), ...]: the samples as scraped (a range selector's raw points)."""
    result = prom.api("query", query=f"{selector}[10m]", time=f"{at:.3f}")["result"]
    return {r["metric"]["rank"]: [(float(t), float(v)) for t, v in r["values"]] for r in result}


def test_doc_and_dashboard_step_rates_are_right_from_the_third_scrape(tmp_path, start_prometheus):
    queries = [("docs/monitoring.md", q) for q in doc_queries()] + step_rate_panels()
    assert any(src == "docs/monitoring.md" for src, _ in queries) and len(queries) > len(doc_queries()), queries
    sd_dir, trace_dir = tmp_path / "prom_sd", tmp_path / "trace"
    sd_dir.mkdir()  # watched from Prometheus's start: the run's entry is seen at once
    trace_dir.mkdir()
    prom = start_prometheus(repo_scrape_config(tmp_path, sd_dir))  # 1 s scrapes
    spec = tmp_path / "rates.yaml"
    spec.write_text(SPEC.replace("TRACE_DIR", json.dumps(str(trace_dir))))
    env = {**os.environ, "GPULAUNCH_PROM_SD_DIR": str(sd_dir), "PYTHONPATH": pythonpath()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher", str(spec), "--out", str(tmp_path / "runs"), "--quiet"],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the launcher and its ranks
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    end = time.time()

    traces = {p.stem.removeprefix("rank"): json.loads(p.read_text()) for p in trace_dir.glob("rank*.json")}
    assert sorted(traces) == ["0", "1"] and all(len(t) > SECONDS * 10 for t in traces.values()), {k: len(v) for k, v in traces.items()}
    steps = raw_samples(prom, f'gpulaunch_steps_total{{gpulaunch_job="{JOB}"}}', end)
    assert sorted(steps) == ["0", "1"], steps
    # the scrapes at which every rank had stepped, from the third one, up to the ranks' last step
    stepping = sorted({t for t, _ in steps["0"]} & {t for t, _ in steps["1"]})
    stepping = [t for t in stepping if all(dict(steps[k])[t] > 0 for k in steps)]
    last_step = min(t[-1] for t in traces.values())
    checked = [t for t in stepping[2:] if t <= last_step]
    assert len(checked) >= SECONDS - 10, (len(checked), stepping)

    rows, wrong, transient = [], [], []
    for n, at in enumerate(checked, 3):
        gauge = {r["metric"]["rank"]: float(r["value"][1])
                 for r in prom.api("query", query=f'gpulaunch_steps_per_second{{gpulaunch_job="{JOB}"}}', time=f"{at:.3f}")["result"]}
        # the endpoint's rate is as of the beacons it had at this scrape (a loaded machine delivers
        # them late): the truth is the rank's rate when it had done the steps that scrape counted
        seen_at = {rank: times[int(dict(steps[rank])[at]) - 1] for rank, times in traces.items()}
        truth = {rank: true_rate(times, seen_at[rank]) for rank, times in traces.items()}
        if _transient(traces, seen_at):
            transient.append(n)
            continue
        row = [f"scrape {n:2d} (+{at - stepping[0]:4.1f} s)", "truth " + " ".join(f"{truth[k]:6.2f}" for k in sorted(truth)),
               "gauge " + " ".join(f"{gauge.get(k, float('nan')):6.2f}" for k in sorted(truth)),
               "behind " + " ".join(f"{at - seen_at[k]:4.2f}" for k in sorted(truth))]
        if sorted(gauge) != ["0", "1"]:
            wrong.append(f"{row[0]}: the gauge has ranks {sorted(gauge)}")
            rows.append(" | ".join(row))
            continue
        for q, (source, expr) in enumerate(queries):
            result = prom.api("query", query=expr, time=f"{at:.3f}")["result"]
            if not result:
                wrong.append(f"{row[0]}: {source}: {expr} answered nothing")
                continue
            if "rank" in result[0]["metric"] and sorted(r["metric"]["rank"] for r in result) != ["0", "1"]:
                wrong.append(f"{row[0]}: {source}: {expr} answered ranks {[r['metric'].get('rank') for r in result]}")
            for r in result:
                got = float(r["value"][1])
                for what, per_rank in (("the gauge", gauge), ("the ranks' true rate", truth)):
                    want = expected(expr, r["metric"], per_rank)
                    if not abs(got - want) <= TOLERANCE * want:
                        wrong.append(f"{row[0]}: {source}: {expr} {r['metric']}: {got:.2f}, {what} {want:.2f}")
                row.append(f"q{q} {got:7.2f}")
        rows.append(" | ".join(row))
    print("\n" + "\n".join(f"q{q}: {source}: {expr}" for q, (source, expr) in enumerate(queries)) + "\n" + "\n".join(rows))
    print(f"scrapes at a transient, not compared: {transient}")
    assert len(checked) - len(transient) >= (SECONDS - 10) * 2 // 3, (len(checked), transient)  # most of the run is compared
    assert not wrong, "\n".join(wrong[:40])


def _transient(traces: dict[str, list[float]], seen_at: dict[str, float]) -> bool:
    """Whether a rank's true rate moves by more than the tolerance within one beacon interval of
    the step a scrape counted: the endpoint knows a rank's count at its beacons only (every
    BEACON_S, each delivered up to a beacon late), so where the ranks stalled for a second (a busy
    machine) a window's edge is placed to within that interval, and its rate to within the jump."""
    for rank, times in traces.items():
        around = [true_rate(times, seen_at[rank] + d) for d in (-BEACON_S, 0.0, BEACON_S)]
        if max(around) > (1 + TOLERANCE) * min(around):
            return True
    return False
