"""Shared helpers for the benchmarks: statistics, the machine's description, child processes
(started in their own session, always reaped and, on a timeout, killed by pid) and JSON output.

Standard library and psutil only (the process table), so importing it costs nothing measurable.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import psutil

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BIN = Path(sys.executable).parent  # the venv's console scripts: launch, torchrun, ray


def tool(name: str) -> str:
    """A console script of this Python's environment (falls back to PATH)."""
    local = BIN / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def launch_cli() -> list[str]:
    """The ``launch`` command as a user types it where the package is installed; where it is not
    (the GPU machine: the launcher on PYTHONPATH, no console script) the same CLI as a module."""
    local = BIN / "launch"
    found = str(local) if local.exists() else shutil.which("launch")
    return [found] if found else [sys.executable, "-m", "launcher"]


def bench_env(extra: Mapping[str, str] | None = None, *, pythonpath: str | None = None) -> dict[str, str]:
    """The children's environment: the repository on PYTHONPATH (so ``benchmarks.*`` entrypoints
    import from any working directory), optionally another checkout in front of it."""
    env = dict(os.environ)
    paths = [p for p in (pythonpath, str(REPO), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("PYTHONPROFILEIMPORTTIME", None)
    env.update(extra or {})
    return env


@dataclass
class Completed:
    argv: list[str]
    rc: int
    wall_s: float
    t_start: float  # time.time() just before the spawn
    t_end: float
    output: str
    timed_out: bool = False


def run_timed(argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout_s: float = 300,
              cwd: str | Path = REPO, capture: bool = True) -> Completed:
    """Run a command from spawn to exit (wall clock). The child gets its own session; on a timeout
    its whole process group is killed by the child's pid, then the child is reaped."""
    t_start = time.time()
    p0 = time.perf_counter()
    proc = subprocess.Popen(
        list(argv), cwd=cwd, env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if capture else subprocess.DEVNULL, stderr=subprocess.STDOUT if capture else subprocess.DEVNULL,
        start_new_session=True, text=True,
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(proc.pid)
        out, _ = proc.communicate()
    except BaseException:
        kill_group(proc.pid)
        proc.wait()
        raise
    wall = time.perf_counter() - p0
    kill_group(proc.pid)  # anything left in the child's process group (there should be nothing)
    kill_session(proc.pid)  # ... or in its session
    return Completed(list(argv), proc.returncode, wall, t_start, t_start + wall, out or "", timed_out)


def private_prom_sd_dir() -> None:
    """Point the launcher's Prometheus discovery files (``GPULAUNCH_PROM_SD_DIR``) at a temporary
    folder of this process unless the caller chose one: a benchmark's runs never announce
    themselves to a real Prometheus, and the folder goes when the benchmark ends."""
    if os.environ.get("GPULAUNCH_PROM_SD_DIR"):
        return
    import atexit
    import tempfile

    folder = tempfile.mkdtemp(prefix="gl-sd-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["GPULAUNCH_PROM_SD_DIR"] = folder


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (a child started with start_new_session=True)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def summary(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, spread (min, max, interquartile range) and count; None values are dropped."""
    xs = sorted(float(v) for v in values if v is not None)
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "iqr": None, "values": []}
    if len(xs) >= 2:
        q = statistics.quantiles(xs, n=4, method="inclusive")
        iqr = q[2] - q[0]
    else:
        iqr = 0.0
    return {
        "n": len(xs),
        "median": round(statistics.median(xs), 6),
        "min": round(xs[0], 6),
        "max": round(xs[-1], 6),
        "iqr": round(iqr, 6),
        "values": [round(v, 6) for v in values if v is not None],
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else round(a / b, 4)


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def gpu_names() -> list[str]:
    if not has_gpu():
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def machine_info() -> dict[str, Any]:
    """What the figures were measured on (goes into every result file)."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = round(psutil.virtual_memory().total / 2**30, 1)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        commit = ""
    versions = {"python": platform.python_version()}
    for mod in ("torch", "ray"):
        try:  # metadata only: importing torch or ray here would cost seconds
            from importlib.metadata import version

            versions[mod] = version(mod)
        except Exception:  # noqa: BLE001
            versions[mod] = None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "host": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": mem_gib,
        "gpus": gpu_names(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "kernel": platform.release(),
        "git_commit": commit,
        "versions": versions,
    }


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--smoke", action="store_true", help="tiny sizes, one repetition: checks the script runs (CI)")
    mode.add_argument("--full", action="store_true", help="the recorded configuration (GPU paths when a GPU is present)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default: 1 in --smoke, more otherwise)")
    p.add_argument("--out", default=None, help="JSON output file (default: benchmarks/results/<name>.json)")
    return p


def write_result(name: str, data: dict[str, Any], out: str | None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}")
    return path


def rotate(items: Sequence[Any], k: int) -> list[Any]:
    """Order of the variants in repetition k: rotated, so no variant always runs first (warm caches)."""
    k %= max(1, len(items))
    return list(items[k:]) + list(items[:k])


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def median_range(s: dict[str, Any] | None, digits: int = 2) -> str:
    """A ``summary`` as one table cell: ``median [min..max]`` ("-" without a median)."""
    return "-" if not s or s.get("median") is None else f"{s['median']:.{digits}f} [{s['min']:.{digits}f}..{s['max']:.{digits}f}]"


def proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, session id, command line) for every live, non-zombie process."""
    table = {}
    for proc in psutil.process_iter(["pid", "ppid", "status", "cmdline"]):
        info = proc.info
        if info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            session = os.getsid(info["pid"])
        except OSError:  # gone since
            continue
        table[info["pid"]] = (info["ppid"], session, " ".join(info["cmdline"] or []))
    return table


def kill_matching(text: str, *, exclude: int | None = None) -> list[int]:
    """SIGKILL, by pid, every live process whose command line contains ``text`` (a unique temp
    directory this benchmark created, e.g. a Ray temp dir), and return their pids."""
    return _kill_where(lambda pid, _session, cmd: pid != exclude and text in cmd)


def kill_session(sid: int) -> list[int]:
    """SIGKILL, by pid, every live process of the session ``sid`` (a child started with
    start_new_session=True, so sid is the child's own pid)."""
    return _kill_where(lambda _pid, session, _cmd: session == sid)


def _kill_where(chosen: Callable[[int, int, str], bool]) -> list[int]:
    """SIGKILL every live process (never this one) for which ``chosen(pid, session, cmdline)``."""
    killed = []
    for pid, (_, session, cmd) in proc_table().items():
        if pid == os.getpid() or not chosen(pid, session, cmd):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed
