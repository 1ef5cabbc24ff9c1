"""A stalled stage's evidence, gathered on each rank's host: stacks read from outside, each rank's own account.

Two sides, both on the rank's host:

- **The rank** (``RankAccount``, called by its beacon thread twice a second): when its
  ``hang/request_rank<k>`` file appears, it writes its own account: its flight recorder's last
  collectives (torch records every collective by sequence number once ``TORCH_FR_BUFFER_SIZE`` is
  set, which ``enable_flight_recorder`` does before the process group exists) and every thread's
  stack. A thread answers while the main thread is blocked in a collective, a sleep or a lock:
  each releases the GIL. A frozen rank (SIGSTOP) or one holding the GIL does not answer.
- **The host** (``gather``, run by whatever reaches the host: this machine directly, the SSH
  host helper, an srun step, a Ray task on the actor's node): creates the request, reads each
  live rank's stacks from outside with py-spy (``--nonblocking``: a stopped or blocked process
  is read as it is, not paused or woken), the process state from the kernel, and merges the
  ranks' accounts that arrive within ``wait_s``: a rank's own stacks where it answered, py-spy's
  where it did not.

``python -m launcher.runtime.hangdump STAGE_DIR --host NAME`` prints the host's evidence as one
JSON line (the srun step's way; also a look by hand).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import linecache
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Mapping, Sequence

from launcher.evidence import CollectiveCall, RankEvidence, StackFrame, ThreadStack
from launcher.procutil import read_json, stage_worker_pids, write_json_atomic
from launcher.protocol import StagePaths

FR_BUFFER_ENTRIES = "2000"  # collectives kept per rank: a few MB at most, a ring (oldest dropped)
LAST_COLLECTIVES = 8  # how many of them a rank's account carries
PY_SPY_TIMEOUT_S = 10.0
ACCOUNT_WAIT_S = 3.0  # a rank's beacon thread looks for the request every 0.5 s
# psutil's process status -> what the evidence says
_PROCESS_STATES = {"running": "running", "sleeping": "sleeping", "idle": "sleeping", "disk-sleep": "disk-wait", "stopped": "stopped",
                   "tracing-stop": "stopped", "zombie": "gone", "dead": "gone"}  # fmt: skip


def enable_flight_recorder(torch_version: str) -> None:
    """Before the process group is made: torch's flight recorder on, for gloo and NCCL alike
    (a user's own setting wins). torch before 2.7 reads the NCCL-only name, later ones warn about it."""
    major, minor = (int(n) for n in torch_version.split(".")[:2])
    name = "TORCH_FR_BUFFER_SIZE" if (major, minor) >= (2, 7) else "TORCH_NCCL_TRACE_BUFFER_SIZE"
    if "TORCH_FR_BUFFER_SIZE" not in os.environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ[name] = FR_BUFFER_ENTRIES


# ------------------------------------------------------------------------------------- rank side


class RankAccount:
    """Answers the host's request for this rank's own account of a stall (once per request)."""

    def __init__(self, paths: StagePaths, rank: int, phases: dict[str, float] | None = None) -> None:
        self.paths, self.rank = paths, rank
        self.phases = phases if phases is not None else {}  # the rank's phase stamps so far (its report's, live)
        self._answered: int | None = None

    def maybe_answer(self) -> None:
        try:
            asked = self.paths.hang_request(self.rank).stat().st_mtime_ns
        except OSError:
            return
        if asked == self._answered:
            return
        self._answered = asked
        collectives, recorder = _flight_record(self.paths.flight_record(self.rank))
        account = {"threads": [t.to_dict() for t in _own_threads()], "collectives": [c.to_dict() for c in collectives], "recorder": recorder,
                   "phases": dict(self.phases)}  # fmt: skip
        write_json_atomic(self.paths.rank_account(self.rank), account, durable=False)


def _own_threads() -> list[ThreadStack]:
    names = {t.ident: t.name for t in threading.enumerate()}
    me, main = threading.get_ident(), threading.main_thread().ident
    stacks = []
    for ident, frame in sys._current_frames().items():
        if ident == me or (ident != main and names.get(ident, "").startswith("gpulaunch-")):
            continue  # the beacon thread answering, the runtime's own threads (as py-spy's are left out)
        frames = tuple(StackFrame(f.name, f.filename, f.lineno or 0, (f.line or "")[:200]) for f in reversed(traceback.extract_stack(frame)))
        stacks.append(ThreadStack(names.get(ident, f"thread {ident}"), frames, main=ident == main))
    return sorted(stacks, key=lambda t: not t.main)


def _flight_record(dump_to: Path) -> tuple[list[CollectiveCall], bool]:
    """Torch's dump of this process's flight recorder, written to ``dump_to`` as torch writes it
    (a pickle its ``torchfrtrace`` reads), and its last collectives, oldest first; and whether
    the recorder answered (torch imported, a process group made)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return [], False
    try:
        import torch._C._distributed_c10d as c10d

        dump = c10d._dump_fr_trace(True, False)  # type: ignore[attr-defined]  # torch's private API, in 2.5+
        trace = pickle.loads(dump)
    except Exception:  # noqa: BLE001 - an older torch without the recorder: the stacks still say a lot
        return [], False
    tmp = dump_to.with_name(dump_to.name + ".tmp")
    tmp.write_bytes(dump)
    os.replace(tmp, dump_to)
    entries = [e for e in trace.get("entries") or () if isinstance(e, dict) and e.get("collective_seq_id")]
    kept = entries[-LAST_COLLECTIVES:]
    if any(e.get("state") == "completed" for e in entries):  # NCCL: the host may be far ahead of the device
        pending = next((e for e in entries if e.get("state") != "completed"), None)
        if pending is not None and pending not in kept:
            kept = [pending, *kept]
    return [_collective(e) for e in kept], True


def _collective(entry: dict[str, Any]) -> CollectiveCall:
    op = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
    sizes = tuple(tuple(int(n) for n in s) for s in entry.get("input_sizes") or () if isinstance(s, list))
    return CollectiveCall(int(entry["collective_seq_id"]), op, str(entry.get("state", "?")), sizes)


# ------------------------------------------------------------------------------------- host side


def gather(stage_dir: str | Path, host: str, ranks: Sequence[int] | None = None, wait_s: float = ACCOUNT_WAIT_S,
           pids: Mapping[int, int] | None = None) -> list[RankEvidence]:  # fmt: skip
    """``ranks`` of the stage on this host (default: those with a beacon here): process state,
    stacks read from outside, and the rank's own account where it gives one within ``wait_s``.
    ``pids``: the ranks' processes where the caller knows them better than their beacons (a
    replacement in place that has not written its beacon yet)."""
    paths = StagePaths(Path(stage_dir))
    if ranks is None:
        ranks = sorted(int(p.stem[len("rank") :]) for p in paths.progress_dir.glob("rank*.json"))
    known = pids if pids is not None else stage_worker_pids(paths.root)
    live = {rank: pid for rank, pid in known.items() if rank in ranks}
    paths.hang_dir.mkdir(parents=True, exist_ok=True)
    for rank in ranks:
        paths.rank_account(rank).unlink(missing_ok=True)
        paths.hang_request(rank).write_text(f"{time.time()}\n")  # a new mtime: the rank answers again
    outside = {rank: _py_spy(pid) for rank, pid in live.items()}
    states = {rank: _process_state(pid) for rank, pid in live.items()}
    accounts = _await_accounts(paths, [r for r in live if states[r] != "stopped"], wait_s)
    for rank in ranks:
        paths.hang_request(rank).unlink(missing_ok=True)
    return [_evidence(paths, rank, host, live.get(rank), states.get(rank, "gone"), outside.get(rank), accounts.get(rank)) for rank in ranks]


def gather_as_dicts(stage_dir: str, host: str, ranks: list[int]) -> list[dict[str, Any]]:
    """``gather``, as plain data (what a Ray task on the ranks' node returns)."""
    return [e.to_dict() for e in gather(stage_dir, host, ranks)]


def _evidence(paths: StagePaths, rank: int, host: str, pid: int | None, state: str, outside: tuple[list[ThreadStack], str] | None, account: dict[str, Any] | None) -> RankEvidence:
    threads, note = outside if outside is not None else ([], "")
    trace = b""
    if account is not None and account.get("recorder"):
        with contextlib.suppress(OSError):
            trace = paths.flight_record(rank).read_bytes()
    # The rank's own account first: its interpreter wrote it, exact. py-spy's ``--nonblocking``
    # read of a Python 3.11 interpreter can be torn while the rank's thread walks its own frames
    # to answer (seen: the main thread's innermost frames missing, a blocked rank read at the line
    # it had left); py-spy is what is left where the rank cannot answer (stopped, holding the GIL).
    source = "py-spy" if threads else "none"
    if account and account.get("threads"):
        threads, source = [ThreadStack.from_dict(t) for t in account["threads"]], "rank"
    collectives = tuple(CollectiveCall.from_dict(c) for c in (account or {}).get("collectives") or ())
    if pid is None:
        note = "no live process (it had ended)"
    elif account is None and state != "stopped":
        note = "; ".join(filter(None, [note, "the rank did not answer (its interpreter is held: a C call holding the GIL, or a dead beacon thread)"]))
    phases = {k: float(v) for k, v in ((account or {}).get("phases") or {}).items() if isinstance(v, (int, float))}
    return RankEvidence(rank, host, pid, state, source, tuple(threads), collectives, bool((account or {}).get("recorder")), note, trace, phases)


def _await_accounts(paths: StagePaths, ranks: list[int], wait_s: float) -> dict[int, dict[str, Any]]:
    accounts: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + wait_s
    while len(accounts) < len(ranks) and time.monotonic() < deadline:
        for rank in ranks:
            if rank not in accounts and isinstance(data := read_json(paths.rank_account(rank)), dict):
                accounts[rank] = data
        time.sleep(0.05)
    return accounts


def _process_state(pid: int) -> str:
    import psutil

    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.Error:
        return "unknown"
    return _PROCESS_STATES.get(status, "unknown")


def py_spy_binary() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"  # the environment's own, whatever PATH says
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def _py_spy(pid: int) -> tuple[list[ThreadStack], str]:
    """Every thread's stack, read from outside (``--nonblocking``: nothing is paused or woken);
    ([], why) where it cannot be read."""
    binary = py_spy_binary()
    if binary is None:
        return [], "py-spy is not installed here"
    try:
        done = subprocess.run([binary, "dump", "--json", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"py-spy: {type(exc).__name__}"
    if done.returncode != 0:
        return [], f"py-spy: {(done.stderr.strip().splitlines() or ['failed'])[-1][:200]}"
    try:
        threads = json.loads(done.stdout)
    except ValueError:
        return [], "py-spy: unreadable output"
    stacks = [_thread(t, pid) for t in threads if isinstance(t, dict)]
    return [t for t in stacks if not t.name.startswith("gpulaunch-")] or stacks, ""


def _thread(data: dict[str, Any], pid: int) -> ThreadStack:
    frames = tuple(_frame(f) for f in data.get("frames") or () if isinstance(f, dict))
    return ThreadStack(str(data.get("thread_name") or data.get("os_thread_id")), frames, main=data.get("os_thread_id") == pid)


def _frame(data: dict[str, Any]) -> StackFrame:
    """A frame as py-spy or the flight recorder give it, with its source line read here, on the
    rank's host, where the file is."""
    filename, line = str(data.get("filename")), int(data.get("line") or 0)
    return StackFrame(str(data.get("name")), filename, line, linecache.getline(filename, line).strip()[:200] if line else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print this host's evidence of a stalled stage as one JSON line.")
    p.add_argument("stage_dir")
    p.add_argument("--host", default=os.uname().nodename)
    p.add_argument("--ranks", default=None, help="comma-separated (default: every rank with a beacon here)")
    p.add_argument("--wait-s", type=float, default=ACCOUNT_WAIT_S)
    args = p.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    evidence = gather(args.stage_dir, args.host, ranks, args.wait_s)
    print(json.dumps({"evidence": [e.to_dict() for e in evidence]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
