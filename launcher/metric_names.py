"""Metric names and labels, in one place for every exporter: the launcher's Prometheus endpoint
(``launcher.monitoring.endpoint``) and the Ray actors (``launcher.runtime.ray_actor``).
Standard library only: the rank runtime imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

LABEL_JOB = "gpulaunch_job"  # not "job": Prometheus sets that one (the scrape job; Ray's is "ray")
LABEL_RUN_ID = "run_id"
LABEL_WORLD_SIZE = "world_size"
LABEL_RANK = "rank"
LABEL_NODE = "node"
LABEL_STATE = "state"
LABEL_BACKEND = "backend"

RANK_LABELS: tuple[str, ...] = (LABEL_JOB, LABEL_RUN_ID, LABEL_WORLD_SIZE, LABEL_RANK, LABEL_NODE)
STAGE_LABELS: tuple[str, ...] = (LABEL_JOB, LABEL_RUN_ID, LABEL_WORLD_SIZE)
RUN_LABELS: tuple[str, ...] = (LABEL_JOB, LABEL_RUN_ID, LABEL_BACKEND)
# what a dashboard folds the endpoint's and Ray's series of one rank into (node may be spelt
# differently by the two: the launcher's host name for a node, the actor's own hostname)
RANK_KEY: tuple[str, ...] = (LABEL_JOB, LABEL_RUN_ID, LABEL_WORLD_SIZE, LABEL_RANK)

RAY_PREFIX = "ray_"  # what Ray puts in front of every application metric it exports


@dataclass(frozen=True)
class MetricSpec:
    """One metric: ``name`` is what a client library is given (``prometheus_client`` and
    ``ray.util.metrics`` alike); ``exported`` is the series name Prometheus stores (a counter
    gains ``_total``); ``ray_exported`` is the name when a Ray actor exports it."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    labels: tuple[str, ...]
    help: str

    @property
    def exported(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name

    @property
    def ray_exported(self) -> str:
        return RAY_PREFIX + self.exported

    @property
    def selector(self) -> str:
        """A PromQL name matcher for both sources: ``{__name__=~"(ray_)?<exported>"}``'s inside."""
        return f'__name__=~"({RAY_PREFIX})?{self.exported}"'


STEPS = MetricSpec("gpulaunch_steps", "counter", RANK_LABELS, "Steps a rank has done in this stage (ctx.metrics.step()).")
STEPS_PER_SECOND = MetricSpec("gpulaunch_steps_per_second", "gauge", RANK_LABELS, "A rank's step rate over the last few seconds.")
SAMPLES_PER_SECOND = MetricSpec(
    "gpulaunch_samples_per_second", "gauge", RANK_LABELS, "A rank's samples per second (steps/s times the job's samples per step)."
)
STEP_TIME = MetricSpec("gpulaunch_step_time_seconds", "gauge", RANK_LABELS, "Host time per step, recent mean.")
LAST_STEP_TIME = MetricSpec("gpulaunch_last_step_time_seconds", "gauge", RANK_LABELS, "Host time of a rank's last step.")
RANK_WORK = MetricSpec("gpulaunch_rank_work_seconds", "gauge", RANK_LABELS, "A rank's own work per step (not waiting for peers), median of recent steps.")
STRAGGLER = MetricSpec("gpulaunch_straggler", "gauge", RANK_LABELS, "1 while the rank is flagged as a straggler, else 0.")
RANK_STATE = MetricSpec(
    "gpulaunch_rank_state", "gauge", RANK_LABELS + (LABEL_STATE,), "1 for the state a rank is in now (one series per rank)."
)
RESTARTS = MetricSpec("gpulaunch_restarts", "counter", STAGE_LABELS, "Group restarts of the live stage so far.")
WORLD_SIZE = MetricSpec("gpulaunch_world_size", "gauge", RUN_LABELS, "World size of the live stage.")
STEP_SECONDS = MetricSpec("gpulaunch_step_seconds", "histogram", RANK_LABELS, "Host time between steps (Ray actors: every step).")

METRICS: tuple[MetricSpec, ...] = (
    STEPS, STEPS_PER_SECOND, SAMPLES_PER_SECOND, STEP_TIME, LAST_STEP_TIME, RANK_WORK, STRAGGLER,
    RANK_STATE, RESTARTS, WORLD_SIZE, STEP_SECONDS,
)  # fmt: skip
ENDPOINT_METRICS: tuple[MetricSpec, ...] = tuple(m for m in METRICS if m is not STEP_SECONDS)


def _one_two_five(lo_exp: int, hi_exp: int) -> tuple[float, ...]:
    return tuple(float(f"{m}e{e}") for e in range(lo_exp, hi_exp + 1) for m in (1, 2, 5))


# 1-2-5 per decade, 100 us .. 500 s: fine enough for a median or p99 of a step time
STEP_SECONDS_BUCKETS: tuple[float, ...] = _one_two_five(-4, 2)


def rank_tags(job: str, run_id: str, world_size: int, rank: int, node: str) -> dict[str, str]:
    """The label values of one rank's series (``tags=`` for ``ray.util.metrics``)."""
    return {LABEL_JOB: job, LABEL_RUN_ID: run_id, LABEL_WORLD_SIZE: str(world_size), LABEL_RANK: str(rank), LABEL_NODE: node}
