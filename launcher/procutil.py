"""Small OS-level helpers shared by launcher, agent and worker: parent-death signals, atomic
writes, free ports, process checks and signal handlers.

The process table (who is alive, a process's children, its start time and command line) is read
with psutil; what no library does stays here: the parent-death signal (prctl), the cgroup's OOM
kill count and the fast exit. psutil is imported by the functions that use it, on first use: every
launcher, agent and rank imports this module (before torch), most of them never need psutil."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

if TYPE_CHECKING:
    import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def handling_stop_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` for SIGINT and SIGTERM within the block, the previous handlers put back after.
    Only the main thread may set handlers: elsewhere the block runs with them unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def die_with_parent(sig: signal.Signals, expected_parent: int | None = None) -> None:
    """Ask the kernel to send ``sig`` when our parent exits, so no process outlives its launcher.

    If the parent already died before the request (the race every pdeathsig user has), exit now.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: rely on process-group teardown alone
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(128 + int(sig))


def set_process_name(name: str) -> None:
    """The name ``ps -o comm``, ``top`` and ``/proc/PID/comm`` show (15 bytes at most); the command
    line stays. For a process forked from another that does a different job. No-op off Linux."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        return


def write_json_atomic(path: str | Path, data: Any, *, durable: bool = True) -> None:
    """Write JSON so that readers see either the old file or the whole new one, never a part.
    ``durable``: on disk before this returns (fsync); a file rewritten twice a second that only
    says how far a rank got (its beacon) needs no more than the atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, default=str)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: str | Path) -> Any | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free right now (bind to 0), so jobs never collide on 29500."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def process_start_ticks(pid: int | str = "self") -> int | None:
    """When a process started, in clock ticks since boot: with the pid, the process's identity
    (a pid can be reused; a pid and its start time cannot). None if there is no such process.

    Taken from psutil's ``create_time()`` less the boot time it adds: an epoch time moves with
    the system clock (NTP, a manual change), the ticks since boot never do, so the value a rank
    writes into its progress file still matches the live process's when the launcher reads it.
    On Linux the same number is read from ``/proc/<pid>/stat`` (field 22), without importing psutil
    (every rank asks for its own at its start: ~30 ms of psutil import each, before its first step)."""
    target = os.getpid() if pid == "self" else int(pid)
    try:
        with open(f"/proc/{target}/stat", "rb") as handle:
            stat = handle.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[19])  # after the command name, which may hold spaces
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None  # procfs is there: no such process
    except (OSError, ValueError, IndexError):
        pass
    import psutil

    for _ in range(3):  # the boot time both reads use must be the same (the clock may step between)
        try:
            boot = psutil.boot_time()
            created = psutil.Process(target).create_time()
        except (psutil.Error, OSError, ValueError):
            return None
        if psutil.boot_time() == boot:
            return round((created - boot) * _CLK_TCK)
    return None


def process_spawn_time(pid: int | str = "self") -> float | None:
    """Wall-clock time at which a process started, to 10 ms (for the ``spawned`` phase stamp).

    psutil's ``create_time()`` adds /proc/stat's ``btime`` (whole seconds), so it can be up to 1 s
    off; the start ticks are converted with the boot-time clock read now instead.
    """
    ticks = process_start_ticks(pid)
    if ticks is None:
        return None
    try:
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / _CLK_TCK)
    except (OSError, ValueError, AttributeError):
        return None


def cmdline(pid: int) -> list[str]:
    """A process's command line, one item per argument; [] if it is gone, a zombie or not readable."""
    import psutil

    try:
        return psutil.Process(pid).cmdline()
    except (psutil.Error, OSError, ValueError):
        return []


