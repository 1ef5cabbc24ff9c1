"""What the run loop knows of a stage's ranks, built from their events alone.

Fed every event the stage's channel delivers (``launcher.stage.events``); asked for the errors so
far (fail fast), the live progress (console, ``/metrics``, stragglers) and, at the end, every
rank's report: its own, or for a rank that wrote none, one saying it was stopped (with the phases
its beacons showed) or lost with its host. Never reads a file.

Each rank's step count is exact at the end: a rank that reports gives its own; one that ended in
silence, its last beacon, which its host rewrote from the rank's step counter once the rank was
gone (``launcher.runtime.stepcount``). A rank lost with its host has neither: the furthest
surviving rank's count stands in (DDP ranks step in lockstep). A report the rank did not write
itself carries that count as ``metrics.steps``, and where it came from as ``metrics.steps_from``
(``beacon`` or ``peers``).
"""

from __future__ import annotations

import operator
import time
from dataclasses import replace
from typing import Any, Iterable, Mapping

from launcher.masking import redact_document
from launcher.protocol import HOST_LOST, NODE_LOST, RankError, RankProgress, RankReport, RankStatus
from launcher.records import RankExit
from launcher.stage.events import RankBeacon, RankExited, RankReported, RanksLost, StageEvent
from launcher.stage.plan import RankSlot, StagePlan
from launcher.stage.watch import RankLive, StageProgress, count_phases

# A beacon's phase, and the report's stamp that its start marks: a rank that reports "rendezvous"
# has imported its code, "pg_init" has joined the group, "running" has it initialised. A script
# goes from "importing" straight to "running" (it joins the group inside its own run).
_PHASE_STAMPS = (("rendezvous", "imported"), ("pg_init", "joined"), ("running", "pg_ready"))
_SCRIPT_STAMPS = (("running", "imported"),)
_PHASE_ORDER = ("spawning", "starting", "importing", "rendezvous", "pg_init", "running", "finished", "failed")
_FINAL = (RankStatus.OK, RankStatus.FAILED)
_STICKY = ("ckpt_step", "ckpt_at", "resumed_step", "watches_stop")
_sticky_of = operator.attrgetter(*_STICKY)  # one C call per beacon: most ranks say none of them
_NONE_STICKY = (None,) * len(_STICKY)
_NO_BEACON = RankProgress()
_LOST = (HOST_LOST, NODE_LOST)  # a RanksLost report's error types


