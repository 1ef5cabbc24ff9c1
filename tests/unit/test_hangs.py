"""The stall watch and the hang diagnosis, pure: scripted progress on a fake clock, evidence as
records. The real thing, with injected hangs in real ranks, is in tests/integration/test_hangs.py."""

from __future__ import annotations

import random

import pytest

from launcher.control.hangs import StallWatch, diagnose, stacks_text
from launcher.evidence import CollectiveCall, RankEvidence, StackFrame, ThreadStack
from launcher.policies import HangPolicy
from launcher.stage.plan import RankSlot
from launcher.stage.watch import RankLive, StageProgress

JOB = "/home/me/train.py"
C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def progress(steps: dict[int, int], *, beacons: dict[int, float] | None = None, phases: dict[int, str] | None = None, t: float = 0.0) -> StageProgress:
    beacons = beacons or {}
    phases = phases or {}
    ranks = tuple(RankLive(r, f"h{r // 2}", phases.get(r, "running"), n, beacons.get(r, t)) for r, n in steps.items())
    return StageProgress(len(steps), t, ranks)


def run_watch(policy: HangPolicy, frames, every_s: float = 0.5):
    """Feed ``frames(t) -> StageProgress`` every ``every_s`` until a stall or the frames end (None)."""
    clock = Clock()
    watch = StallWatch(policy, clock)
    while (p := frames(clock.now)) is not None:
        stall = watch.update(p)
        if stall is not None:
            return stall, clock.now
        clock.now += every_s
    return None, clock.now


def test_every_rank_still_for_hang_s_is_a_stall_named_after_hang_s():
    # 4 ranks step together 10 steps a second until t=5, then nothing moves (beacons still come)
    stall, at = run_watch(HangPolicy(10, on_hang=None), lambda t: progress({r: int(min(t, 5) * 10) for r in range(4)}, t=t) if t < 60 else None)
    assert stall is not None and stall.kind == "all still"
    assert 15.0 <= at <= 16.0 and stall.stalled_for_s >= 10
    assert [r.rank for r in stall.ranks] == [0, 1, 2, 3]


def test_a_silent_rank_is_named_frozen_by_the_same_rule():
    def frames(t):
        if t >= 60:
            return None
        steps = {r: int(min(t, 5) * 10) for r in range(4)}
        return progress(steps, beacons={r: (min(t, 5) if r == 2 else t) for r in range(4)}, t=t)

    stall, at = run_watch(HangPolicy(10, on_hang=None), frames)
    assert stall is not None and stall.kind == "silent" and [r.rank for r in stall.ranks] == [2]
    assert stall.ranks[0].frozen and 15.0 <= at <= 16.0


def test_a_rank_left_behind_while_the_others_advance_is_a_stall():
    def frames(t):
        return progress({0: int(t * 10), 1: int(min(t, 3) * 10), 2: int(t * 10)}, t=t) if t < 60 else None

    stall, _ = run_watch(HangPolicy(10, on_hang=None), frames)
    assert stall is not None and stall.kind == "behind" and [r.rank for r in stall.ranks] == [1]


def test_no_stall_for_a_long_first_step_a_rank_finished_early_or_hang_s_off():
    # nothing counted for a minute (compilation, a download): not a hang
    assert run_watch(HangPolicy(10, on_hang=None), lambda t: progress({0: 0, 1: 0}, t=t) if t < 60 else None)[0] is None
    # rank 1 ended its share at step 30 and finished; the others go on
    finished = lambda t: progress({0: int(t * 10), 1: min(int(t * 10), 30)}, phases={1: "finished"} if t > 3 else {}, t=t) if t < 60 else None  # noqa: E731
    assert run_watch(HangPolicy(10, on_hang=None), finished)[0] is None
    # a rank ahead of the other, waiting at its loop's end for it to catch up: ahead is not behind
    ahead = lambda t: progress({0: min(int(t * 10), 100), 1: min(int(t * 2), 100)}, t=t) if t < 60 else None  # noqa: E731
    assert run_watch(HangPolicy(10, on_hang=None), ahead)[0] is None
    # off
    assert run_watch(HangPolicy(None, on_hang=None), lambda t: progress({0: 5, 1: 5}, t=t) if t < 60 else None)[0] is None


