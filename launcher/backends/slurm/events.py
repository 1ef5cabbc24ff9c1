"""What the launcher inside a Slurm job tells the one that submitted it, through the job's output.

Inside, ``SlurmJobEvents`` prints rank lines as ``host:rank text`` and the run's own events (a
stage starts or ends, a note, a message) as tagged JSON lines into ``slurm-<id>.out`` in the run
directory, which the cluster's shared filesystem makes readable where ``launch`` waits. There,
``replay`` turns each line back into the same event on the user's console.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, TextIO

from launcher.control.events import RunEvents

if TYPE_CHECKING:
    from launcher.control.events import StageProgress
    from launcher.control.planning import StagePlan
    from launcher.results.store import RunResult

TAG = "@gpulaunch-slurm "
_SOURCE = re.compile(r"^[^\s:|]+:(\d+|agent)$")  # host:rank, or host:agent for the agent's own lines


class SlurmJobEvents(RunEvents):
    """The launcher inside the job: every event as one line of the job's output."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self._lock = threading.Lock()
        self._hosts_sent: set[int] = set()

    def _print(self, text: str) -> None:
        with self._lock:
            print(text, file=self.stream or sys.stdout, flush=True)

    def _emit(self, event: str, **data: Any) -> None:
        self._print(TAG + json.dumps({"event": event, **data}))

    def note(self, text: str) -> None:
        self._emit("note", text=text)

    def message(self, text: str) -> None:
        self._emit("message", text=text)

    def rank_output(self, source: str, text: str) -> None:
        self._print(f"{source} {text}" if source else text)

    def stage_started(self, job: str, world_size: int, device_type: str, backend: str) -> None:
        self._emit("stage", job=job, world_size=world_size, device_type=device_type, backend=backend)

    def progress(self, plan: StagePlan, progress: StageProgress) -> None:
        # once per stage: which host each rank is on (the beacons the submitter reads say the rest)
        if plan.world_size not in self._hosts_sent:
            self._hosts_sent.add(plan.world_size)
            self._emit("hosts", world_size=plan.world_size, hosts=[r.host for r in plan.ranks])

    def stage_finished(self) -> None:
        self._emit("stage_end")

    def finished(self, result: RunResult) -> None:
        self._emit("finished", status=result.status)


def parse(line: str) -> tuple[str, Any]:
    """One line of the job's output: ("event", {...}), ("rank", (source, text)) or ("text", line)."""
    if line.startswith(TAG):
        try:
            data = json.loads(line[len(TAG) :])
        except ValueError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("event"), str):
            return "event", data
    source, sep, rest = line.partition(" ")
    if sep and _SOURCE.match(source):
        return "rank", (source, rest)
    return "text", line


def replay(line: str, events: RunEvents, on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
    """The event a line of the job's output stands for, on ``events``; stage events (and the
    rank-to-host map) also go to ``on_event``, which follows the stage's progress."""
    kind, value = parse(line)
    if kind == "rank":
        events.rank_output(*value)
    elif kind == "text":
        events.rank_output("", value)  # the launcher's own stderr inside the job (an error, a warning)
    elif value["event"] == "note":
        events.note(str(value.get("text", "")))
    elif value["event"] == "message":
        events.message(str(value.get("text", "")))
    elif on_event is not None:
        on_event(value)


def readable(line: str) -> tuple[str, str] | None:
    """A line as ``launch logs`` prints it: (source, text), or None for bookkeeping lines."""
    kind, value = parse(line)
    if kind == "rank":
        return value
    if kind == "text":
        return "", value
    event = value["event"]
    if event in ("note", "message"):
        return "", f"{'note' if event == 'note' else 'launcher'}: {value.get('text', '')}"
    if event == "stage":
        return "", f"{value.get('job')}: world size {value.get('world_size')} on {value.get('device_type')} (slurm)"
    if event == "finished":
        return "", f"{value.get('status')}"
    return None
