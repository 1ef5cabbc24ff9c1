"""The remote-run wire: how a launcher running inside a scheduler's job (a Ray job, a Slurm batch
job) tells the ``launch`` that submitted it what happens, live. One format, one parser, one
follow loop, for every submitter.

Inside, ``WireEvents`` (a ``RunEvents``) writes the run's events into the job's output, which the
scheduler keeps and the submitting side can read as it grows (Ray: the job's log, streamed through
the Jobs API; Slurm: ``slurm-<id>.out`` on the shared filesystem):

- a rank's or an agent's output line as ``host:rank text`` / ``host:agent text``, as on a local console;
- every other event as one tagged line, ``@gpulaunch {"event": ...}`` (compact JSON): ``note``,
  ``message``, ``stage`` (a stage starts), ``progress`` (every rank of the stage, each host named
  once: a second apart during a stage's first minute, then ``LATER_S``), ``stage_end``, ``finished``;
- anything else (the launcher's own error lines) as it is.

Outside, ``WireReader`` turns each line back into the same event on the user's watcher (the
console's live line and the ``/metrics`` endpoint see every rank of the cluster), and
``follow`` is the one loop that reads a ``RemoteRun`` until its job has ended.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TextIO

from launcher.stage.watch import RankLive, RunEvents, StageProgress, count_phases

if TYPE_CHECKING:
    from launcher.results.store import RunResult

TAG = "@gpulaunch "
EVERY_S = 1.0  # progress lines during a stage's first minute (when a user watches start-up)
LATER_S = 10.0  # then: a long job's output stays small
FAST_FOR_S = 60.0
_SOURCE = re.compile(r"^[^\s:|]+:(\d+|agent)$")  # host:rank, or host:agent for the agent's own lines


# --- the format ----------------------------------------------------------------------------------


def encode(event: str, **data: Any) -> str:
    return TAG + json.dumps({"event": event, **data}, separators=(",", ":"))


def progress_payload(progress: StageProgress) -> dict[str, Any]:
    """Each host once; a rank names its host by index: [rank, host, phase, steps, beacon_t, work_s, straggler]."""
    hosts: dict[str, int] = {}
    ranks = [
        [r.rank, hosts.setdefault(r.host, len(hosts)), r.phase, r.steps, _rounded(r.beacon_t, 3), _rounded(r.work_s, 6), int(r.straggler)]
        for r in progress.ranks
    ]
    return {"world_size": progress.world_size, "elapsed_s": round(progress.elapsed_s, 2), "restarts": progress.restarts,
            "hosts": list(hosts), "ranks": ranks, "resumed_step": progress.resumed_step}  # fmt: skip


def progress_of(data: dict[str, Any]) -> StageProgress:
    hosts = [str(h) for h in data["hosts"]]
    ranks = tuple(
        RankLive(int(rank), hosts[host], str(phase), int(steps), _float(beacon_t), _float(work_s), bool(straggler))
        for rank, host, phase, steps, beacon_t, work_s, straggler in data["ranks"]
    )
    resumed = data.get("resumed_step")
    return StageProgress(int(data["world_size"]), float(data["elapsed_s"]), ranks, int(data["restarts"]), count_phases(ranks),
                         int(resumed) if isinstance(resumed, int) else None)  # fmt: skip


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class Line:
    """One line of a submitted run's output, parsed: ``kind`` is ``event`` (``data`` the tagged
    JSON), ``rank`` (``source``, ``text``) or ``text`` (the launcher's own words)."""

    kind: str
    data: Any = None
    source: str = ""
    text: str = ""


def parse(line: str) -> Line:
    if line.startswith(TAG):
        try:
            data = json.loads(line[len(TAG) :])
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("event"), str):
            return Line("event", data)
        return Line("event", None)  # cut short: bookkeeping all the same, never the job's output
    source, sep, rest = line.partition(" ")
    if sep and _SOURCE.match(source):
        return Line("rank", source=source, text=rest)
    return Line("text", text=line)


def readable(line: str) -> tuple[str, str] | None:
    """A line as ``launch logs`` prints it: (source, text), or None for the wire's bookkeeping."""
    parsed = parse(line)
    if parsed.kind == "rank":
        return parsed.source, parsed.text
    if parsed.kind == "text":
        return "", parsed.text
    data = parsed.data or {}
    event = data.get("event")
    if event in ("note", "message"):
        return "", f"{'note' if event == 'note' else 'launcher'}: {data.get('text', '')}"
    if event == "stage":
        return "", f"{data.get('job')}: world size {data.get('world_size')} on {data.get('device_type')} ({data.get('backend')})"
    if event == "finished":
        return "", f"{data.get('job')}: {data.get('status')}"
    return None


