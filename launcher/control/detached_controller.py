"""A detached run's controller, on the cluster's controller host: ``python -m
launcher.control.detached_controller CMD``, run there over one ssh by ``launch`` (``launcher.backends.ssh.detached``).

- ``start`` (a JSON payload on stdin: the effective spec, the cluster file, where the run
  directory goes): makes ``OUT/<job>/<run-id>`` with the spec, the cluster file and a record in
  ``detached/``, starts ``run`` in a session of its own (``setsid``: it outlives the ssh session
  that started it), its output in ``controller.log``, and answers its pid and run directory.
- ``run RUN_DIR [--resume]``: the controller itself: the same ``run_job`` (or ``resume_run``) as a
  foreground ``launch``, reaching the hosts over SSH as that does, its events written as the
  remote-run wire (``launcher.stage.wire``) into its output, ``result.json``, plots and
  checkpoints in its run directory, here. SIGTERM stops the run as it stops a foreground launch.
  Its exit code goes into ``detached/exit.json``.
- ``status RUN`` / ``stop RUN`` / ``resume RUN``: one JSON line; ``follow RUN [--wait]``: the
  controller's output from its start (with ``--wait``: on until the controller has ended), then
  one end line (how it ended, ``result.json``). A follower whose ssh connection goes (its stdin
  closes) ends at once.

RUN is a run id (found through ``~/.gpulaunch/detached/<run-id>.json``, written by ``start``) or
a run directory. This module imports only the standard library (and psutil) until ``run``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from launcher.errors import EXIT_BAD_INPUT, EXIT_JOB_FAILED, EXIT_OK, LauncherError
from launcher.procutil import read_json, write_json_atomic

STATE_DIR = "detached"  # in the run directory: the controller's own files
SPEC_FILE = "spec.yaml"  # the effective spec the controller runs (secrets unmasked: 0600)
CLUSTER_FILE = "cluster.yaml"
RECORD = "controller.json"  # pid, its start time, host
EXIT_FILE = "exit.json"
SETTINGS_FILE = "settings.json"  # backend, metrics, cwd
LOG_FILE = "controller.log"  # the controller's output: the remote-run wire
REGISTRY = Path("~/.gpulaunch/detached")
END_TAG = "@gpulaunch-detached "  # the same as launcher.backends.ssh.detached.END_TAG
POLL_S = 0.2
STOP_WAIT_S = 120.0


def registry() -> Path:
    return REGISTRY.expanduser()


def run_dir_of(run: str) -> Path:
    """The run directory of ``run`` (a run id, or a run directory) on this host."""
    entry = read_json(registry() / f"{run}.json") if "/" not in run else None
    folder = Path(str(entry["run_dir"])) if isinstance(entry, dict) and "run_dir" in entry else Path(run).expanduser()
    if "/" not in run and not isinstance(entry, dict):
        raise LauncherError(f"no detached run {run!r} here (none in {registry()}); expected a run id `launch --detach` printed")
    if not (folder / STATE_DIR / RECORD).is_file():
        raise LauncherError(f"{folder}: not the run directory of a detached run (no {STATE_DIR}/{RECORD})")
    return folder


# --- the controller's process ------------------------------------------------------------------------


def _controller(folder: Path) -> dict[str, Any]:
    data = read_json(folder / STATE_DIR / RECORD)
    return data if isinstance(data, dict) else {}


def _alive(record: dict[str, Any]) -> bool:
    """Whether the recorded controller still runs (the same process: its start time matches)."""
    import psutil

    try:
        proc = psutil.Process(int(record.get("pid") or 0))
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return bool(abs(proc.create_time() - float(record.get("create_time") or 0.0)) < 1.0)
    except (psutil.Error, ValueError, TypeError):
        return False


def _spawn(folder: Path, settings: dict[str, Any], *, resume: bool) -> dict[str, Any]:
    """The controller, in a session of its own (no terminal, no ssh session holds it), its output
    appended to controller.log; its pid and start time recorded."""
    import psutil

    cwd = settings.get("cwd")
    with open(folder / LOG_FILE, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.control.detached_controller", "run", str(folder), *(("--resume",) if resume else ())],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=cwd if isinstance(cwd, str) and os.path.isdir(cwd) else None, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    record = {"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(), "host": socket.gethostname(), "started_at": time.time()}
    write_json_atomic(folder / STATE_DIR / RECORD, record)
    (folder / STATE_DIR / EXIT_FILE).unlink(missing_ok=True)
    return record


def cmd_start(payload: dict[str, Any]) -> dict[str, Any]:
    cwd = payload.get("cwd")
    if isinstance(cwd, str) and os.path.isdir(cwd):
        os.chdir(cwd)  # a relative --out is where it would be on the launching machine, where that path exists
    run_id, job = str(payload["run_id"]), str(payload["job"])
    folder = Path(str(payload.get("out") or "runs")).expanduser().resolve() / job / run_id
    try:
        (folder / STATE_DIR).mkdir(parents=True, exist_ok=False)
        fd = os.open(folder / STATE_DIR / SPEC_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # secrets unmasked: the user's only
        with os.fdopen(fd, "w") as handle:
            handle.write(str(payload["spec"]))
        (folder / "spec.yaml").write_text(str(payload["shown_spec"]))
        (folder / STATE_DIR / CLUSTER_FILE).write_text(str(payload["cluster"]))
        settings = {"backend": payload.get("backend"), "metrics": bool(payload.get("metrics", True)), "cwd": os.getcwd()}
        write_json_atomic(folder / STATE_DIR / SETTINGS_FILE, settings)
        registry().mkdir(parents=True, exist_ok=True)
        write_json_atomic(registry() / f"{run_id}.json", {"run_dir": str(folder)})
    except OSError as exc:
        raise LauncherError(f"--out {payload.get('out')}: cannot create the run directory {folder}: {exc.strerror or exc}") from None
    record = _spawn(folder, settings, resume=False)
    return {"run_id": run_id, "run_dir": str(folder), "pid": record["pid"], "host": record["host"]}


def cmd_resume(run: str) -> dict[str, Any]:
    folder = run_dir_of(run)
    if _alive(_controller(folder)):
        raise LauncherError(f"run {folder.name}: its controller still runs (pid {_controller(folder).get('pid')}); launch attach it, or launch stop it first")
    settings = read_json(folder / STATE_DIR / SETTINGS_FILE) or {}
    record = _spawn(folder, settings, resume=True)
    return {"run_id": folder.name, "run_dir": str(folder), "pid": record["pid"], "host": record["host"]}


def cmd_status(run: str, probe: str | None = None) -> dict[str, Any]:
    folder = run_dir_of(run)
    if probe:  # launch fetch: tells a shared filesystem from a copy
        (folder / STATE_DIR / "fetch-probe").write_text(probe)
    record = _controller(folder)
    alive = _alive(record)
    ended = read_json(folder / STATE_DIR / EXIT_FILE)
    result = read_json(folder / "result.json")
    status = result.get("status") if isinstance(result, dict) else None
    data: dict[str, Any] = {"run_id": folder.name, "job": folder.parent.name, "run_dir": str(folder), "pid": record.get("pid"), "alive": alive}
    if alive:
        data.update(state="RUNNING", message=f"its controller runs (pid {record.get('pid')})")
    elif isinstance(ended, dict):
        data.update(state=str(status or "ended").upper(), exit_code=ended.get("exit_code"), message=f"ended with exit code {ended.get('exit_code')}")
    else:
        data.update(state="LOST", exit_code=EXIT_JOB_FAILED,
                    message=f"the controller (pid {record.get('pid')}) ended without its result (killed?); launch resume continues the run")  # fmt: skip
    return data


def cmd_stop(run: str, wait_s: float) -> dict[str, Any]:
    """SIGTERM to the controller, which stops the run on every host and writes its result; a
    second SIGTERM (stop at once: the hosts' lifelines take their ranks) if it is still there
    after ``wait_s``."""
    folder = run_dir_of(run)
    record = _controller(folder)
    for signum, wait in ((signal.SIGTERM, wait_s), (signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        if not _alive(record):
            break
        try:
            os.kill(int(record["pid"]), signum)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while _alive(record) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    return cmd_status(run)


def cmd_follow(run: str, wait: bool) -> int:
    """controller.log from its start (with ``wait``: until the controller has ended), then the end
    line. Ends at once when stdin closes (the ssh connection went)."""
    folder = run_dir_of(run)
    record = _controller(folder)
    out = sys.stdout
    pending = b""
    with open(folder / LOG_FILE, "rb") as log:
        while True:
            alive = _alive(record)  # before reading: what it wrote before it ended is read below
            chunk = log.read()
            if chunk:
                pending += chunk
                *whole, pending = pending.split(b"\n")
                for raw in whole:
                    out.write(raw.decode(errors="replace") + "\n")
                out.flush()
            if not wait or not alive:
                break
            if _stdin_closed(POLL_S):
                return EXIT_OK
    if pending:
        out.write(pending.decode(errors="replace") + "\n")
    status = cmd_status(run)
    result = read_json(folder / "result.json")
    fresh = isinstance(result, dict) and float(result.get("finished_at") or 0) >= float(record.get("started_at") or 0)
    status["result"] = result if fresh else None
    out.write(END_TAG + json.dumps(status, default=str) + "\n")
    out.flush()
    return EXIT_OK


def _stdin_closed(timeout_s: float) -> bool:
    try:
        ready, _, _ = select.select([sys.stdin], [], [], timeout_s)
    except (OSError, ValueError):
        time.sleep(timeout_s)
        return False
    if not ready:
        return False
    try:
        return os.read(sys.stdin.fileno(), 4096) == b""
    except OSError:
        return True


def cmd_run(folder: Path, resume: bool) -> int:
    """The controller: the run, as a foreground launch runs it, its events on the wire."""
    from launcher.control.api import resume_run, run_job
    from launcher.spec.model import load_job
    from launcher.stage.wire import WireEvents

    settings = read_json(folder / STATE_DIR / SETTINGS_FILE) or {}
    events = WireEvents()
    metrics = bool(settings.get("metrics", True))
    try:
        if resume:
            events.message(f"resuming the run in {folder} (its finished stages kept, the others from their last checkpoints)")
            result = resume_run(folder, events=events, metrics=metrics)
        else:
            job = load_job(folder / STATE_DIR / SPEC_FILE)
            backend = settings.get("backend")
            cluster = str(folder / STATE_DIR / CLUSTER_FILE)
            result = run_job(job, backend=backend if isinstance(backend, str) else None, cluster=cluster, run_dir=folder, events=events, metrics=metrics)
        code = result.exit_code
    except LauncherError as exc:
        for line in str(exc).splitlines() or ["failed"]:
            print(f"error: {line}", flush=True)
        code = exc.exit_code
    except KeyboardInterrupt:  # a second SIGTERM: stopped at once
        print("interrupted", flush=True)
        code = 130
    write_json_atomic(folder / STATE_DIR / EXIT_FILE, {"exit_code": code, "ended_at": time.time()})
    return code


def _answer(data: dict[str, Any]) -> int:
    print(json.dumps(data, default=str), flush=True)
    return EXIT_OK


def main(argv: Sequence[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m launcher.control.detached_controller")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("start")
    for name in ("status", "stop", "resume", "follow"):
        q = sub.add_parser(name)
        q.add_argument("run")
        if name == "status":
            q.add_argument("--probe")
        if name == "stop":
            q.add_argument("--wait-s", type=float, default=STOP_WAIT_S)
        if name == "follow":
            q.add_argument("--wait", action="store_true")
    r = sub.add_parser("run")
    r.add_argument("run_dir")
    r.add_argument("--resume", action="store_true")
    args = p.parse_args(list(argv))
    if args.cmd == "run":
        return cmd_run(Path(args.run_dir), args.resume)
    try:
        if args.cmd == "start":
            return _answer(cmd_start(json.loads(sys.stdin.read())))
        if args.cmd == "status":
            return _answer(cmd_status(args.run, args.probe))
        if args.cmd == "stop":
            return _answer(cmd_stop(args.run, args.wait_s))
        if args.cmd == "resume":
            return _answer(cmd_resume(args.run))
        return cmd_follow(args.run, args.wait)
    except LauncherError as exc:
        line = json.dumps({"error": str(exc), "exit_code": exc.exit_code})
        print(line, file=sys.stderr if args.cmd == "follow" else sys.stdout, flush=True)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