def fast_exit(code: int) -> None:
    """Exit like ``sys.exit`` (atexit handlers run, stdout/stderr flushed) but skip the
    interpreter's teardown of modules and objects: with torch imported that teardown takes
    ~0.4 s and does nothing a finished process needs."""
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or broken stream must not block the exit
                pass
        os._exit(code)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` in the process tree, each parent before its children (zombies
    included: they are still in the tree until reaped). [] if ``pid`` is gone."""
    import psutil

    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except (psutil.Error, ValueError):
        return []


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie is dead for our purposes)."""
    import psutil

    if pid <= 0:
        return False
    try:
        return _running(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _running(proc: psutil.Process) -> bool:
    """Still the same process (not a reused pid), and not a zombie."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # ZombieProcess included
        return False
    except psutil.AccessDenied:
        return True


def _processes(pids: list[int]) -> list[psutil.Process]:
    """The live processes among ``pids``, each looked up once (so a later reuse of its pid is seen)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except (psutil.NoSuchProcess, ValueError):  # gone (or never a pid)
            pass
        except psutil.AccessDenied as exc:  # another user's process, hidden by /proc's hidepid
            raise PermissionError(f"not allowed to inspect pid {pid}") from exc
    return procs


def stage_worker_pids(stage_dir: str | Path) -> dict[int, int]:
    """Rank -> pid of the stage's workers still alive on this machine: read from their progress
    beacons, each checked against the start time the beacon recorded (a reused pid has another)."""
    stage = Path(stage_dir)
    pids = {}
    for beacon in (stage / "progress").glob("rank*.json"):
        data = read_json(beacon) or {}
        if beacon_process_alive(data):
            pids[int(beacon.stem[len("rank"):])] = data["pid"]
    return pids


def beacon_process_alive(beacon: Mapping[str, Any]) -> bool:
    """Whether the process a beacon names still runs: its ``pid`` with the start time it recorded
    (``pid_start``: a reused pid has another), not a zombie, and not this process."""
    pid, started = beacon.get("pid"), beacon.get("pid_start")
    # the start time first: a rank that is gone (the usual case) is told without psutil
    if not isinstance(pid, int) or pid == os.getpid() or started is None or process_start_ticks(pid) != started:
        return False
    return pid_alive(pid)


def kill_now(pids: list[int], wait_s: float = 5.0) -> None:
    """SIGKILL each pid (already gone is fine) and wait up to ``wait_s`` for them to vanish."""
    import psutil

    procs = _processes(pids)
    for proc in procs:
        try:
            proc.kill()  # psutil checks first that the pid is still the process we looked up
        except psutil.NoSuchProcess:
            pass
        except psutil.AccessDenied as exc:  # as os.kill would: another user's process
            raise PermissionError(f"not allowed to kill pid {proc.pid}") from exc
    _wait_gone(procs, wait_s)


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until the processes exit; return those still alive at the deadline.

    A zombie counts as gone, and a pid reused by a new process after ours exited too. Nothing is
    reaped: unlike ``psutil.wait_procs`` (which ``waitpid``s our own children) this leaves a
    child's exit status to whoever holds its ``Popen``."""
    return _wait_gone(_processes(pids), timeout_s)


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if _running(p)]
    return [p.pid for p in alive]


def signal_name(returncode: int | None) -> str | None:
    """'SIGKILL' for a return code of -9 (or 137 from a shell), else None."""
    if returncode is None:
        return None
    num = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    try:
        return signal.Signals(num).name if num > 0 else None
    except ValueError:
        return None


def _cgroup_event_files() -> list[str]:
    """This process's own cgroup first (v2 ``0::/path``; v1 ``N:memory:/path``), then the root."""
    files = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            rel = rel.strip("/")
            if controllers == "":
                files.append(str(Path("/sys/fs/cgroup", rel, "memory.events")))
            elif "memory" in controllers.split(","):
                files.append(str(Path("/sys/fs/cgroup/memory", rel, "memory.oom_control")))
    except (OSError, ValueError):
        pass
    return [*files, "/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"]


def oom_kill_count(files: list[str] | None = None) -> int | None:
    """The cgroup's count of out-of-memory kills, to tell an OOM kill from another SIGKILL.

    Counted over the agent's own cgroup (hierarchical in cgroup v2, so it covers its workers)."""
    for events in files if files is not None else _cgroup_event_files():
        try:
            for line in Path(events).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def signal_group(pid: int, sig: int) -> None:
    """Signal a process group (a child started with ``start_new_session``); gone is fine."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(procs: list[Any], grace_s: float) -> None:
    """SIGTERM each child's process group, wait up to ``grace_s`` in all, then SIGKILL the groups
    of those still running and reap them (``procs``: ``subprocess.Popen`` objects)."""
    for proc in procs:
        signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
