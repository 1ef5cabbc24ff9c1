"""Stragglers named while they happen, from the own-work figures the ranks' beacons carry.

In synchronous DDP every rank steps at the pace of the slowest, so step rates cannot tell who
holds the others up; each rank's own work per step (``launcher.runtime.workclock``: compute apart
from the wait in collectives) can. A rank is flagged when its own work stays above ``factor`` times
the median of its peers' for ``hold_s`` seconds in a row, and cleared when it falls back under
that line. Host numbers read from files: nothing here reaches a rank or a device.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from launcher.records import Straggler, StragglerPolicy

if TYPE_CHECKING:
    from launcher.control.events import RankLive, StageProgress
    from launcher.control.planning import RankSlot


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

    def __init__(self, slots: tuple[RankSlot, ...], policy: StragglerPolicy) -> None:
        self.slots = {s.rank: s for s in slots}
        self.policy = policy
        self._above_since: dict[int, float] = {}  # rank -> elapsed_s when it went above the line
        self._open: dict[int, Straggler] = {}  # flagged now
        self.flagged: list[Straggler] = []  # every flag of this attempt, in order

    def update(self, progress: StageProgress) -> tuple[StageProgress, list[StragglerChange]]:
        """The reading with each rank's straggler flag set, and the flags that changed."""
        work = {r.rank: r.work_s for r in progress.ranks if r.work_s is not None and r.phase == "running"}
        for rank in set(self._above_since) - set(work):  # no figure now: its time above the line starts again
            del self._above_since[rank]
        changes = []
        for rank, own in work.items():
            peers = [w for k, w in work.items() if k != rank]
            if not peers:
                continue
            change = self._judge(rank, own, statistics.median(peers), progress.elapsed_s)
            if change is not None:
                changes.append(change)
        ranks = tuple(_flag(r, r.rank in self._open) for r in progress.ranks)
        return replace(progress, ranks=ranks), changes

    def _judge(self, rank: int, own: float, median: float, now: float) -> StragglerChange | None:
        line = max(self.policy.factor * median, median + self.policy.MIN_EXCESS_S)
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
        slot = self.slots[rank]
        straggler = Straggler(rank, slot.host, slot.device, own, median, flagged_after_s=now)
        straggler.peak_ratio = straggler.ratio
        self._open[rank] = straggler
        self.flagged.append(straggler)
        return StragglerChange(straggler, cleared=False)


def _flag(rank: RankLive, straggler: bool) -> RankLive:
    return rank if rank.straggler == straggler else replace(rank, straggler=straggler)