@pytest.mark.parametrize("seed", range(20))
def test_no_stall_for_pauses_under_hang_s_and_irregular_steps(seed):
    """Twenty irregular traces: steps of random length, one pause of hang_s/2 per run (a
    checkpoint), and beacons that arrive late now and then."""
    rng = random.Random(seed)
    hang_s = 10.0
    step_ends, t = [], 0.0
    for i in range(200):
        t += rng.uniform(0.01, 1.5) + (hang_s / 2 if i == 50 else 0.0)
        step_ends.append(t)

    def frames(now):
        if now > step_ends[-1]:
            return None
        steps = sum(1 for e in step_ends if e <= now)
        return progress({r: steps for r in range(4)}, beacons={r: now - rng.uniform(0, 0.6) for r in range(4)}, t=now)

    assert run_watch(HangPolicy(hang_s, on_hang=None), frames)[0] is None


def ev(rank, frames, *, seq=None, op="all_reduce", sizes=((8,),), state="sleeping", host=None, recorder=True):
    calls = ()
    if seq is not None:
        calls = (CollectiveCall(seq - 1, "broadcast", "scheduled", ((1,),)), CollectiveCall(seq, op, "scheduled", sizes))
    thread = ThreadStack("MainThread", tuple(StackFrame(*f) for f in frames), main=True)
    return RankEvidence(rank, host or f"h{rank // 2}", 1000 + rank, state, "py-spy", (thread,), calls, recorder)


WAITING = [("all_reduce", C10D, 3252, "work.wait()"), ("run", JOB, 95, "dist.all_reduce(grads)")]
SLEEPING = [("run", JOB, 88, "time.sleep(15)")]


