"""The host side of gpulaunch's SSH transport: ``python -m launcher.runtime.hostagent CMD`` on a node.

Standard library plus the light runtime modules (device discovery, process helpers): it runs on
every remote host, before and around the ranks, and never imports the control side.

- ``agent``: the wrapper around one torchrun agent. It reads the node's env as one JSON line on
  stdin (so no secret is on a command line), starts the agent in its own session, and then
  watches stdin. stdin is the lifeline: the launcher keeps the pipe open for the whole run, so
  EOF means the launcher stopped the node, was killed, or lost the connection. On EOF (or
  SIGTERM/SIGHUP) the wrapper stops the agent (SIGTERM, then SIGKILL after a grace period),
  kills any rank still alive by pid and exits; the agent dies with the wrapper too (the agent's
  parent-death signal). No pseudo-terminal (``-T``) is needed for any of this.
- ``preflight`` / ``free-port`` / ``prepare`` / ``fetch``: one JSON line each, for the checks
  before a start, the rendezvous port, the stage directory and ``worker.json`` on the host, and
  fetching the per-rank reports back into the launching host's run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from launcher.protocol import ENV_PARENT_PID, HOST_ANSWER_TAG, StagePaths

REMOTE_GRACE_S = 5.0  # the wrapper's SIGTERM -> SIGKILL grace for the agent and its ranks




def _answer(data: dict[str, Any]) -> int:
    sys.stdout.write(HOST_ANSWER_TAG + json.dumps(data) + "\n")
    sys.stdout.flush()
    return 0


def _try_bind(address: str | None) -> tuple[int | None, str | None]:
    import socket

    host = address or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind(sockaddr[:1] + (0,) + tuple(sockaddr[2:]))
            return sock.getsockname()[1], None
    except OSError as exc:
        return None, f"{type(exc).__name__}: {exc.strerror or exc}"


def _cmd_preflight(args: argparse.Namespace) -> int:
    import platform
    import socket
    from importlib.metadata import PackageNotFoundError, version

    from launcher.runtime.devices import discover

    try:
        torch_version: str | None = version("torch")
    except PackageNotFoundError:
        torch_version = None
    try:
        interfaces = sorted(name for _, name in socket.if_nameindex())
    except OSError:
        interfaces = []
    data: dict[str, Any] = {
        "inventory": json.loads(discover(visible_override=args.visible_devices).to_json()),
        "torch": torch_version,
        "python": platform.python_version(),
        "interfaces": interfaces,
        "ifname_present": args.ifname in interfaces if args.ifname else None,
    }
    if args.bind:
        data["port"], data["bind_error"] = _try_bind(args.bind)
    return _answer(data)


def _cmd_free_port(args: argparse.Namespace) -> int:
    port, error = _try_bind(args.bind)
    return _answer({"port": port, "bind_error": error})


def _cmd_prepare(args: argparse.Namespace) -> int:
    from launcher.procutil import write_json_atomic

    stage = Path(args.stage)
    try:
        stage.mkdir(parents=True, exist_ok=True)
        config = json.loads(sys.stdin.read())
        paths = StagePaths(stage)
        write_json_atomic(paths.worker_config, config)
        for folder in (paths.reports, paths.progress_dir):  # a restart must not see the last attempt's files
            for old in folder.glob("rank*.json"):
                old.unlink(missing_ok=True)
    except (OSError, ValueError) as exc:
        return _answer({"error": f"{type(exc).__name__}: {exc}"})
    return _answer({"stage": str(stage)})


def _cmd_fetch(args: argparse.Namespace) -> int:
    paths = StagePaths(Path(args.stage))
    files = {}
    for rank in (int(r) for r in args.ranks.split(",") if r):
        for path in (paths.report(rank), paths.progress(rank)):
            try:
                files[str(path.relative_to(paths.root))] = path.read_text()
            except OSError:
                continue
    return _answer({"files": files})


class _Lifeline:
    """Set when the launcher closes our stdin or a stop signal arrives."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reason = ""

    def cut(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.event.set()

    def watch(self, fd: int) -> None:
        def run() -> None:
            try:
                while os.read(fd, 4096):
                    pass  # anything after the env line is ignored (room for heartbeats)
            except OSError:
                pass
            self.cut("the launcher closed the connection")

        threading.Thread(target=run, daemon=True, name="gpulaunch-lifeline").start()


def _teardown(proc: subprocess.Popen, stage: Path, grace_s: float) -> None:
    from launcher.procutil import kill_now, stage_worker_pids

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass
    # Ranks die with their agent (parent-death signal); any that did not are found by pid.
    kill_now(list(stage_worker_pids(stage).values()))


def _read_line(fd: int) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        line += chunk
    return line


def _cmd_agent(args: argparse.Namespace) -> int:
    from launcher.procutil import die_with_parent

    die_with_parent(signal.SIGTERM)  # sshd's session process gone: same as a cut lifeline
    lifeline = _Lifeline()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: lifeline.cut(signal.Signals(signum).name))
    first = _read_line(0)  # unbuffered: the lifeline thread reads the same fd afterwards
    if not first:
        return 143  # the launcher went away before the start
    node_env = json.loads(first).get("env", {})
    if args.cwd and os.path.isdir(args.cwd):
        os.chdir(args.cwd)
    env = {**os.environ, **node_env, ENV_PARENT_PID: str(os.getpid())}
    argv = list(args.command[1:] if args.command[:1] == ["--"] else args.command)
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    lifeline.watch(0)
    while proc.poll() is None and not lifeline.event.wait(0.1):
        pass
    if proc.poll() is None:
        _teardown(proc, Path(args.stage), args.grace_s)
        try:
            print(f"gpulaunch: stopped the torchrun agent ({lifeline.reason})", flush=True)
        except OSError:
            pass
        return 143
    code = proc.returncode
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.runtime.hostagent", description="gpulaunch's host-side helper (run over SSH)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("preflight")
    p.add_argument("--ifname")
    p.add_argument("--bind")
    p.add_argument("--visible-devices")
    p = sub.add_parser("free-port")
    p.add_argument("--bind")
    p = sub.add_parser("prepare")
    p.add_argument("--stage", required=True)
    p = sub.add_parser("fetch")
    p.add_argument("--stage", required=True)
    p.add_argument("--ranks", default="")
    p = sub.add_parser("agent")
    p.add_argument("--stage", required=True)
    p.add_argument("--cwd")
    p.add_argument("--grace-s", type=float, default=REMOTE_GRACE_S)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    handler = {
        "preflight": _cmd_preflight,
        "free-port": _cmd_free_port,
        "prepare": _cmd_prepare,
        "fetch": _cmd_fetch,
        "agent": _cmd_agent,
    }[args.cmd]
    return handler(args)


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    os._exit(status)  # never wait at shutdown for the lifeline thread blocked in read()