class StageState:
    def __init__(self, plan: StagePlan, started_at: float, restarts: int = 0) -> None:
        self._plan = plan
        self._slots = {s.rank: s for s in plan.ranks}
        self.started_at = started_at
        self.restarts = restarts
        self.beacons: dict[int, RankProgress] = {}
        self.hosts: dict[int, str] = {}  # rank -> host, where an event said (a scheduler placed it)
        self.reports: dict[int, RankReport] = {}
        self._errors: dict[int, RankError] = {}  # the failed reports' errors, kept as they come
        self.exits: list[RankExit] = []
        self._stamps: dict[int, dict[str, float]] = {}

    @property
    def plan(self) -> StagePlan:
        return self._plan

    @plan.setter
    def plan(self, plan: StagePlan) -> None:
        """The engine's plan now (one that placed its ranks itself has replaced it)."""
        if plan is not self._plan:
            self._plan, self._slots = plan, {s.rank: s for s in plan.ranks}

    def apply(self, events: Iterable[StageEvent]) -> None:
        for event in events:
            if isinstance(event, RankBeacon):
                self._beacon(event)
            elif isinstance(event, RankReported):
                self._report(event.report)
            elif isinstance(event, RankExited):
                self.exits.append(event.exit)
            elif isinstance(event, RanksLost):
                self._lost(event)

    def _beacon(self, event: RankBeacon) -> None:
        # once per beacon of every rank (2,048 a second at 1,024 ranks): the common case is cheap
        old = self.beacons.get(event.rank)
        beacon = event.beacon
        if old is not None:
            if old.t is not None and beacon.t is not None and beacon.t < old.t:
                return  # an older beacon, late (delivered twice: live, and again at the end)
            kept: dict[str, Any] = {}
            if _sticky_of(old) != _NONE_STICKY:  # what a rank said of its checkpoints stays said (a last beacon made elsewhere lacks it)
                kept = {k: getattr(old, k) for k in _STICKY if getattr(beacon, k) is None and getattr(old, k) is not None}
            if old.steps > beacon.steps and (beacon.t is None or old.t is None or beacon.t <= old.t):
                kept["steps"] = old.steps  # the same beacon again (read back at the end) lags the exact count the report gave
            if kept:
                beacon = replace(beacon, **kept)
        self.beacons[event.rank] = beacon
        if event.host:
            self.hosts[event.rank] = event.host
        if old is None or old.phase != beacon.phase:  # a phase's stamp is its first beacon's time
            self._stamp(event.rank, beacon)
        if beacon.phases:  # the rank's own stamps, exact: they win over the times beacons were first seen
            self._stamps.setdefault(event.rank, {}).update(beacon.phases)

    def _stamp(self, rank: int, beacon: RankProgress) -> None:
        """The report stamps the beacon's phase implies, at the beacon's own time (first seen)."""
        if beacon.t is None or beacon.phase not in _PHASE_ORDER:
            return
        stamps = self._stamps.setdefault(rank, {})
        if "started" not in stamps:
            if beacon.phase not in ("starting", "importing"):
                return  # first seen later in its life: earlier phases cannot be dated
            stamps["started"] = stamps["spawned"] = beacon.t
        table = _SCRIPT_STAMPS if self.plan.script_mode else _PHASE_STAMPS
        for phase, stamp in table:
            if _PHASE_ORDER.index(beacon.phase) >= _PHASE_ORDER.index(phase):
                stamps.setdefault(stamp, beacon.t)

    def note_phases(self, rank: int, stamps: Mapping[str, float]) -> None:
        """Phase stamps the rank itself gave (in a hung stage's evidence), for the report it will
        not write: exact where the beacons' are the time a phase was first seen, and there where
        a phase passed between two beacons."""
        self._stamps.setdefault(rank, {}).update(stamps)

    def _report(self, report: RankReport) -> None:
        known = self.reports.get(report.rank)
        if known is not None and known.status in _FINAL and report.status not in _FINAL:
            return  # a "stopped" written by a host's wrapper never hides what the rank said itself
        self.reports[report.rank] = report
        steps = report.metrics.get("steps") if isinstance(report.metrics, Mapping) else None
        beacon = self.beacons.get(report.rank)
        if isinstance(steps, int) and not isinstance(steps, bool) and beacon is not None and steps > beacon.steps:
            # the rank's own count at its end is exact; its last beacon, written up to half a second
            # before, may lag: how far the attempt got (and the steps a restart does again) is the report's
            self.beacons[report.rank] = replace(beacon, steps=steps)
        if report.status == RankStatus.FAILED and report.error is not None:
            self._errors[report.rank] = report.error
        else:
            self._errors.pop(report.rank, None)

    def _lost(self, event: RanksLost) -> None:
        for rank in event.ranks:
            known = self.reports.get(rank)
            if known is not None and known.status in _FINAL:
                continue  # it finished (or failed on its own) before its host went
            slot = self._slot(rank)
            beacon = self.beacons.get(rank)
            at = event.at if event.at is not None else (beacon.t if beacon and beacon.t is not None else time.time())
            self._report(RankReport(
                rank=rank, local_rank=slot.local_rank, node_rank=slot.node_rank, world_size=self.plan.world_size,
                host=event.host, device=slot.device, status=RankStatus.FAILED, phases=dict(self._stamps.get(rank, {})),
                error=RankError(event.error_type, event.message, event.traceback, at), last_phase=beacon.phase if beacon else None,
            ))  # fmt: skip

    def _slot(self, rank: int) -> RankSlot:
        return self._slots[rank]

    # --- what the run loop asks -------------------------------------------------------------------

    def errors(self) -> list[RankError]:
        """The errors of the ranks that have reported a failure so far."""
        return list(self._errors.values())

    def rank_exits(self) -> tuple[RankExit, ...]:
        """The ranks that failed on their own first; those their agent stopped, after."""
        return tuple(sorted(self.exits, key=lambda e: e.collateral))

    def host_of(self, rank: int) -> str:
        return self.hosts.get(rank) or self._slot(rank).host

    def progress(self, now: float | None = None) -> StageProgress:
        # every rank, twice a second: positional fields and no method call per rank
        beacons, hosts = self.beacons, self.hosts
        ranks = []
        for slot in self.plan.ranks:
            rank = slot.rank
            b = beacons.get(rank, _NO_BEACON)
            ranks.append(RankLive(rank, hosts.get(rank) or slot.host, b.phase, b.steps, b.t, b.work_s, False, b.work_mad_s, b.work_n))
        live = tuple(ranks)
        elapsed = (now or time.time()) - self.started_at
        resumed = [b.resumed_step for b in beacons.values() if b.resumed_step is not None]
        return StageProgress(self.plan.world_size, elapsed, live, self.restarts, count_phases(live), max(resumed) if resumed else None)

    def final_reports(self, secrets: tuple[str, ...] = ()) -> list[RankReport]:
        """Every rank's report, secrets masked; a rank that wrote none is ``stopped``, with the
        phase its last beacon showed and the phases its beacons dated."""
        out = []
        for slot in self.plan.ranks:
            report = self.reports.get(slot.rank)
            if report is None:
                beacon = self.beacons.get(slot.rank) or RankProgress()
                report = RankReport(
                    rank=slot.rank, local_rank=slot.local_rank, node_rank=slot.node_rank, world_size=self.plan.world_size,
                    host=self.host_of(slot.rank), device=slot.device, status=RankStatus.STOPPED,
                    phases=dict(self._stamps.get(slot.rank, {})), last_phase=beacon.phase,
                )  # fmt: skip
            elif report.status == RankStatus.STOPPED and not report.phases and self._stamps.get(slot.rank):
                report = replace(report, phases=dict(self._stamps[slot.rank]))
            out.append(_masked(self._with_steps(report), secrets))
        return out

    def _with_steps(self, report: RankReport) -> RankReport:
        """A report the rank did not write (its metrics have no step count) with the rank's count:
        its last beacon's, exact once its host settled it from the rank's step counter; for a rank
        lost with its host, the furthest surviving rank's (lockstep), said as ``steps_from``."""
        metrics = report.metrics if isinstance(report.metrics, Mapping) else {}
        if isinstance(metrics.get("steps"), int):
            return report
        lost = report.error is not None and report.error.type in _LOST
        survivors = [b.steps for rank, b in self.beacons.items() if not self._lost_with_host(rank)] if lost else []
        beacon = self.beacons.get(report.rank)
        if survivors:
            steps, source = max(survivors), "peers"
        elif beacon is not None:
            steps, source = beacon.steps, "beacon"
        else:
            return report  # never heard of: no count to give
        return replace(report, metrics={**metrics, "steps": steps, "steps_from": source})

    def _lost_with_host(self, rank: int) -> bool:
        report = self.reports.get(rank)
        return report is not None and report.error is not None and report.error.type in _LOST


def _masked(report: RankReport, secrets: tuple[str, ...]) -> RankReport:
    if not secrets:
        return report
    data = report.to_dict()
    masked = redact_document(data, secrets)
    return report if masked is data else RankReport.from_dict(masked)
