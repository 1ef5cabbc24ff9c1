"""A run's result as a typed, frozen record, built once (``results.aggregate``) and turned into
``result.json``'s document only at the edge (``RunRecord.to_dict``).

What comes after the aggregation (the job's summary, its plots, TensorBoard, where the run
directory is) is added by making a new record with ``dataclasses.replace``, never by changing one
in place. The document keeps the fields and layout of ``schema_version`` 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from launcher.records import AttemptRecord, Failure, PreflightRecord, Recovery, RunStatus, SkippedWorld, Straggler

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class StageRecord:
    """One stage (world size) as the result reports it."""

    world_size: int
    status: RunStatus
    restarts: int
    wall_s: float
    phases: Mapping[str, float | None]  # where its start-up went: spawn, import, rendezvous, pg_init, run, to_first_step
    failure: Failure | None = None
    stragglers: tuple[Straggler, ...] = ()  # ranks whose own work per step stayed well above their peers', live
    load_avg: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)  # "start"/"end"
    attempts: tuple[AttemptRecord, ...] = ()  # every start of the group: its failure's class, the step it resumed from, the work lost
    recoveries: tuple[Recovery, ...] = ()  # every loss the stage tried to recover in place: in place, or the restart path and why

    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "world_size": self.world_size,
            "status": self.status.value,
            "restarts": self.restarts,
            "wall_s": self.wall_s,
            "phases": dict(self.phases),
            "failure": self.failure.to_dict() if self.failure else None,
            "stragglers": [s.to_dict() for s in self.stragglers],
            "attempts": [a.to_dict() for a in self.attempts],
        }
        if self.load_avg:
            doc["load_avg"] = {k: list(v) for k, v in self.load_avg.items()}
        if self.recoveries:
            doc["recoveries"] = [r.to_dict() for r in self.recoveries]
        return doc


@dataclass(frozen=True)
class RunRecord:
    """The whole run: its stages, every rank's report (with its timeline), the failure if any, and
    what the job's hooks and the launcher made of it."""

    job: str
    run_id: str
    backend: str
    status: RunStatus
    spec_hash: str
    spec: Mapping[str, Any]  # the effective spec, secrets masked
    params: Mapping[str, Any]  # what the ranks ran with, the workload's defaults included
    started_at: float
    finished_at: float
    phases: Mapping[str, float]  # the stages' start-up phases summed, and the aggregation's own time
    stages: tuple[StageRecord, ...]
    ranks: tuple[Mapping[str, Any], ...]  # each rank's report as a document, with ``timeline_s``
    failure: Failure | None = None
    summary: Mapping[str, Any] = field(default_factory=dict)  # the job's numbers, table and conclusions
    run_dir: str | None = None
    plots: tuple[str, ...] = ()  # relative to the run directory
    plot_error: str | None = None
    tensorboard: str | None = None  # the events' directory, relative to the run directory
    tensorboard_error: str | None = None
    preflight: PreflightRecord | None = None  # the hosts checked before the start: left out, spares, links
    skipped_worlds: tuple[SkippedWorld, ...] = ()  # listed world sizes the nodes could not run: why, what would
    # the launcher's own CPU seconds (not its agents' or ranks'): before_spawn, after_exit, total,
    # by_phase (launcher.control.cpuclock); in the document as phases.launcher_cpu_s
    launcher_cpu: Mapping[str, Any] | None = None
    # a run ``launch resume`` went on with: every launch of it (started_at, finished_at, wall_s,
    # status, gap_s: the time since the one before); none for a run launched once
    parts: tuple[Mapping[str, Any], ...] = ()
    schema_version: int = SCHEMA_VERSION

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return tuple(s.world_size for s in self.stages)

    @property
    def world_size(self) -> int:
        return max(self.world_sizes, default=0)

    @property
    def wall_s(self) -> float:
        """The run's wall time: a resumed run's launches summed, the time between them left out."""
        if self.parts:
            return round(sum(float(p["wall_s"]) for p in self.parts), 4)
        return round(self.finished_at - self.started_at, 4)

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        """``result.json``'s document (schema_version 1)."""
        doc: dict[str, Any] = {
            "schema_version": self.schema_version,
            "job": self.job,
            "run_id": self.run_id,
            "backend": self.backend,
            "status": self.status.value,
            "world_size": self.world_size,
            "world_sizes": list(self.world_sizes),
            "spec_hash": self.spec_hash,
            "spec": dict(self.spec),
            "params": dict(self.params),
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "wall_s": self.wall_s,
            "phases": dict(self.phases) if self.launcher_cpu is None else {**self.phases, "launcher_cpu_s": dict(self.launcher_cpu)},
            "restarts": self.restarts,
            "stages": [s.to_dict() for s in self.stages],
            "ranks": [dict(r) for r in self.ranks],
            "failure": self.failure.to_dict() if self.failure else None,
            "summary": dict(self.summary),
        }
        if "scaling" in self.summary:
            doc["scaling"] = self.summary["scaling"]
        if self.run_dir is not None:
            doc["run_dir"] = self.run_dir
        if self.preflight is not None:
            doc["preflight"] = self.preflight.to_dict()
        if self.skipped_worlds:
            doc["skipped_worlds"] = [s.to_dict() for s in self.skipped_worlds]
        if self.parts:
            doc["parts"] = [dict(p) for p in self.parts]
            doc["gaps_s"] = round(sum(float(p.get("gap_s") or 0.0) for p in self.parts), 4)
        optional = {"plots": list(self.plots), "plot_error": self.plot_error, "tensorboard": self.tensorboard,
                    "tensorboard_error": self.tensorboard_error}  # fmt: skip
        doc.update({k: v for k, v in optional.items() if v is not None})
        return doc
