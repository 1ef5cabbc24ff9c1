"""The run's live metrics: an events observer that feeds the Prometheus endpoint.

The run loop already reads every rank's beacon twice a second (``RunEvents.progress``); this
observer turns each reading into a ``StageSample`` for ``/metrics``: steps, state, the stage's
world size and restarts, and each rank's host time per step from successive readings. Host
numbers only: nothing here reaches a rank or a device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.control.events import RankLive, RunEvents, StageProgress
from launcher.control.metrics_endpoint import MetricsEndpoint, RankSample, StageSample, default_sd_dir

if TYPE_CHECKING:
    from launcher.control.planning import StagePlan
    from launcher.results.store import RunResult


class MetricsEvents(RunEvents):
    """Serves ``/metrics`` on 127.0.0.1 for the run's lifetime (``start`` ... ``close``)."""

    def __init__(self, job: str, run_id: str, backend: str, samples_per_step: int | None = None) -> None:
        self.job, self.run_id, self.backend = job, run_id, backend
        self.samples_per_step = samples_per_step
        self.endpoint = MetricsEndpoint()
        self._last: dict[tuple[int, int], tuple[float, int]] = {}  # (world, rank) -> (beacon t, steps)
        self._step_s: dict[tuple[int, int], float] = {}

    def start(self, port: int) -> str:
        """Bind (port 0: a free one), announce it for Prometheus's file discovery; the URL."""
        self.endpoint.start(port=port, sd_dir=default_sd_dir(), sd_name=f"{self.job}-{self.run_id}")
        return self.endpoint.url

    def close(self) -> None:
        self.endpoint.close()

    def progress(self, plan: StagePlan, progress: StageProgress) -> None:
        ranks = tuple(self._sample(progress.world_size, r) for r in progress.ranks)
        self.endpoint.update(StageSample(self.job, self.run_id, self.backend, progress.world_size, progress.restarts, ranks, self.samples_per_step))

    def _sample(self, world: int, live: RankLive) -> RankSample:
        rank, steps, t = live.rank, live.steps, live.beacon_t
        key = (world, rank)
        before = self._last.get(key)
        if t is not None and before is not None and steps > before[1] and t > before[0]:
            self._step_s[key] = (t - before[0]) / (steps - before[1])  # host time per step since the last beacon
        if t is not None and (before is None or steps != before[1]):
            self._last[key] = (t, steps)
        step_s = self._step_s.get(key)
        return RankSample(rank=rank, node=live.host, state=live.phase, steps=steps, last_step_s=step_s, mean_step_s=step_s,
                          work_s=live.work_s, straggler=live.straggler)

    def stage_finished(self) -> None:
        self.endpoint.clear()

    def finished(self, result: RunResult) -> None:
        self.close()


class TeeEvents(RunEvents):
    """Every event to each of several watchers, in order (the console, then the metrics)."""

    def __init__(self, *watchers: RunEvents) -> None:
        self.watchers = watchers

    def note(self, text: str) -> None:
        for w in self.watchers:
            w.note(text)

    def message(self, text: str) -> None:
        for w in self.watchers:
            w.message(text)

    def rank_output(self, source: str, text: str) -> None:
        for w in self.watchers:
            w.rank_output(source, text)

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        for w in self.watchers:
            w.stage_started(job, world_size, device_type, backend)

    def progress(self, plan: StagePlan, progress: StageProgress) -> None:
        for w in self.watchers:
            w.progress(plan, progress)

    def remote_progress(self, progress: StageProgress) -> None:
        for w in self.watchers:
            w.remote_progress(progress)

    def stage_finished(self) -> None:
        for w in self.watchers:
            w.stage_finished()

    def finished(self, result: RunResult) -> None:
        for w in self.watchers:
            w.finished(result)
