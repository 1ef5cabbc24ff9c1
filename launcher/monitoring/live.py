"""The run's live metrics: an events observer that feeds the Prometheus endpoint.

The run loop hands every watcher its stage's progress twice a second (``RunEvents.progress``),
from every rank's latest beacon on every host; a submitted run's follower does the same with
what the remote-run wire brings. This watcher turns each reading into a ``StageSample`` for ``/metrics``: steps, state, the stage's
world size and restarts, and each rank's host time per step from successive readings. Host
numbers only: nothing here reaches a rank or a device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.monitoring.endpoint import MetricsEndpoint, RankSample, StageSample, default_sd_dir
from launcher.stage.watch import RankLive, RunEvents, StageProgress

if TYPE_CHECKING:
    from launcher.results.store import RunResult


class MetricsEvents(RunEvents):
    """Serves ``/metrics`` on 127.0.0.1 for the run's lifetime (``start`` ... ``close``)."""

    def __init__(self, job: str, run_id: str, backend: str, samples_per_step: int | None) -> None:
        self.job, self.run_id, self.backend = job, run_id, backend
        self.samples_per_step = samples_per_step
        self.endpoint = MetricsEndpoint()
        self._last: dict[tuple[int, int], tuple[float, int]] = {}  # (world, rank) -> (beacon t, steps)
        self._step_s: dict[tuple[int, int], float] = {}

    def start(self, port: int) -> str:
        """Bind (port 0: a free one), announce it for Prometheus's file discovery; the URL."""
        # the port now (a port in use is refused before anything starts); serving and the discovery
        # file on a thread of their own, while the ranks start
        self.endpoint.start(port=port, sd_dir=default_sd_dir(), sd_name=f"{self.job}-{self.run_id}", wait=False)
        return self.endpoint.url

    def close(self) -> None:
        self.endpoint.close()

    def progress(self, progress: StageProgress) -> None:
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
                          work_s=live.work_s, straggler=live.straggler, beacon_t=t)

    def stage_finished(self) -> None:
        self.endpoint.clear()

    def finished(self, result: RunResult) -> None:
        self.close()
