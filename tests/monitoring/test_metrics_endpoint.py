"""The launcher's /metrics endpoint on its own: names, labels, values, stage changes, lifecycle."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

from launcher import metric_names as me
from launcher.monitoring import endpoint as endpoint_module
from launcher.monitoring.endpoint import MetricsEndpoint, RankSample, StageSample
from launcher.procutil import process_start_ticks
from tests.monitoring.conftest import wait_for


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def stage(world_size: int, steps: int, *, run_id: str = "run-1", restarts: int = 0, samples_per_step: int | None = None,
          straggler: int | None = None, state: str = "running") -> StageSample:
    ranks = tuple(
        RankSample(rank=k, node=f"host{k // 2}", state=state, steps=steps, last_step_s=0.02 + 0.001 * k,
                   mean_step_s=0.025 + 0.001 * k, work_s=0.01 if k != straggler else 0.024, straggler=k == straggler)
        for k in range(world_size)
    )
    return StageSample(job="matmul_scaling", run_id=run_id, backend="torchrun", world_size=world_size, restarts=restarts,
                       ranks=ranks, samples_per_step=samples_per_step)


def scrape(endpoint: MetricsEndpoint) -> dict[str, list[tuple[dict[str, str], float]]]:
    """{exported sample name: [(labels, value), ...]} from a real HTTP scrape."""
    with urllib.request.urlopen(endpoint.url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


@pytest.fixture
def endpoint():
    ep = MetricsEndpoint(clock=FakeClock())
    ep.start()
    yield ep
    ep.close()


def test_serves_every_name_with_per_rank_labels_on_localhost(endpoint):
    assert endpoint.host == "127.0.0.1" and endpoint.url == f"http://127.0.0.1:{endpoint.port}/metrics"
    clock = endpoint._clock
    endpoint.update(stage(2, 0, samples_per_step=64, straggler=1))
    clock.t += 2.0
    endpoint.update(stage(2, 100, samples_per_step=64, straggler=1))
    got = scrape(endpoint)

    assert set(got) >= {m.exported for m in me.ENDPOINT_METRICS}
    assert me.STEP_SECONDS.exported not in got  # no histogram: the endpoint sees snapshots, not steps
    assert not any(name.startswith("ray_") for name in got)
    for m in me.ENDPOINT_METRICS:
        for labels, _ in got[m.exported]:
            assert tuple(sorted(labels)) == tuple(sorted(m.labels)), m.name
            assert "job" not in labels  # Prometheus's own label: never ours

    steps = {labels["rank"]: (labels, v) for labels, v in got["gpulaunch_steps_total"]}
    assert set(steps) == {"0", "1"}
    labels, value = steps["1"]
    assert labels == {"gpulaunch_job": "matmul_scaling", "run_id": "run-1", "world_size": "2", "rank": "1", "node": "host0"}
    assert value == 100
    rates = {labels["rank"]: v for labels, v in got["gpulaunch_steps_per_second"]}
    assert rates == {"0": pytest.approx(50.0), "1": pytest.approx(50.0)}
    samples = {labels["rank"]: v for labels, v in got["gpulaunch_samples_per_second"]}
    assert samples == {"0": pytest.approx(50.0 * 64), "1": pytest.approx(50.0 * 64)}
    mean = {labels["rank"]: v for labels, v in got["gpulaunch_step_time_seconds"]}
    assert mean == {"0": pytest.approx(0.025), "1": pytest.approx(0.026)}
    last = {labels["rank"]: v for labels, v in got["gpulaunch_last_step_time_seconds"]}
    assert last == {"0": pytest.approx(0.020), "1": pytest.approx(0.021)}
    work = {labels["rank"]: v for labels, v in got["gpulaunch_rank_work_seconds"]}
    assert work == {"0": pytest.approx(0.010), "1": pytest.approx(0.024)}
    assert {labels["rank"]: v for labels, v in got["gpulaunch_straggler"]} == {"0": 0.0, "1": 1.0}
    assert [(labels["rank"], labels["state"], v) for labels, v in got["gpulaunch_rank_state"]] == [("0", "running", 1.0), ("1", "running", 1.0)]
    assert got["gpulaunch_restarts_total"] == [({"gpulaunch_job": "matmul_scaling", "run_id": "run-1", "world_size": "2"}, 0.0)]
    assert got["gpulaunch_world_size"] == [({"gpulaunch_job": "matmul_scaling", "run_id": "run-1", "backend": "torchrun"}, 2.0)]


def test_optional_numbers_are_left_out_not_zero(endpoint):
    sample = StageSample("j", "r", "ray", 1, 0, (RankSample(0, "n", "importing", 0, None, None, None, False),), None)
    endpoint.update(sample)
    got = scrape(endpoint)
    for name in ("gpulaunch_step_time_seconds", "gpulaunch_last_step_time_seconds", "gpulaunch_rank_work_seconds",
                 "gpulaunch_steps_per_second", "gpulaunch_samples_per_second"):
        assert name not in got, name  # unknown yet: no series (a 0 would read as "infinitely fast")
    assert got["gpulaunch_steps_total"][0][1] == 0
    assert got["gpulaunch_rank_state"][0][0]["state"] == "importing"


def test_nothing_is_exported_before_the_first_update(endpoint):
    got = scrape(endpoint)
    assert not any(name.startswith("gpulaunch_") for name in got)


def test_a_new_stage_replaces_the_old_stages_series(endpoint):
    clock = endpoint._clock
    endpoint.update(stage(2, 10))
    clock.t += 1
    endpoint.update(stage(2, 20))
    assert {labels["world_size"] for labels, _ in scrape(endpoint)["gpulaunch_steps_total"]} == {"2"}
    clock.t += 1
    endpoint.update(stage(4, 0))
    got = scrape(endpoint)
    for name, samples in got.items():
        if name.startswith("gpulaunch_") and name != "gpulaunch_world_size":
            assert {labels["world_size"] for labels, _ in samples} == {"4"}, name
    assert len(got["gpulaunch_steps_total"]) == 4
    assert "gpulaunch_steps_per_second" not in got  # a fresh stage: no rate until a second update
    assert got["gpulaunch_world_size"][0][1] == 4.0
    clock.t += 1
    endpoint.update(stage(4, 30))
    assert [v for _, v in scrape(endpoint)["gpulaunch_steps_per_second"]] == [pytest.approx(30.0)] * 4
    endpoint.clear()
    assert not any(name.startswith("gpulaunch_") for name in scrape(endpoint))


def test_step_rate_uses_a_window_and_survives_a_restart(endpoint):
    clock = endpoint._clock
    # 10 steps per second, sampled every 0.5 s with the beacon's granularity (jittery)
    counts = [0, 0, 10, 10, 20, 20, 30, 35, 40, 45, 50, 55, 60]
    for c in counts:
        endpoint.update(stage(1, c))
        clock.t += 0.5
    (rate,) = [v for _, v in scrape(endpoint)["gpulaunch_steps_per_second"]]
    assert 8.0 <= rate <= 12.0  # over the 5 s window, not the last 0.5 s interval
    # the group restarted: steps count again from 0; the rate does not go negative
    endpoint.update(stage(1, 0, restarts=1))
    clock.t += 1.0
    endpoint.update(stage(1, 10, restarts=1))
    got = scrape(endpoint)
    assert got["gpulaunch_steps_per_second"][0][1] == pytest.approx(10.0)
    assert got["gpulaunch_restarts_total"][0][1] == 1.0


def test_close_frees_the_port_and_stops_serving():
    ep = MetricsEndpoint()
    port = ep.start()
    ep.update(stage(1, 1))
    assert "gpulaunch_steps_total" in scrape(ep)
    ep.close()
    ep.close()  # idempotent
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with MetricsEndpoint() as again:  # the port is free again (a later run may ask for it)
        assert again.start(port=port) == port


def test_a_chosen_port_and_two_runs_in_one_process():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        wanted = sock.getsockname()[1]
    with MetricsEndpoint() as a, MetricsEndpoint() as b:
        assert a.start(port=wanted) == wanted
        b.start()
        a.update(stage(1, 5, run_id="a"))
        b.update(stage(2, 7, run_id="b"))
        assert {labels["run_id"] for labels, _ in scrape(a)["gpulaunch_steps_total"]} == {"a"}
        assert {labels["run_id"] for labels, _ in scrape(b)["gpulaunch_steps_total"]} == {"b"}
        with pytest.raises(RuntimeError):
            a.start()
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{wanted}"):
            MetricsEndpoint().start(port=wanted)  # taken: a clear error, not a traceback from deep inside
        from prometheus_client import REGISTRY

        assert REGISTRY.get_sample_value("gpulaunch_steps_total", {"rank": "0"}) is None  # not the global registry


def test_writes_a_file_sd_entry_while_live(tmp_path):
    sd_dir = tmp_path / "prom_sd"
    ep = MetricsEndpoint()
    port = ep.start(sd_dir=sd_dir, sd_name="matmul_scaling-run-1")
    entry = sd_dir / "matmul_scaling-run-1.json"
    owner = {endpoint_module.SD_PID_LABEL: str(os.getpid()), endpoint_module.SD_PID_START_LABEL: str(process_start_ticks())}
    assert json.loads(entry.read_text()) == [{"targets": [f"127.0.0.1:{port}"], "labels": owner}]  # who wrote it: see the sweep
    assert sd_dir.stat().st_mode & 0o1777 == 0o1777  # shared by every user's runs, like /tmp
    assert [p.name for p in sd_dir.iterdir()] == [entry.name]  # no temporary file left behind
    ep.close()
    assert not entry.exists()


def test_default_sd_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(endpoint_module.SD_DIR_ENV, raising=False)
    assert endpoint_module.default_sd_dir() == endpoint_module.DEFAULT_SD_DIR
    monkeypatch.setenv(endpoint_module.SD_DIR_ENV, str(tmp_path))
    assert endpoint_module.default_sd_dir() == tmp_path


def test_names_labels_and_buckets_for_the_ray_actors():
    assert me.STEPS.exported == "gpulaunch_steps_total" and me.STEPS.ray_exported == "ray_gpulaunch_steps_total"
    assert me.STEP_TIME.ray_exported == "ray_gpulaunch_step_time_seconds"
    assert me.STEPS.selector == '__name__=~"(ray_)?gpulaunch_steps_total"'
    assert me.rank_tags("j", "r", 4, 3, "n") == {"gpulaunch_job": "j", "run_id": "r", "world_size": "4", "rank": "3", "node": "n"}
    assert set(me.rank_tags("j", "r", 4, 3, "n")) == set(me.RANK_LABELS)
    assert len({m.name for m in me.METRICS}) == len(me.METRICS) and all(m.name.startswith("gpulaunch_") for m in me.METRICS)
    b = me.STEP_SECONDS_BUCKETS
    assert list(b) == sorted(b) and b[0] == 1e-4 and b[-1] == 500.0
    assert b[:6] == (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005)  # 1-2-5 per decade, exact labels
    mantissas = {f"{x:e}".split("e")[0] for x in b}
    assert mantissas == {"1.000000", "2.000000", "5.000000"} and len(b) == 3 * 7


def sd_entry(directory, name: str, target: str, pid: int | None = None, started: int | None = None) -> str:
    """A file-SD entry as an endpoint writes it (owner labels only when ``pid`` is given: older
    launchers wrote none)."""
    group: dict = {"targets": [target]}
    if pid is not None:
        group["labels"] = {endpoint_module.SD_PID_LABEL: str(pid)}
        if started is not None:
            group["labels"][endpoint_module.SD_PID_START_LABEL] = str(started)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps([group]))
    return f"{name}.json"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens there once the socket is closed


def test_start_removes_the_entries_of_launchers_that_are_gone(tmp_path):
    sd_dir = tmp_path / "prom_sd"
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # a launcher that is gone: its pid runs nothing now
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=subprocess.DEVNULL)
    listening = socket.create_server(("127.0.0.1", 0))
    try:
        live_start = wait_for(lambda: process_start_ticks(live.pid), 10, "the live process's start time")
        dead = sd_entry(sd_dir, "dead", "127.0.0.1:1", finished.pid, 1)
        reused = sd_entry(sd_dir, "reused", "127.0.0.1:2", live.pid, live_start - 1)  # the pid runs another process now
        alive = sd_entry(sd_dir, "alive", "127.0.0.1:3", live.pid, live_start)
        pid_only = sd_entry(sd_dir, "pid-only", "127.0.0.1:4", live.pid)
        old_dead = sd_entry(sd_dir, "old-dead", f"127.0.0.1:{closed_port()}")  # no owner: nothing listens on its port
        old_live = sd_entry(sd_dir, "old-live", f"127.0.0.1:{listening.getsockname()[1]}")  # no owner, but served
        remote = sd_entry(sd_dir, "remote", "192.0.2.1:9100")  # no owner, not on this machine: not ours to judge
        (sd_dir / "garbage.json").write_text("{not json")
        mine = MetricsEndpoint()
        mine.start(sd_dir=sd_dir, sd_name="mine")
        try:
            kept = sorted(p.name for p in sd_dir.iterdir())
            assert kept == sorted([alive, pid_only, old_live, remote, "garbage.json", "mine.json"]), kept
            assert dead not in kept and reused not in kept and old_dead not in kept
            with MetricsEndpoint() as other:  # two runs in one process: neither removes the other's entry
                other.start(sd_dir=sd_dir, sd_name="other")
                assert (sd_dir / "mine.json").exists() and (sd_dir / "other.json").exists()
            assert not (sd_dir / "other.json").exists()
        finally:
            mine.close()
        assert not (sd_dir / "mine.json").exists()
    finally:
        listening.close()
        live.kill()
        live.wait()


def test_a_live_endpoint_keeps_removing_the_entries_of_launchers_that_are_gone(tmp_path):
    sd_dir = tmp_path / "prom_sd"
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    ep = MetricsEndpoint(sd_sweep_s=0.1)
    ep.start(sd_dir=sd_dir, sd_name="mine")
    try:
        dead = sd_dir / sd_entry(sd_dir, "killed-later", "127.0.0.1:1", finished.pid, 1)  # appears after this run began
        wait_for(lambda: not dead.exists(), 30, "the live endpoint's sweep to remove the dead launcher's entry")
        assert (sd_dir / "mine.json").exists()
        sweeper = ep._sweeper
        assert sweeper is not None and sweeper.is_alive()
    finally:
        ep.close()
    assert not sweeper.is_alive()  # close stops the sweep
    assert not list(sd_dir.iterdir())
