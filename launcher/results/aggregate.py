"""Stage outcomes in, the run's typed record out: pure, no I/O, no user code.

The record (``results.record.RunRecord``, frozen) is what ``result.json`` holds once serialised
(``schema_version`` 1): the stages with their start-up phases, every rank's report with its
timeline, the failure if any. The job's own summary and plots are added afterwards
(``results.hooks``), and so is the default summary of its logged series, each by a new record.
"""

from __future__ import annotations

import time
from dataclasses import fields, replace
from statistics import median
from typing import Any, Mapping, Sequence

from launcher.protocol import RankReport
from launcher.policies import FailureClass
from launcher.records import AttemptRecord, Failure, Recovery, RunStatus, StageOutcome, Straggler
from launcher.results.run_record import RunRecord, StageRecord

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
    end and the phases after it are None (a rank that replaced a lost one in place, stamped
    ``replaced``, counts for the end alone). The end is the last rank's ``finished`` stamp, or, where
    every rank was stopped before it wrote one (Ctrl-C, a lost host), ``ended_at``: the stage's
    end, so an interrupted stage's ``run`` lasts until the stop. A script joins the group inside
    its own run, so its rendezvous and pg_init are None too."""

    def latest(name: str) -> float | None:
        # a rank that replaced a lost one in place (its "replaced" stamp) started later on its own:
        # the stage's start-up is its first ranks', the end is every rank's
        stamps = [r.phases[name] for r in reports if name in r.phases and (name == "finished" or "replaced" not in r.phases)]
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
    first = [r.phases["first_step"] for r in reports if "first_step" in r.phases and "replaced" not in r.phases]
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


def _attempt_start(stage: StageOutcome) -> float:
    """When the attempt whose ranks' reports the stage holds (its last) started: its phases and
    its ranks' timelines count from there, not from the stage's first start."""
    return stage.attempts[-1].started_at if stage.attempts else stage.started_at


def _stage_record(stage: StageOutcome, before: Mapping[str, Any] | None = None) -> StageRecord:
    """The stage's record; ``before``: the same stage in the run's previous record (``launch
    resume``), whose attempts come first, whose wall time and restarts add up with these."""
    earlier = tuple(attempt_from_doc(a) for a in (before or {}).get("attempts") or ())
    attempts = earlier + tuple(replace(a, attempt=a.attempt + len(earlier)) for a in stage.attempts)
    wall = stage.ended_at - stage.started_at + _number((before or {}).get("wall_s"))
    return StageRecord(
        world_size=stage.world_size,
        status=stage.status,
        restarts=stage.restarts + int(_number((before or {}).get("restarts"))),
        wall_s=round(wall, 4),
        phases=stage_phases(_attempt_start(stage), stage.reports, script=stage.script, ended_at=stage.ended_at),
        failure=stage.failure,
        stragglers=tuple(_stragglers((before or {}).get("stragglers"))) + tuple(stage.stragglers),
        load_avg=dict(stage.load_avg),
        attempts=attempts,
        recoveries=_recoveries((before or {}).get("recoveries"), [(r.metrics or {}).get("in_place") for r in stage.reports]),
    )


def _recoveries(earlier: Any, reported: Sequence[Any]) -> tuple[Recovery, ...]:
    """The stage's recoveries in place, once each (every rank's report carries the node's records),
    after those of a run's earlier launch (``launch resume``)."""
    found: dict[tuple[int, int], Recovery] = {}
    for records in reported:
        for doc in records if isinstance(records, list) else ():
            if isinstance(doc, Mapping):
                recovery = Recovery.from_dict(doc)
                found.setdefault((recovery.attempt, recovery.gen), recovery)
    before = tuple(Recovery.from_dict(d) for d in earlier or () if isinstance(d, Mapping))
    return before + tuple(found[key] for key in sorted(found))


def _kept_stage(doc: Mapping[str, Any]) -> StageRecord:
    """A stage that had succeeded before a ``launch resume`` (not run again), as it was recorded."""
    load = doc.get("load_avg") or {}
    return StageRecord(
        world_size=int(doc["world_size"]),
        status=RunStatus(doc["status"]),
        restarts=int(_number(doc.get("restarts"))),
        wall_s=_number(doc.get("wall_s")),
        phases=dict(doc.get("phases") or {}),
        stragglers=tuple(_stragglers(doc.get("stragglers"))),
        load_avg={str(k): (float(v[0]), float(v[1]), float(v[2])) for k, v in load.items()},
        attempts=tuple(attempt_from_doc(a) for a in doc.get("attempts") or ()),
        recoveries=tuple(Recovery.from_dict(d) for d in doc.get("recoveries") or () if isinstance(d, Mapping)),
    )


def _is_kept(stage: StageOutcome, before: Mapping[str, Any] | None) -> bool:
    """A stage ``launch resume`` kept: it succeeded in the previous record and did not run now
    (every stage the run loop ran has its attempts)."""
    return before is not None and before.get("status") == RunStatus.SUCCEEDED.value and stage.ok and not stage.attempts


