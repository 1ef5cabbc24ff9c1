"""Stage outcomes in, the run's typed record out: pure, no I/O, no user code.

The record (``results.record.RunRecord``, frozen) is what ``result.json`` holds once serialised
(``schema_version`` 1): the stages with their start-up phases, every rank's report with its
timeline, the failure if any. The job's own summary and plots are added afterwards
(``results.hooks``), and so is the default summary of its logged series, each by a new record.
"""

from __future__ import annotations

import time
from statistics import median
from typing import Any, Mapping, Sequence

from launcher.protocol import RankReport
from launcher.records import Failure, RunStatus, StageOutcome
from launcher.results.record import RunRecord, StageRecord

PHASES = ("spawn", "import", "rendezvous", "pg_init", "run")
# each phase ends at a rank's stamp: spawned (the process exists), imported (torch and the job's
# code), joined (every rank reached the rendezvous), pg_ready (process group up), finished
_PHASE_ENDS = tuple(zip(PHASES, ("spawned", "imported", "joined", "pg_ready", "finished")))
_ENTRYPOINT_ONLY = ("rendezvous", "pg_init")
# a beacon's phase (launcher.protocol.RankProgress.phase) -> the stage's phase a rank is in then
_BEACON_PHASES = {"spawning": "spawn", "starting": "import", "importing": "import", "rendezvous": "rendezvous",
                  "pg_init": "pg_init", "running": "run"}  # fmt: skip


def stage_phases(
    started_at: float, reports: Sequence[RankReport], *, script: bool = False, ended_at: float | None = None
) -> dict[str, float | None]:
    """Where a stage's start-up time went, from the slowest rank at each step (seconds). A phase
    no rank finished is where the ranks stopped (a rendezvous that timed out): it runs to the
    end and the phases after it are None. The end is the last rank's ``finished`` stamp, or, where
    every rank was stopped before it wrote one (Ctrl-C, a lost host), ``ended_at``: the stage's
    end, so an interrupted stage's ``run`` lasts until the stop. A script joins the group inside
    its own run, so its rendezvous and pg_init are None too."""

    def latest(name: str) -> float | None:
        stamps = [r.phases[name] for r in reports if name in r.phases]
        return max(stamps) if stamps else None

    out: dict[str, float | None] = {}
    prev: float | None = started_at
    stopped = False
    for phase, stamp in _PHASE_ENDS:
        if stopped or (script and phase in _ENTRYPOINT_ONLY):
            out[phase] = None
            continue
        end = latest(stamp)
        if end is None:
            end, stopped = latest("finished"), True
            if end is None and ended_at is not None and prev is not None and _stopped_in(reports) == phase:
                end = max(prev, ended_at)  # the ranks were stopped in this phase: it ran until the stage ended
        out[phase] = None if end is None or prev is None else round(max(0.0, end - prev), 4)
        prev = end
    first = [r.phases["first_step"] for r in reports if "first_step" in r.phases]
    out["to_first_step"] = round(max(first) - started_at, 4) if first else None
    return out


def _stopped_in(reports: Sequence[RankReport]) -> str | None:
    """The phase the slowest rank was in when it was stopped, as its last beacon said (None where
    a rank's last phase is not known)."""
    known = [_BEACON_PHASES[r.last_phase] for r in reports if r.last_phase in _BEACON_PHASES]
    return min(known, key=PHASES.index) if known and len(known) == len(reports) else None


def _rank_entry(report: RankReport, started_at: float) -> dict[str, Any]:
    entry = report.to_dict()
    entry["timeline_s"] = {k: round(v - started_at, 4) for k, v in report.phases.items()}
    return entry


def _stage_record(stage: StageOutcome) -> StageRecord:
    return StageRecord(
        world_size=stage.world_size,
        status=stage.status,
        restarts=stage.restarts,
        wall_s=round(stage.ended_at - stage.started_at, 4),
        phases=stage_phases(stage.started_at, stage.reports, script=stage.script, ended_at=stage.ended_at),
        failure=stage.failure,
        stragglers=tuple(stage.stragglers),
        load_avg=dict(stage.load_avg),
        attempts=tuple(stage.attempts),
    )


def run_status(stages: Sequence[StageOutcome]) -> RunStatus:
    failed = next((s for s in stages if not s.ok), None)
    if failed is not None:
        return failed.status
    return RunStatus.SUCCEEDED if stages else RunStatus.FAILED


def aggregate(
    stages: Sequence[StageOutcome],
    *,
    job: str,
    run_id: str,
    backend: str,
    spec: Mapping[str, Any],
    spec_hash: str,
    params: Mapping[str, Any],
    started_at: float,
    finished_at: float | None = None,
    cut_short: Failure | None = None,
) -> RunRecord:
    """The run's record (without the job's summary, its plots and the aggregate phase).
    ``cut_short``: why the run ended before its stages did (a stage could not start, a stop came
    between stages): its status and failure then, the stages that finished kept."""
    records = tuple(_stage_record(s) for s in stages)
    ranks = tuple(_rank_entry(r, s.started_at) for s in stages for r in s.reports)
    failed = next((s for s in stages if not s.ok), None)
    finished_at = time.time() if finished_at is None else finished_at
    totals = {p: round(sum(s.phases[p] or 0.0 for s in records), 4) for p in PHASES}
    status = run_status(stages) if cut_short is None else cut_short.reason.status
    failure = cut_short if cut_short is not None else (failed.failure if failed else None)
    return RunRecord(
        job=job, run_id=run_id, backend=backend, status=status, spec_hash=spec_hash, spec=dict(spec), params=dict(params),
        started_at=started_at, finished_at=finished_at, phases=totals, stages=records, ranks=ranks, failure=failure,
        summary={"steps_per_rank": steps_per_rank(ranks)},
    )  # fmt: skip


def steps_per_rank(ranks: Sequence[Mapping[str, Any]]) -> float | None:
    steps = [r.get("metrics", {}).get("steps") for r in ranks if r.get("metrics")]
    steps = [s for s in steps if isinstance(s, int)]
    return median(steps) if steps else None
