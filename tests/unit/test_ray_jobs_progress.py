"""A Ray Jobs run's live progress through the job's log: the launcher inside writes a stage's start,
progress and end as tagged lines; the submitting side turns them back into the same events (the
console's live line) and never shows them as the job's output, nor does ``launch logs``."""

from __future__ import annotations

import io

from rich.console import Console

from launcher.backends.ray_jobs import (
    EVENT_TAG,
    JobLogEvents,
    LogReplay,
    StageEnd,
    StageStart,
    encode_event,
    job_log_lines,
    parse_event,
)
from launcher.control.events import RankLive, RunEvents, StageProgress
from launcher.ui.console import RunUI


def _progress(steps: tuple[int, ...], elapsed_s: float = 12.345, straggler: int | None = None) -> StageProgress:
    hosts = ("node-a", "node-a", "node-b")
    ranks = tuple(
        RankLive(k, hosts[k % 3], "running", n, 1_700_000_000.1234 + k, 0.0123456789 if k else None, k == straggler)
        for k, n in enumerate(steps)
    )
    return StageProgress(len(steps), elapsed_s, ranks, restarts=1, phases={"running": len(steps)})


class Recorder(RunEvents):
    """What the submitting side made of the job's log, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []

    def rank_output(self, source: str, text: str) -> None:
        self.seen.append(("rank", (source, text)))

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        self.seen.append(("stage", (job, world_size, device_type, backend)))

    def remote_progress(self, progress: StageProgress) -> None:
        self.seen.append(("progress", progress))

    def stage_finished(self) -> None:
        self.seen.append(("end", None))


def test_a_progress_line_is_one_compact_tagged_line_that_reads_back_the_same() -> None:
    progress = _progress((120, 118, 121), straggler=2)
    line = encode_event(progress)
    assert line.startswith(EVENT_TAG) and "\n" not in line and " " not in line[len(EVENT_TAG) :]
    assert line.count("node-a") == 1  # each host once, not once per rank
    back = parse_event(line)
    assert isinstance(back, StageProgress)
    assert (back.world_size, back.elapsed_s, back.restarts, dict(back.phases)) == (3, 12.35, 1, {"running": 3})
    assert [(r.rank, r.host, r.phase, r.steps, r.straggler) for r in back.ranks] == [
        (0, "node-a", "running", 120, False), (1, "node-a", "running", 118, False), (2, "node-b", "running", 121, True),
    ]  # fmt: skip
    assert back.ranks[0].work_s is None and back.ranks[1].work_s == 0.012346 and back.ranks[2].beacon_t == 1_700_000_002.123
    assert (back.steps_min, back.steps_max) == (118, 121)


def test_stage_lines_read_back_and_anything_else_is_no_event() -> None:
    start = StageStart("train", 4, "cpu", "ray")
    assert parse_event(encode_event(start)) == start
    assert parse_event(encode_event(StageEnd())) == StageEnd()
    line = encode_event(_progress((1, 2)))
    for other in ("node-a:0 step 3", "", line[:-7], EVENT_TAG + "{}", EVENT_TAG + '{"event":"progress"}', " " + line):
        assert parse_event(other) is None, other


def test_the_replay_turns_tagged_lines_into_events_and_shows_only_the_jobs_output() -> None:
    log = "\n".join([
        "a line of the launcher inside",
        encode_event(_progress((9,))),  # before any stage: nothing to show it on
        encode_event(StageStart("train", 2, "cpu", "ray")),
        "node-a:0 step 1",
        encode_event(_progress((3, 4))),
        EVENT_TAG + '{"event":"progress","ranks":[[0',  # cut short: hidden all the same
        "node-a:1 step 2",
        encode_event(_progress((7, 8))),
        encode_event(StageEnd()),
        encode_event(StageStart("train", 4, "cpu", "ray")),
        "@gpulaunch-bundle 0/1 AAAA",
    ])  # fmt: skip
    events = Recorder()
    replay = LogReplay(events)
    replay.feed(log + "\n")
    replay.close()  # the job ended inside its second stage: that stage ends here
    kinds = [kind for kind, _ in events.seen]
    assert kinds == ["rank", "stage", "rank", "progress", "rank", "progress", "end", "stage", "end"]
    ranks = [value for kind, value in events.seen if kind == "rank"]
    assert ranks == [("", "a line of the launcher inside"), ("node-a:0", "step 1"), ("node-a:1", "step 2")]
    steps = [[r.steps for r in value.ranks] for kind, value in events.seen if kind == "progress"]
    assert steps == [[3, 4], [7, 8]]
    # `launch logs`: the same lines a person reads, each stage as its title line
    assert job_log_lines(log) == [
        "a line of the launcher inside", "train: world size 2 on cpu (ray)", "node-a:0 step 1", "node-a:1 step 2",
        "train: world size 4 on cpu (ray)",
    ]  # fmt: skip


def test_the_job_writes_a_progress_line_at_most_every_interval() -> None:
    stream = io.StringIO()
    events = JobLogEvents(stream, every_s=3600)
    events.stage_started("train", 2, "cpu", "ray")
    for n in range(5):  # the run loop's twice a second
        events.progress(None, _progress((n, n)))  # type: ignore[arg-type] - the plan is not read
    events.rank_output("node-a:0", "hello")
    events.stage_finished()
    events.stage_started("train", 4, "cpu", "ray")  # a new stage's first reading goes out at once
    events.progress(None, _progress((0, 0, 0, 0)))  # type: ignore[arg-type]
    lines = stream.getvalue().splitlines()
    parsed = [parse_event(line) for line in lines]
    assert [type(p).__name__ for p in parsed] == ["StageStart", "StageProgress", "NoneType", "StageEnd", "StageStart", "StageProgress"]
    assert lines[2] == "node-a:0 hello"
    assert [r.steps for r in parsed[1].ranks] == [0, 0]  # type: ignore[union-attr]


def test_the_console_shows_the_live_line_on_a_terminal_only() -> None:
    piped = io.StringIO()
    ui = RunUI(Console(file=piped, force_terminal=False, width=100))
    ui.stage_started("train", 2, "cpu", "ray")
    ui.remote_progress(_progress((5, 7)))
    ui.stage_finished()
    assert piped.getvalue().splitlines() == ["▶ train: world size 2 on cpu (ray)"]  # no live-line noise in a pipe

    tty = RunUI(Console(file=io.StringIO(), force_terminal=True, width=100))
    tty.stage_started("train", 3, "cpu", "ray")
    try:
        assert tty._live is not None
        tty.remote_progress(_progress((5, 7, 6), straggler=1))
        shown = str(tty._live.get_renderable())
    finally:
        tty.stage_finished()
    assert shown == "  world 3 · 3 running · steps 5-7 · straggler: rank 1 · 12.3s"