def attempt_from_doc(doc: Mapping[str, Any]) -> AttemptRecord:
    """An attempt as ``result.json`` holds it, typed again."""
    known = {f.name for f in fields(AttemptRecord)}
    values = {k: v for k, v in doc.items() if k in known}
    values["status"] = RunStatus(values.get("status", RunStatus.FAILED.value))
    values["failure_class"] = FailureClass(values["failure_class"]) if values.get("failure_class") else None
    values.setdefault("started_at", 0.0)
    values.setdefault("ended_at", values["started_at"])
    values.setdefault("attempt", 0)
    return AttemptRecord(**values)


def _stragglers(docs: Any) -> list[Straggler]:
    known = {f.name for f in fields(Straggler)}
    out = []
    for doc in docs or ():
        values = {k: v for k, v in doc.items() if k in known}
        values["peak_ratio"] = values.get("peak_ratio") or 0.0
        out.append(Straggler(**values))
    return out


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


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
    previous: Mapping[str, Any] | None = None,
) -> RunRecord:
    """The run's record (without the job's summary, its plots and the aggregate phase).
    ``cut_short``: why the run ended before its stages did (a stage could not start, a stop came
    between stages): its status and failure then, the stages that finished kept.

    ``previous``: the run's last complete record (``result.json``, when ``launch resume`` goes on
    with it): nothing of it is lost. A stage it had finished is kept as it was (its ranks too); a
    stage run again keeps its earlier attempts before the new ones; the run's start is the first
    launch's, its ``parts`` every launch (start, end, wall time, status, the gap before it), its
    wall time theirs summed, the gaps not counted, and its steps per rank every attempt's."""
    previous = previous if previous and previous.get("run_id") == run_id and previous.get("stages") is not None else None
    before = {int(s["world_size"]): s for s in (previous or {}).get("stages") or ()}
    records = tuple(
        _kept_stage(before[s.world_size]) if _is_kept(s, before.get(s.world_size)) else _stage_record(s, before.get(s.world_size))
        for s in stages
    )
    kept = {s.world_size for s in stages if _is_kept(s, before.get(s.world_size))}
    old_ranks = [r for r in (previous or {}).get("ranks") or () if r.get("world_size") in kept]
    ranks = tuple(
        r for s in stages
        for r in ([x for x in old_ranks if x.get("world_size") == s.world_size] if s.world_size in kept
                  else [_rank_entry(x, _attempt_start(s)) for x in s.reports])
    )  # fmt: skip
    failed = next((s for s in stages if not s.ok), None)
    finished_at = time.time() if finished_at is None else finished_at
    totals = {p: round(sum(s.phases[p] or 0.0 for s in records if s.world_size not in kept), 4) for p in PHASES}
    status = run_status(stages) if cut_short is None else cut_short.reason.status
    failure = cut_short if cut_short is not None else (failed.failure if failed else None)
    parts = run_parts(previous, started_at, finished_at, status)
    return RunRecord(
        job=job, run_id=run_id, backend=backend, status=status, spec_hash=spec_hash, spec=dict(spec), params=dict(params),
        started_at=parts[0]["started_at"] if parts else started_at, finished_at=finished_at, phases=totals, stages=records,
        ranks=ranks, failure=failure, summary={"steps_per_rank": steps_per_rank(ranks, records)}, parts=parts,
    )  # fmt: skip


def run_parts(previous: Mapping[str, Any] | None, started_at: float, finished_at: float, status: RunStatus) -> tuple[dict[str, Any], ...]:
    """Every launch of a run that ``launch resume`` went on with, oldest first (none for a run
    launched once): when each started and ended, its wall time, how it ended, and the time
    between the one before it and it (``gap_s``: not the run's, nothing of it ran)."""
    if previous is None:
        return ()
    earlier: list[dict[str, Any]] = [dict(p) for p in previous.get("parts") or ()]
    if not earlier:  # a record of a run launched once: its one part is the whole record
        start = _number(previous.get("started_at"))
        end = _number(previous.get("finished_at")) or start
        earlier = [{"started_at": start, "finished_at": end, "wall_s": round(_number(previous.get("wall_s")) or end - start, 4),
                    "status": previous.get("status"), "gap_s": None}]  # fmt: skip
    gap = round(max(0.0, started_at - _number(earlier[-1].get("finished_at"))), 4)
    now = {"started_at": started_at, "finished_at": finished_at, "wall_s": round(finished_at - started_at, 4), "status": status.value, "gap_s": gap}
    return (*earlier, now)


def steps_per_rank(ranks: Sequence[Mapping[str, Any]], stages: Sequence[StageRecord] = ()) -> float | None:
    """The median rank's steps over the whole run: its own count in the attempt that wrote its
    report, plus the steps of its stage's earlier attempts (restarts, a run resumed)."""
    earlier = {s.world_size: sum(a.steps for a in s.attempts[:-1]) for s in stages}
    steps = [(r.get("metrics") or {}).get("steps") for r in ranks if r.get("metrics")]
    counted = [s + earlier.get(r.get("world_size", 0), 0) for s, r in zip(steps, (r for r in ranks if r.get("metrics"))) if isinstance(s, int)]
    return median(counted) if counted else None