def slots(n):
    return [RankSlot(rank=r, local_rank=r % 2, node_rank=r // 2, host=f"h{r // 2}", device="cpu") for r in range(n)]


def stall_of(ranks):
    from launcher.control.hangs import Stall, StalledRank

    return Stall("all still", 15.0, tuple(StalledRank(r, f"h{r // 2}", 1840, 15.0, 0.5) for r in ranks), 60.0)


def test_the_rank_that_has_not_reached_the_collective_is_named_first():
    evidence = [ev(r, WAITING, seq=1841) for r in range(3)] + [ev(3, SLEEPING, seq=1840)]
    d = diagnose(stall_of(range(4)), evidence, slots(4))
    assert [c.rank for c in d.culprits] == [3] and d.culprits[0].host == "h1" and d.culprits[0].line == 88
    assert d.summary == (
        "rank 3 on h1 (cpu) has not reached all_reduce #1841 (its last was #1840) — it is at train.py:88 time.sleep(15) (for 15 s); "
        "ranks 0-2 wait in all_reduce #1841 at train.py:95 dist.all_reduce(grads)"
    )
    assert [g.ranks for g in d.groups] == [(3,), (0, 1, 2)]  # the odd one out first
    assert d.groups[1].collective == "all_reduce #1841" and d.groups[0].collective is None


def test_a_rank_in_another_collective_and_a_frozen_rank_are_named():
    evidence = [ev(0, WAITING, seq=12), ev(1, WAITING, seq=12), ev(2, [("run", JOB, 40, "dist.broadcast(x)")], seq=12, op="broadcast", sizes=((1,),))]
    d = diagnose(stall_of(range(3)), evidence, slots(3))
    assert [c.rank for c in d.culprits] == [2] and "is in broadcast [1] as #12 where the others are in all_reduce [8]" in d.culprits[0].why
    frozen = [ev(0, WAITING, seq=7), ev(1, SLEEPING, seq=6, state="stopped", recorder=False)]
    d = diagnose(stall_of(range(2)), frozen, slots(2))
    assert [c.rank for c in d.culprits] == [1] and "is frozen" in d.culprits[0].why
    assert any(g.state == "stopped" and g.ranks == (1,) for g in d.groups)


def test_all_ranks_at_one_place_name_nobody_but_say_where():
    evidence = [ev(r, SLEEPING) for r in range(4)]
    d = diagnose(stall_of(range(4)), evidence, slots(4))
    assert d.culprits == () and d.summary.startswith("no rank stands out: all stalled for 15 s; ranks 0-3 are at train.py:88 time.sleep(15)")
    text = stacks_text(evidence)
    assert "rank 3 on h1: pid 1003, sleeping, stacks from py-spy" in text and "run (/home/me/train.py:88)  time.sleep(15)" in text


def test_evidence_survives_its_json_round_trip():
    e = ev(3, WAITING, seq=5)
    assert RankEvidence.from_dict(e.to_dict()) == e


def test_where_the_recorder_tracks_completion_the_first_pending_call_is_the_ranks_own():
    """NCCL: the host queues calls far ahead of the device; the one a rank is in is the first
    not completed. gloo records no completion: the last call entered is the rank's."""
    calls = tuple(CollectiveCall(n, "all_reduce", "completed" if n < 41 else "scheduled", ((8,),)) for n in range(38, 45))
    ahead = RankEvidence(0, "h0", 1, "running", "py-spy", (), calls, True)
    assert ahead.last_collective is not None and ahead.last_collective.seq == 41
    gloo = RankEvidence(0, "h0", 1, "running", "py-spy", (), tuple(CollectiveCall(n, "all_reduce", "scheduled") for n in (5, 6)), True)
    assert gloo.last_collective is not None and gloo.last_collective.seq == 6


def test_two_ranks_in_two_collectives_are_both_named_with_their_calls_and_lines():
    """No majority (two ranks, two collectives as #12): which one skipped a call cannot be told
    from the calls, so each is named with its own call and line beside the other's."""
    evidence = [ev(0, WAITING, seq=12), ev(1, [("run", JOB, 40, "dist.broadcast(x)")], seq=12, op="broadcast", sizes=((1,),))]
    d = diagnose(stall_of(range(2)), evidence, slots(2))
    assert [(c.rank, c.line) for c in d.culprits] == [(0, 95), (1, 40)]
    assert d.culprits[0].why == "is in all_reduce [8] as #12 where rank 1 is in broadcast [1]"
    assert d.culprits[1].why == "is in broadcast [1] as #12 where rank 0 is in all_reduce [8]"
    assert sorted((g.ranks, g.collective) for g in d.groups) == [((0,), "all_reduce #12"), ((1,), None)]
    assert d.summary.startswith("rank 0 on h0 (cpu) is in all_reduce [8] as #12 where rank 1 is in broadcast [1]")
    assert "rank 1 on h0 (cpu) is in broadcast [1] as #12 where rank 0 is in all_reduce [8] — it is at train.py:40" in d.summary
    # all at the same call as #12: still nobody
    same = [ev(0, WAITING, seq=12), ev(1, WAITING, seq=12)]
    assert diagnose(stall_of(range(2)), same, slots(2)).culprits == ()


def test_a_slow_start_up_is_not_counted_as_stillness():
    """Rank 1 spends 30 s importing while rank 0 (no collective to wait in) counts its first
    steps and waits; then rank 1 enters its job with 0 steps: its stillness starts then, not
    when it was spawned, and nothing is judged while a rank is still starting."""

    def frames(t):
        if t >= 45:
            return None
        rank1 = ("importing", 0) if t < 30 else ("running", int(t - 30))
        rank0 = min(int(t * 10), 5) + max(0, int(t - 30))  # goes on once its peer is there
        return progress({0: rank0, 1: rank1[1]}, phases={1: rank1[0]}, t=t)

    assert run_watch(HangPolicy(10, on_hang=None), frames)[0] is None


def test_an_early_finisher_and_a_late_starter_are_not_a_hang():
    """Rank 1 does its five steps and finishes while rank 0 is still importing (15 s); rank 0
    then steps on alone."""

    def frames(t):
        if t >= 60:
            return None
        rank0 = ("importing", 0) if t < 15 else ("running", int((t - 15) * 5))
        return progress({0: rank0[1], 1: min(int(t * 10), 5)}, phases={0: rank0[0], 1: "running" if t < 1 else "finished"}, t=t)

    assert run_watch(HangPolicy(10, on_hang=None), frames)[0] is None


def test_a_rank_frozen_before_its_last_beacons_left_is_named_by_its_silence():
    """A Ray actor frozen right after it started running: the launcher's last beacon of it says
    'importing', and no other comes; the others count 20 steps and wait."""

    def frames(t):
        if t >= 60:
            return None
        return progress({0: min(int(t * 10), 20), 1: 0, 2: min(int(t * 10), 20)}, phases={1: "importing"},
                        beacons={0: t, 1: 0.2, 2: t}, t=t)  # fmt: skip

    stall, at = run_watch(HangPolicy(10, on_hang=None), frames)
    assert stall is not None and stall.kind == "silent" and [r.rank for r in stall.ranks] == [1], stall
    assert at <= 12.0
