"""What a stalled rank's host says about it: its threads' stacks and its last collectives.

Standard library only: gathered on the rank's host (``launcher.runtime.hangdump``), carried back
as JSON by the stage's engine (a host helper's answer, an srun step's output, a Ray task's result)
and read by the run loop's hang diagnosis (``launcher.control.hangs``).
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Mapping

RANK_RUNNER = "launcher/runtime/worker.py"  # where run_rank is: its thread is the rank's
# frames in these are not the job's own code: installed packages (torch), the launcher's runtime,
# the standard library, code without a file
_NOT_JOB_CODE = ("/site-packages/", "/dist-packages/", "/launcher/runtime/", "/lib/python3", "<frozen ", "<string>")


def is_job_code(filename: str) -> bool:
    return not any(part in filename for part in _NOT_JOB_CODE)


@dataclass(frozen=True)
class StackFrame:
    function: str
    filename: str
    line: int
    code: str = ""  # the source line, read on the rank's host (where the file is)

    def where(self) -> str:
        """``train.py:88 time.sleep(3600)``: the file's name, the line, and what it says there
        (or the function it is in, where the source could not be read)."""
        code = self.code.split("  #", 1)[0].strip()  # an inline comment (PEP 8's two spaces) is not the call
        return f"{PurePath(self.filename).name}:{self.line} {code or f'in {self.function}'}"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"function": self.function, "filename": self.filename, "line": self.line}
        if self.code:
            data["code"] = self.code
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StackFrame:
        return cls(str(data.get("function", "?")), str(data.get("filename", "?")), int(data.get("line") or 0), str(data.get("code", "")))


@dataclass(frozen=True)
class ThreadStack:
    name: str
    frames: tuple[StackFrame, ...]  # innermost first
    main: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "main": self.main, "frames": [f.to_dict() for f in self.frames]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ThreadStack:
        frames = tuple(StackFrame.from_dict(f) for f in data.get("frames") or () if isinstance(f, Mapping))
        return cls(str(data.get("name", "?")), frames, bool(data.get("main")))


@dataclass(frozen=True)
class CollectiveCall:
    """One entry of a rank's flight recorder (torch's record of its collectives, by sequence number)."""

    seq: int  # the process group's collective sequence number: the same call has the same number on every rank
    op: str  # "all_reduce", "broadcast", ... (the process-group backend's prefix removed)
    state: str  # "scheduled", "started", "completed" (gloo records "scheduled" only)
    sizes: tuple[tuple[int, ...], ...] = ()  # the input tensors' shapes

    def label(self) -> str:
        return f"{self.op} #{self.seq}"

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "state": self.state, "sizes": [list(s) for s in self.sizes]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CollectiveCall:
        sizes = tuple(tuple(int(n) for n in s) for s in data.get("sizes") or () if isinstance(s, (list, tuple)))
        return cls(int(data.get("seq") or 0), str(data.get("op", "?")), str(data.get("state", "?")), sizes)


@dataclass(frozen=True)
class RankEvidence:
    """One rank of a stalled stage, as its host saw it."""

    rank: int
    host: str
    pid: int | None
    process_state: str  # from the kernel: "running", "sleeping", "stopped" (SIGSTOP, a debugger), "gone", "unknown"
    stack_source: str  # "py-spy" (read from outside), "rank" (its own account), "none"
    threads: tuple[ThreadStack, ...] = ()
    collectives: tuple[CollectiveCall, ...] = ()  # the flight recorder's last entries, oldest first
    recorder: bool = False  # whether the rank's flight recorder answered (then () means: no collective yet)
    note: str = ""  # what could not be read, and why
    flight_record: bytes = b""  # torch's whole dump of the rank's recorder (pickle), to store as fr_trace_rank<k>
    phases: Mapping[str, float] = field(default_factory=dict)  # the rank's phase stamps (its report has none: it is stopped)

    @property
    def last_collective(self) -> CollectiveCall | None:
        """The collective the rank is in, or was last in: where its recorder says which calls
        completed (NCCL: the device's own progress, while the host may have queued many more),
        the first that did not; else (gloo records no completion) the last one entered."""
        if any(c.state == "completed" for c in self.collectives):
            pending = [c for c in self.collectives if c.state != "completed"]
            if pending:
                return pending[0]
        return self.collectives[-1] if self.collectives else None

    @property
    def frozen(self) -> bool:
        return self.process_state == "stopped"

    def main_thread(self) -> ThreadStack | None:
        """The thread that runs the rank's job: the one in the rank runtime's ``run_rank`` (a Ray
        actor runs it on a thread of its own), else the process's main thread."""
        for t in self.threads:
            if any(f.function == "run_rank" and f.filename.endswith(RANK_RUNNER) for f in t.frames):
                return t
        return next((t for t in self.threads if t.main), self.threads[0] if self.threads else None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "host": self.host, "pid": self.pid, "process_state": self.process_state,
            "stack_source": self.stack_source, "threads": [t.to_dict() for t in self.threads],
            "collectives": [c.to_dict() for c in self.collectives], "recorder": self.recorder, "note": self.note,
            "flight_record": base64.b64encode(zlib.compress(self.flight_record)).decode() if self.flight_record else "",
            "phases": dict(self.phases),
        }  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RankEvidence:
        pid = data.get("pid")
        return cls(
            rank=int(data.get("rank", -1)),
            host=str(data.get("host", "?")),
            pid=pid if isinstance(pid, int) else None,
            process_state=str(data.get("process_state", "unknown")),
            stack_source=str(data.get("stack_source", "none")),
            threads=tuple(ThreadStack.from_dict(t) for t in data.get("threads") or () if isinstance(t, Mapping)),
            collectives=tuple(CollectiveCall.from_dict(c) for c in data.get("collectives") or () if isinstance(c, Mapping)),
            recorder=bool(data.get("recorder")),
            note=str(data.get("note", "")),
            flight_record=_unpacked(data.get("flight_record")),
            phases={str(k): float(v) for k, v in (data.get("phases") or {}).items() if isinstance(v, (int, float))},
        )


def _unpacked(text: Any) -> bytes:
    if not isinstance(text, str) or not text:
        return b""
    try:
        return zlib.decompress(base64.b64decode(text))
    except (ValueError, zlib.error):
        return b""
