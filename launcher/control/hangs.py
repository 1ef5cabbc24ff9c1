"""A hung stage: noticed from the live stream, explained from every rank's evidence.

Pure, like the straggler watch: ``StallWatch`` reads the progress the run loop has (every rank's
latest beacon, from its engine's channel) and says when the stage stalled; ``diagnose`` turns the
evidence gathered from every rank's host (``launcher.evidence``) into a ``HangDiagnosis``: the ranks
grouped by where they are, the odd ones out named first.

The rule (``timeouts.hang_s``, H): once the stage has counted steps, a rank in its job that has
not advanced its step count for H since it entered it is *still*; the stage is hung when every
running rank is still (a collective waits for a rank that never comes), when a still rank is
behind ranks that advance (one part of the world left behind), or when a rank sent no beacon for
H (frozen: SIGSTOP, a hung host; in any phase, as a rank frozen before its last beacons left
shows an earlier one). While a rank is still starting and alive, nothing is judged (a slow
import is the rendezvous timeout's case). Not a hang: a pause shorter than H, slow steps, a long
first step (nothing counted yet), a rank that finished early, or waits for the rest (it is
ahead, not behind), a job that counts no steps and trains no DDP model (not covered, see docs/fault-tolerance.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from launcher.evidence import CollectiveCall, RankEvidence, StackFrame, is_job_code
from launcher.policies import HangPolicy
from launcher.records import HangCulprit, HangDiagnosis, HangGroup
from launcher.stage.plan import RankSlot
from launcher.stage.watch import StageProgress


STARTING_UP = ("spawning", "starting", "importing", "rendezvous", "pg_init")


@dataclass(slots=True)
class StalledRank:
    rank: int
    host: str
    steps: int
    still_s: float  # since its step count last changed
    silent_s: float  # since its beacon last changed

    @property
    def frozen(self) -> bool:
        return self.silent_s >= self.still_s - 1.0  # it stopped talking when it stopped counting


@dataclass(frozen=True)
class Stall:
    """What the watch saw when it called the stage hung."""

    kind: str  # "all still", "behind", "silent"
    stalled_for_s: float
    ranks: tuple[StalledRank, ...]  # the still or silent ranks, the ones behind first
    elapsed_s: float  # seconds into the stage

    def describe(self) -> str:
        ranks = ", ".join(f"{r.rank} ({r.host}, step {r.steps})" for r in self.ranks[:8]) + (" ..." if len(self.ranks) > 8 else "")
        what = {"silent": "no sign of life", "behind": "no progress while the others advance"}.get(self.kind, "no rank advanced")
        return f"stalled: {what} for {self.stalled_for_s:.0f} s (ranks {ranks}); gathering every rank's stacks and collectives"


class StallWatch:
    """Fed the stage's progress at each reading; returns a ``Stall`` once the rule above holds."""

    def __init__(self, policy: HangPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.hang_s = policy.hang_s
        self._clock = clock
        # rank -> ((phase, steps), when either changed): a rank's stillness is counted from its
        # entering its job, never from its start-up (a slow import is not a stall)
        self._steps: dict[int, tuple[tuple[str, int], float]] = {}
        self._beacons: dict[int, tuple[float | None, float]] = {}  # rank -> (beacon time, when it changed)

    def update(self, progress: StageProgress) -> Stall | None:
        now = self._clock()
        for r in progress.ranks:
            if r.rank not in self._steps or self._steps[r.rank][0] != (r.phase, r.steps):
                self._steps[r.rank] = ((r.phase, r.steps), now)
            if self._beacons.get(r.rank, (None, 0.0))[0] != r.beacon_t or r.rank not in self._beacons:
                self._beacons[r.rank] = (r.beacon_t, now)
        if self.hang_s is None or progress.steps_max == 0:
            return None  # off, or nothing counted yet: a long first step is not a hang
        hang_s = self.hang_s
        # every rank that has said something and not ended; a starting rank counts only by its silence
        marks = {
            r.rank: StalledRank(r.rank, r.host, r.steps, now - self._steps[r.rank][1], now - self._beacons[r.rank][1])
            for r in progress.ranks
            if r.phase == "running" or (r.phase in STARTING_UP and r.beacon_t is not None)
        }
        starting = {r.rank for r in progress.ranks if r.phase in STARTING_UP}
        silent = [m for m in marks.values() if m.silent_s >= hang_s]
        if not silent and starting:
            return None  # a rank still starting and alive (a slow import, a late host): the rendezvous timeout's case
        running = [m for rank, m in marks.items() if rank not in starting]
        still = [m for m in running if m.still_s >= hang_s]
        moving = [m for m in running if m.still_s < hang_s]
        ahead = max((m.steps for m in moving), default=0)
        behind = [m for m in still if moving and m.steps < ahead]
        if silent:
            kind, stalled = "silent", silent
        elif still and not moving:
            kind, stalled = "all still", still
        elif behind:
            kind, stalled = "behind", behind
        else:
            return None
        stalled.sort(key=lambda m: (m.steps, m.rank))
        return Stall(kind, min(m.silent_s if kind == "silent" else m.still_s for m in stalled), tuple(stalled), progress.elapsed_s)


# ------------------------------------------------------------------------------------ diagnosis


def job_frame(evidence: RankEvidence) -> StackFrame | None:
    """The innermost frame of the job's own code in the rank's main thread (else its innermost)."""
    main = evidence.main_thread()
    if main is None or not main.frames:
        return None
    return next((f for f in main.frames if is_job_code(f.filename)), main.frames[0])


def _in_torch_call(evidence: RankEvidence) -> bool:
    """Whether the main thread is inside torch (a collective, DDP's backward) below the job's frame."""
    main = evidence.main_thread()
    if main is None:
        return False
    for frame in main.frames:  # innermost first
        if is_job_code(frame.filename):
            return False
        if "/torch/" in frame.filename:
            return True
    return False


def diagnose(stall: Stall, evidence: Sequence[RankEvidence], slots: Sequence[RankSlot], *, gather_s: float = 0.0, evidence_dir: str = "") -> HangDiagnosis:
    """Every rank grouped by where it is; the culprits (frozen, behind in the collective sequence,
    in another collective, or elsewhere than the rest) named first, in one line."""
    devices = {s.rank: s.device for s in slots}
    by_rank = {e.rank: e for e in evidence}
    seqs = [last.seq for e in evidence if (last := e.last_collective) is not None]
    top = max(seqs, default=None)
    majority = _majority_call(evidence, top)
    culprits = [found for e in sorted(evidence, key=lambda e: e.rank) if (found := _culprit(e, top, majority, devices.get(e.rank, "?"), stall)) is not None]
    if not culprits and majority is None:
        culprits = _disagreeing(evidence, top, devices)
    if not culprits:  # the evidence names nobody apart: the ranks the watch saw stop, by their place
        culprits = [_stalled_only(m, by_rank.get(m.rank), devices.get(m.rank, "?")) for m in stall.ranks if stall.kind != "all still"]
    groups = _groups(evidence, top, majority)
    return HangDiagnosis(_summary(culprits, groups, stall), stall.stalled_for_s, stall.elapsed_s, tuple(culprits), tuple(groups), evidence_dir, gather_s)


def _majority_call(evidence: Sequence[RankEvidence], seq: int | None) -> CollectiveCall | None:
    """The collective most ranks have as number ``seq`` (what the others wait in)."""
    calls = [c for e in evidence for c in e.collectives if c.seq == seq]
    if not calls:
        return None
    keys = [(c.op, c.sizes) for c in calls]
    counts = sorted((keys.count(k) for k in set(keys)), reverse=True)
    if len(counts) > 1 and counts[0] == counts[1]:
        return None  # no majority (two ranks, two collectives): the groups show both, nobody is singled out
    op, sizes = max(set(keys), key=keys.count)
    return next(c for c in calls if (c.op, c.sizes) == (op, sizes))


def _culprit(e: RankEvidence, top: int | None, majority: CollectiveCall | None, device: str, stall: Stall) -> HangCulprit | None:
    frame = job_frame(e)
    where, file, line = (frame.where(), frame.filename, frame.line) if frame else ("", "", 0)
    last = e.last_collective
    seq = last.seq if last else None
    if e.frozen:
        silent = next((m.silent_s for m in stall.ranks if m.rank == e.rank), stall.stalled_for_s)
        why = f"is frozen (its process is stopped; no sign of life for {silent:.0f} s)"
    elif e.process_state == "gone":
        why = "had ended while the others waited for it"
    elif majority is not None and e.recorder and (seq is None or seq < majority.seq):
        why = f"has not reached {majority.label()}" + (f" (its last was #{seq})" if seq is not None else "")
    elif majority is not None and last is not None and seq == majority.seq and (last.op, last.sizes) != (majority.op, majority.sizes):
        why = f"is in {last.op} {_shapes(last)} as #{seq} where the others are in {majority.op} {_shapes(majority)}"
    else:
        return None
    return HangCulprit(e.rank, e.host, device, why, where, file, line, seq)


def _disagreeing(evidence: Sequence[RankEvidence], top: int | None, devices: Mapping[int, str]) -> list[HangCulprit]:
    """Where no collective has a majority as number ``top`` (two ranks, two collectives: one
    skipped a call, but which one cannot be told from the calls alone), every rank in it is named
    with its own call and line beside the others': the user reads which one strayed."""
    calls = {e.rank: last for e in evidence if (last := e.last_collective) is not None and last.seq == top}
    kinds: dict[tuple[str, tuple[tuple[int, ...], ...]], list[int]] = {}
    for rank, call in sorted(calls.items()):
        kinds.setdefault((call.op, call.sizes), []).append(rank)
    if len(kinds) < 2:
        return []
    named = []
    for e in sorted((e for e in evidence if e.rank in calls), key=lambda e: e.rank):
        mine = calls[e.rank]
        others = "; ".join(f"{_ranks(ranks)} {'are' if len(ranks) > 1 else 'is'} in {calls[ranks[0]].op} {_shapes(calls[ranks[0]])}"
                           for key, ranks in kinds.items() if key != (mine.op, mine.sizes))  # fmt: skip
        frame = job_frame(e)
        where, file, line = (frame.where(), frame.filename, frame.line) if frame else ("", "", 0)
        named.append(HangCulprit(e.rank, e.host, devices.get(e.rank, "?"), f"is in {mine.op} {_shapes(mine)} as #{top} where {others}",
                                 where, file, line, top))  # fmt: skip
    return named


def _stalled_only(m: StalledRank, e: RankEvidence | None, device: str) -> HangCulprit:
    frame = job_frame(e) if e is not None else None
    why = f"made no progress for {m.still_s:.0f} s" + (" and sent no beacon" if m.silent_s >= m.still_s - 1 else "") + f" (at step {m.steps})"
    return HangCulprit(m.rank, m.host, device, why, frame.where() if frame else "", frame.filename if frame else "", frame.line if frame else 0)


def _groups(evidence: Sequence[RankEvidence], top: int | None, majority: CollectiveCall | None) -> list[HangGroup]:
    buckets: dict[tuple[str, str | None, str], list[int]] = {}
    for e in sorted(evidence, key=lambda e: e.rank):
        frame = job_frame(e)
        last = e.last_collective
        waiting = last is not None and last.seq == top and _in_torch_call(e) and not e.frozen
        state = e.process_state if e.process_state in ("stopped", "gone") else ""
        buckets.setdefault((frame.where() if frame else "(no stack)", last.label() if waiting and last else None, state), []).append(e.rank)
    groups = [HangGroup(tuple(ranks), where, collective, state) for (where, collective, state), ranks in buckets.items()]
    return sorted(groups, key=lambda g: (len(g.ranks), g.ranks))  # the odd ones out first


def _summary(culprits: Sequence[HangCulprit], groups: Sequence[HangGroup], stall: Stall) -> str:
    named = {c.rank for c in culprits}
    parts = [c.describe() + (f" (for {stall.stalled_for_s:.0f} s)" if i == 0 and "no sign of life" not in c.why else "") for i, c in enumerate(culprits[:3])]
    if len(culprits) > 3:
        parts.append(f"and {len(culprits) - 3} more ranks")
    for g in groups:
        rest = [r for r in g.ranks if r not in named]
        if rest and (g.collective or not parts):
            plural = len(rest) > 1
            verb = f"{'wait' if plural else 'waits'} in {g.collective} at" if g.collective else ("are" if plural else "is") + " at"
            parts.append(f"{_ranks(rest)} {verb} {g.where}")
    if not culprits:
        parts.insert(0, f"no rank stands out: all stalled for {stall.stalled_for_s:.0f} s")
    return "; ".join(parts)


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0-2,5``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][-1] + 1:
            spans[-1].append(r)
        else:
            spans.append([r])
    text = ",".join(f"{s[0]}" if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _shapes(call: CollectiveCall) -> str:
    return "[" + ", ".join("x".join(map(str, s)) or "scalar" for s in call.sizes) + "]"


def stacks_text(evidence: Sequence[RankEvidence]) -> str:
    """Every rank's threads and last collectives as a person reads them (``hang/stacks.txt``)."""
    out = []
    for e in sorted(evidence, key=lambda e: e.rank):
        out.append(f"rank {e.rank} on {e.host}: pid {e.pid}, {e.process_state}, stacks from {e.stack_source}" + (f" ({e.note})" if e.note else ""))
        if e.collectives:
            out.append("  last collectives: " + ", ".join(f"{c.label()} {_shapes(c)}" for c in e.collectives))
        elif e.recorder:
            out.append("  last collectives: none yet")
        for t in e.threads:
            out.append(f'  thread "{t.name}"' + (" (the rank's)" if t is e.main_thread() else ""))
            out.extend(f"    {f.function} ({f.filename}:{f.line})" + (f"  {f.code}" if f.code else "") for f in t.frames)
        out.append("")
    return "\n".join(out)
