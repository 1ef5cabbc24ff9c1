"""Ray's live channel batched per node (``NodeRelay``): on a real Ray head, three ranks on its one
node, the launcher makes one call for the node (its relay's ``serve``, answering over the stage's
sink), and still gets every rank's beacons (twice a second, as the ranks write them), every
output line in order, each rank's last words and every report; a relay that dies hands its node
back to one drain per rank without a gap.

The launcher runs in this process as the head's driver (``ray_driver``); what reaches the run
loop is read where the stage hands it over (``RayStage.emit``)."""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

import launcher
from launcher.backends.ray import RELAY_BATCH_S, RayStage
from launcher.stage.events import RankBeacon
from tests.ray.conftest import RayHead, assert_ray_run_left_nothing
from tests.waiting import wait_empty

pytestmark = pytest.mark.slow
WORLD, SECONDS = 3, 6.0


class Tap:
    """What the stage hands the run loop, and the channel it used."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, kill_relay_after_s: float | None = None) -> None:
        self.beacons: list[tuple[float, RankBeacon]] = []
        self.batches: list[int] = []  # ranks per emit call that carried beacons
        self.relays: list[Any] = []
        self.shape: tuple[int, int, int] | None = None  # (serves, streams, drains) as the channel started
        self.sink_answers = 0
        self.killed_at: float | None = None
        tap = self
        emit, start_channel, make_relay, take_sink = RayStage.emit, RayStage._start_channel, RayStage._make_relay, RayStage._take_sink

        def emit_tapped(stage: RayStage, *events: Any) -> None:
            now = time.time()
            got = [e for e in events if isinstance(e, RankBeacon)]
            if got:
                tap.batches.append(len(got))
                tap.beacons += [(now, e) for e in got]
                running = [e for _, e in tap.beacons if e.beacon.phase == "running"]
                if kill_relay_after_s is not None and tap.killed_at is None and running:
                    if now - min(e.beacon.t or now for e in running) > kill_relay_after_s:
                        import ray

                        tap.killed_at = now
                        ray.kill(tap.relays[0], no_restart=True)
            emit(stage, *events)

        def start_tapped(stage: RayStage) -> None:
            start_channel(stage)
            tap.shape = (len(stage._relay_serves), len(stage._relay_streams), len(stage._drains))

        def make_tapped(stage: RayStage, node_id: str, ranks: list[int]) -> Any:
            relay = make_relay(stage, node_id, ranks)
            tap.relays.append(relay)
            return relay

        def take_sink_tapped(stage: RayStage, taken: Any, final: bool = False) -> None:
            tap.sink_answers += len(taken.answers)
            take_sink(stage, taken, final)

        monkeypatch.setattr(RayStage, "emit", emit_tapped)
        monkeypatch.setattr(RayStage, "_take_sink", take_sink_tapped)
        monkeypatch.setattr(RayStage, "_start_channel", start_tapped)
        monkeypatch.setattr(RayStage, "_make_relay", make_tapped)

    def gaps(self, since: float = 0.0) -> dict[int, float]:
        """Per rank, the median time between the running beacons that reached the run loop (by
        their own timestamps, written after ``since``): 0.5 s when each one the rank wrote (twice
        a second) arrived, 1 s if every other one were lost. The median, as a rank's beacon thread
        on a machine at load 30 is itself late now and then."""
        gaps = {}
        for rank in range(WORLD):
            ts = sorted({e.beacon.t for _, e in self.beacons if e.rank == rank and e.beacon.phase == "running" and (e.beacon.t or 0) > since})
            gaps[rank] = statistics.median(b - a for a, b in zip(ts, ts[1:])) if len(ts) > 4 else float("inf")
        return gaps


def _run(tmp_path: Path) -> tuple[launcher.RunResult, dict]:
    spec = tmp_path / "relay.yaml"
    spec.write_text(
        f"name: relay\nentrypoint: tests.ray.relay_job:run\nbackend: ray\nparams: {{seconds: {SECONDS}}}\n"
        f"resources: {{cpu_workers: {WORLD}}}\nscaling: {{workers: [{WORLD}]}}\ntimeouts: {{rendezvous_s: 60, run_s: 120}}\n"
    )
    run = launcher.run_job(spec, backend="ray", out=tmp_path / "out", events=launcher.RunEvents())
    (found,) = sorted((tmp_path / "out").glob("relay/*/result.json"))
    return run, json.loads(found.read_text())


def _check_lines(result: dict, may_lose: int = 0) -> None:
    """Every line of every rank, once each and in order (but ``may_lose``), and its last words."""
    for r in result["ranks"]:
        log = Path(result["run_dir"], f"world{WORLD}", "logs", f"rank{r['rank']}.log").read_text()
        numbers = [int(n) for n in re.findall(rf"relay-line rank {r['rank']} n (\d+)", log)]
        assert numbers == sorted(set(numbers)) and numbers[-1] == r["result"]["lines"] - 1, (r["rank"], numbers, r["result"])
        assert len(numbers) >= r["result"]["lines"] - may_lose, (r["rank"], numbers, r["result"])
        assert f"relay-last rank {r['rank']} after {r['result']['lines']}" in log, log[-500:]


def _relays_alive(head: RayHead) -> list[dict]:
    actors = head.rest("/api/v0/actors?limit=1000")["data"]["result"]["result"]
    return [a for a in actors if a.get("class_name") == "NodeRelay" and a.get("state") != "DEAD"]


def test_one_drain_per_node_brings_every_ranks_beacons_lines_and_reports(ray_driver: RayHead, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tap = Tap(monkeypatch)
    started = time.monotonic()
    run, result = _run(tmp_path)
    took = time.monotonic() - started
    assert run.status == "succeeded" and run.exit_code == 0, run.data.get("failure")
    assert sorted((r["rank"], r["status"]) for r in result["ranks"]) == [(k, "ok") for k in range(WORLD)]
    assert tap.shape == (1, 0, 0), "one call (the relay's serve) for the node, no stream, no drain per rank"
    assert len(tap.relays) == 1
    # one answer per node per interval, all of them over the sink: at most one every RELAY_BATCH_S (and the last ones)
    assert 0 < len(tap.batches) <= tap.sink_answers + 1 <= took / RELAY_BATCH_S + 3, (len(tap.batches), tap.sink_answers, took)  # +1: the final answer
    assert max(tap.batches) > 1, "the node's answers carry several ranks' beacons at once"
    gaps = tap.gaps()
    assert all(gap <= 0.6 for gap in gaps.values()), gaps  # every beacon of 2 a second
    _check_lines(result)
    assert_ray_run_left_nothing(ray_driver, "relay", [r["pid"] for r in result["ranks"]])
    # 60 s: a hang guard (the relay ends with its stage; Ray's actor table says so a moment later)
    assert wait_empty(lambda: _relays_alive(ray_driver), 60.0, 0.2) == [], "the node's relay outlived the stage"


def test_a_relay_that_dies_hands_its_ranks_back_to_a_drain_each(ray_driver: RayHead, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tap = Tap(monkeypatch, kill_relay_after_s=2.0)
    run, result = _run(tmp_path)
    assert run.status == "succeeded" and run.exit_code == 0, run.data.get("failure")
    assert tap.killed_at is not None, "the relay was not killed: the run ended too soon"
    after = tap.gaps(since=tap.killed_at + 1.0)
    assert all(gap <= 0.6 for gap in after.values()), after  # beacons go on, by the ranks' own drains
    _check_lines(result, may_lose=15)  # what the relay held when it died (at most ~0.5 s of lines)
    assert_ray_run_left_nothing(ray_driver, "relay", [r["pid"] for r in result["ranks"]])
