"""The remote-run wire: how the launcher inside a scheduler's job (a Ray job's log, a Slurm job's
output file) tells the launch that submitted it what happens. The launcher inside writes rank lines
as they are and every event as one compact tagged line; the submitting side turns them back into
the same events (the console's live line, /metrics) and never shows a tagged line as the job's
output, nor does ``launch logs``."""

from __future__ import annotations

import io

from rich.console import Console

from launcher.results.store import RunResult
from launcher.stage.watch import RankLive, RunEvents, StageProgress
from launcher.stage.wire import TAG, WireEvents, WireReader, parse, progress_of, progress_payload, readable
from launcher.ui.console import RunUI


def _progress(steps: tuple[int, ...], elapsed_s: float = 12.345, straggler: int | None = None) -> StageProgress:
    hosts = ("node-a", "node-a", "node-b")
    ranks = tuple(
        RankLive(k, hosts[k % 3], "running", n, 1_700_000_000.1234 + k, 0.0123456789 if k else None, k == straggler)
        for k, n in enumerate(steps)
    )
    return StageProgress(len(steps), elapsed_s, ranks, restarts=1, phases={"running": len(steps)}, resumed_step=40)


class Recorder(RunEvents):
    """What the submitting side made of the job's output, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []

    def note(self, text: str) -> None:
        self.seen.append(("note", text))

    def message(self, text: str) -> None:
        self.seen.append(("message", text))

    def rank_output(self, source: str, text: str) -> None:
        self.seen.append(("rank", (source, text)))

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        self.seen.append(("stage", (job, world_size, device_type, backend)))

    def progress(self, progress: StageProgress) -> None:
        self.seen.append(("progress", progress))

    def stage_finished(self) -> None:
        self.seen.append(("end", None))


def _written(write) -> list[str]:  # noqa: ANN001
    stream = io.StringIO()
    write(WireEvents(stream, every_s=3600))
    return stream.getvalue().splitlines()


def test_a_progress_line_is_one_compact_tagged_line_that_reads_back_the_same() -> None:
    progress = _progress((120, 118, 121), straggler=2)
    [line] = _written(lambda w: (w.stage_started("train", 3, "cpu", "ray"), w.progress(progress)))[1:]
    assert line.startswith(TAG) and "\n" not in line and " " not in line[len(TAG) :]
    assert line.count("node-a") == 1  # each host once, not once per rank
    back = progress_of(parse(line).data)
    assert (back.world_size, back.elapsed_s, back.restarts, dict(back.phases)) == (3, 12.35, 1, {"running": 3})
    assert [(r.rank, r.host, r.phase, r.steps, r.straggler) for r in back.ranks] == [
        (0, "node-a", "running", 120, False), (1, "node-a", "running", 118, False), (2, "node-b", "running", 121, True),
    ]  # fmt: skip
    assert back.ranks[0].work_s is None and back.ranks[1].work_s == 0.012346 and back.ranks[2].beacon_t == 1_700_000_002.123
    assert progress_of(progress_payload(back)) == back


def test_the_reader_turns_tagged_lines_into_events_and_shows_only_the_jobs_output() -> None:
    lines = _written(lambda w: (
        w.note("no GPU visible"),
        w.rank_output("", "a line of the launcher inside"),
        w.progress(_progress((9,))),  # before any stage: nothing to show it on
        w.stage_started("train", 2, "cpu", "slurm"),
        w.rank_output("node-a:0", "step 1"),
        w.progress(_progress((3, 4))),
        w.rank_output("n1:agent", "srun: error: n1: task 0: Killed"),
        w.stage_finished(),
        w.stage_started("train", 4, "cpu", "slurm"),
        w.finished(RunResult({"job": "train", "status": "failed"}, None)),  # type: ignore[arg-type]
    ))  # fmt: skip
    lines[5:5] = [TAG + '{"event":"progress","ranks":[[0']  # cut short: hidden all the same
    events = Recorder()
    reader = WireReader(events, "slurm")
    reader.feed([*lines, "Traceback (most recent call last):"])
    reader.close()  # the job ended inside its second stage: that stage ends here
    kinds = [kind for kind, _ in events.seen]
    assert kinds == ["note", "rank", "stage", "rank", "progress", "rank", "end", "stage", "rank", "end"]
    assert [value for kind, value in events.seen if kind == "rank"] == [
        ("", "a line of the launcher inside"), ("node-a:0", "step 1"), ("n1:agent", "srun: error: n1: task 0: Killed"),
        ("", "Traceback (most recent call last):"),
    ]  # fmt: skip
    assert [[r.steps for r in value.ranks] for kind, value in events.seen if kind == "progress"] == [[3, 4]]
    assert reader.finished == "failed" and reader.last_progress is not None
    # `launch logs`: the same lines a person reads, each stage as its title line
    shown = [readable(line) for line in lines]
    assert [s for s in shown if s is not None] == [
        ("", "note: no GPU visible"), ("", "a line of the launcher inside"), ("", "train: world size 2 on cpu (slurm)"),
        ("node-a:0", "step 1"), ("n1:agent", "srun: error: n1: task 0: Killed"), ("", "train: world size 4 on cpu (slurm)"),
        ("", "train: failed"),
    ]  # fmt: skip
    assert parse("n1:x not a rank").kind == "text"


def test_the_job_writes_a_progress_line_at_most_every_interval() -> None:
    lines = _written(lambda w: (
        w.stage_started("train", 2, "cpu", "ray"),
        *(w.progress(_progress((n, n))) for n in range(5)),  # the run loop's twice a second
        w.stage_finished(),
        w.stage_started("train", 4, "cpu", "ray"),  # a new stage's first reading goes out at once
        w.progress(_progress((0, 0, 0, 0))),
    ))  # fmt: skip
    assert [parse(line).data["event"] for line in lines] == ["stage", "progress", "stage_end", "stage", "progress"]
    assert [r.steps for r in progress_of(parse(lines[1]).data).ranks] == [0, 0]


def test_the_console_shows_the_live_line_on_a_terminal_only() -> None:
    piped = io.StringIO()
    ui = RunUI(Console(file=piped, force_terminal=False, width=100))
    ui.stage_started("train", 2, "cpu", "ray")
    ui.progress(_progress((5, 7)))
    ui.stage_finished()
    assert piped.getvalue().splitlines() == ["▶ train: world size 2 on cpu (ray)"]  # no live-line noise in a pipe

    tty = RunUI(Console(file=io.StringIO(), force_terminal=True, width=100))
    tty.stage_started("train", 3, "cpu", "ray")
    try:
        assert tty._live is not None
        tty.progress(_progress((5, 7, 6), straggler=1))
        shown = str(tty._live.get_renderable())
    finally:
        tty.stage_finished()
    assert shown == "  world 3 · attempt 2 · from step 40 · 3 running · steps 5-7 · straggler: rank 1 · 12.3s"