# --- inside: the run's events into the job's output --------------------------------------------------


class WireEvents(RunEvents):
    """The launcher inside a scheduler's job: every event as a line of the job's output."""

    def __init__(self, stream: TextIO | None = None, *, every_s: float = EVERY_S, later_s: float = LATER_S) -> None:
        self.stream = stream
        self.every_s, self.later_s = every_s, later_s
        self._lock = threading.Lock()
        self._next_progress = 0.0

    def _print(self, text: str) -> None:
        with self._lock:
            print(text, file=self.stream or sys.stdout, flush=True)

    def note(self, text: str) -> None:
        self._print(encode("note", text=text))

    def message(self, text: str) -> None:
        self._print(encode("message", text=text))

    def rank_output(self, source: str, text: str) -> None:
        self._print(f"{source} {text}" if source else text)

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        self._next_progress = 0.0  # the new stage's first reading goes out at once
        self._print(encode("stage", job=job, world_size=world_size, device_type=device_type, backend=backend))

    def progress(self, progress: StageProgress) -> None:
        if time.monotonic() < self._next_progress:
            return
        later = progress.elapsed_s > FAST_FOR_S
        self._next_progress = time.monotonic() + (self.later_s if later else self.every_s)
        self._print(encode("progress", **progress_payload(progress)))

    def stage_finished(self) -> None:
        self._print(encode("stage_end"))

    def finished(self, result: RunResult) -> None:
        self._print(encode("finished", job=result.data.get("job"), status=result.status))


# --- outside: the job's output back into the run's events --------------------------------------------


class WireReader:
    """The submitting side: a submitted run's output lines in, the run's events out on ``events``.
    Rank lines and the launcher's own lines go to ``events.rank_output``; tagged lines become the
    events they stand for and are never shown."""

    def __init__(self, events: RunEvents, backend: str) -> None:
        self.events = events
        self.backend = backend
        self.in_stage = False
        self.finished: str | None = None  # the status the launcher inside ended with
        self.last_progress: StageProgress | None = None
        self.heard = time.monotonic()  # when the last line came

    def feed(self, lines: list[str]) -> None:
        for line in lines:
            self.feed_line(line)

    def feed_line(self, line: str) -> None:
        self.heard = time.monotonic()
        parsed = parse(line)
        if parsed.kind == "rank":
            self.events.rank_output(parsed.source, parsed.text)
        elif parsed.kind == "text":
            self.events.rank_output("", parsed.text)
        elif parsed.data is not None:
            self._event(parsed.data)

    def _event(self, data: dict[str, Any]) -> None:
        kind = data["event"]
        try:
            if kind == "note":
                self.events.note(str(data.get("text", "")))
            elif kind == "message":
                self.events.message(str(data.get("text", "")))
            elif kind == "stage":
                self.close()
                self.events.stage_started(str(data["job"]), int(data["world_size"]), str(data["device_type"]), self.backend)
                self.in_stage = True
            elif kind == "progress" and self.in_stage:
                self.last_progress = progress_of(data)
                self.events.progress(self.last_progress)
            elif kind == "stage_end":
                self.close()
            elif kind == "finished":
                self.finished = str(data.get("status"))
        except (KeyError, TypeError, ValueError, IndexError):
            return  # a line this launcher cannot read (another version's): bookkeeping all the same

    def close(self) -> None:
        """End a stage the output left open (the job was stopped or died inside it)."""
        if self.in_stage:
            self.in_stage = False
            self.events.stage_finished()


class RemoteRun(ABC):
    """A submitted run as the follow loop sees it: new output lines, and whether its job ended."""

    @abstractmethod
    def new_lines(self, final: bool = False) -> list[str]:
        """Whole lines of the job's output since the last call (``final``: the rest, too)."""

    @abstractmethod
    def ended(self, reader: WireReader) -> str | None:
        """The job's final state once it has ended (the scheduler's word), else None."""


def follow(run: RemoteRun, reader: WireReader, *, interrupted: Callable[[], bool], poll_s: float = 0.5) -> str | None:
    """Feed ``run``'s output to ``reader`` until its job ends (its final state) or ``interrupted()``
    turns true (None: the caller stops the job)."""
    while not interrupted():
        reader.feed(run.new_lines())
        state = run.ended(reader)
        if state is not None:
            reader.feed(run.new_lines(final=True))
            return state
        time.sleep(poll_s)
    return None
