"""Stragglers named while they happen, from the own-work figures the ranks' beacons carry.

In synchronous DDP every rank steps at the pace of the slowest, so step rates cannot tell who
holds the others up; each rank's own work per step (``launcher.runtime.workclock``: compute apart
from the wait in collectives) can. A rank is flagged when its own work stays above ``factor`` times
the median of its peers' for ``hold_s`` seconds in a row, and cleared when it falls back under
that line. Host numbers from the ranks' beacons: nothing here reaches a rank or a device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

from launcher.policies import StragglerPolicy
from launcher.records import Straggler

if TYPE_CHECKING:
    from launcher.stage.plan import RankSlot
    from launcher.stage.watch import RankLive, StageProgress


@dataclass(frozen=True)
class StragglerChange:
    """A flag that went up (``cleared`` False) or came down, for the console and the logs."""

    straggler: Straggler
    cleared: bool

    def describe(self) -> str:
        s = self.straggler
        if self.cleared:
            held = (s.cleared_after_s or s.flagged_after_s) - s.flagged_after_s
            return f"rank {s.rank} on {s.host} ({s.device}) caught up after {held:.1f} s as a straggler"
        return s.describe()


class StragglerWatch:
    """Fed every progress reading of one stage attempt; keeps what it flagged."""

    def __init__(self, policy: StragglerPolicy) -> None:
        self.policy = policy
        self._above_since: dict[int, float] = {}  # rank -> elapsed_s when it went above the line
        self._open: dict[int, Straggler] = {}  # flagged now
        self.flagged: list[Straggler] = []  # every flag of this attempt, in order

    def update(self, progress: StageProgress, slots: Sequence[RankSlot]) -> tuple[StageProgress, list[StragglerChange]]:
        """The reading with each rank's straggler flag set, and the flags that changed. ``slots``:
        the plan's ranks (where a flagged rank runs, as the plan has it now)."""
        live = {r.rank: r for r in progress.ranks if r.work_s is not None and r.phase == "running" and self._warm(r)}
        for rank in set(self._above_since) - set(live):  # no figure now: its time above the line starts again
            del self._above_since[rank]
        changes = []
        by_rank = {s.rank: s for s in slots}
        for rank, peers_median in peer_medians({k: r.work_s for k, r in live.items() if r.work_s is not None}).items():
            r = live[rank]
            assert r.work_s is not None
            slot = by_rank.get(rank)
            change = self._judge(r, slot.device if slot else "?", r.work_s, peers_median, progress.elapsed_s)
            if change is not None:
                changes.append(change)
        ranks = tuple(_flag(r, r.rank in self._open) for r in progress.ranks)
        return replace(progress, ranks=ranks), changes

    def _warm(self, live: RankLive) -> bool:
        """Whether the rank's figure covers enough steps to be judged (a beacon that does not say: yes)."""
        return live.work_n is None or live.work_n >= self.policy.WARM_STEPS

    def _judge(self, live: RankLive, device: str, own: float, median: float, now: float) -> StragglerChange | None:
        rank = live.rank
        noise = self.policy.NOISE_K * (live.work_mad_s or 0.0)
        line = max(self.policy.factor * median, median + self.policy.MIN_EXCESS_S, median + noise)
        flagged = self._open.get(rank)
        if own <= line:
            self._above_since.pop(rank, None)
            if flagged is None:
                return None
            del self._open[rank]
            flagged.cleared_after_s = now
            return StragglerChange(flagged, cleared=True)
        since = self._above_since.setdefault(rank, now)
        if flagged is not None:
            flagged.peak_ratio = max(flagged.peak_ratio, own / median if median > 0 else 0.0)
            return None
        if now - since < self.policy.hold_s:
            return None
        straggler = Straggler(rank, live.host, device, own, median, flagged_after_s=now)
        straggler.peak_ratio = straggler.ratio
        self._open[rank] = straggler
        self.flagged.append(straggler)
        return StragglerChange(straggler, cleared=False)


def peer_medians(work: dict[int, float]) -> dict[int, float]:
    """Each rank's peers' median (every figure but its own): one sort for all, not one per rank,
    so a reading of a thousand ranks costs a millisecond, not a second."""
    order = sorted(work, key=work.__getitem__)
    values = [work[k] for k in order]
    n = len(values)
    if n < 2:
        return {}
    out = {}
    for i, rank in enumerate(order):
        out[rank] = _median_without(values, i)
    return out


def _median_without(values: list[float], skip: int) -> float:
    """The median of sorted ``values`` with the one at index ``skip`` left out."""
    m = len(values) - 1  # how many remain

    def at(j: int) -> float:  # the j-th of the remaining values
        return values[j if j < skip else j + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def _flag(rank: RankLive, straggler: bool) -> RankLive:
    return rank if rank.straggler == straggler else replace(rank, straggler=straggler)
