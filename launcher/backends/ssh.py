"""Remote hosts through the OpenSSH client: commands, the remote agent's lifeline, reports.

Launcher side: every remote action is ``ssh [safe options] -- HOST 'PYTHON -m
launcher.backends.ssh SUBCOMMAND ...'``, the remote command built with ``shlex.join`` so that no
spec value is ever parsed by a shell (spec values travel in ``worker.json`` and on stdin).

Host side (``python -m launcher.backends.ssh``), standard library plus light launcher modules:

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
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

MODULE = "launcher.backends.ssh"
JSON_TAG = "gpulaunch-ssh-json: "
SERVER_ALIVE_INTERVAL_S = 5
SERVER_ALIVE_COUNT_MAX = 3
REMOTE_GRACE_S = 5.0  # the wrapper's SIGTERM -> SIGKILL grace for the agent and its ranks
EXIT_SSH_ERROR = 255  # what ssh exits with when it cannot connect or authenticate


class SshError(Exception):
    """A remote action failed; the message says what, without the host (callers add it)."""


# ------------------------------------------------------------------------------ launcher side


def _local_path(path: str | None) -> str | None:
    return None if path is None or path == "none" else os.path.expanduser(path)


def ssh_base_argv(host: Any) -> list[str]:
    """``ssh`` with the options every launcher connection uses, up to the destination."""
    argv = [
        "ssh",
        "-T",  # no pseudo-terminal: teardown goes through the wrapper's stdin lifeline
        "-x",  # no X11 forwarding
        "-a",  # no agent forwarding
        "-o", "BatchMode=yes",  # never prompt for a password or passphrase
        "-o", f"StrictHostKeyChecking={host.strict_host_key_checking}",
        "-o", f"ConnectTimeout={host.connect_timeout_s}",
        "-o", f"ServerAliveInterval={SERVER_ALIVE_INTERVAL_S}",
        "-o", f"ServerAliveCountMax={SERVER_ALIVE_COUNT_MAX}",
        "-o", "LogLevel=ERROR",
    ]
    if host.ssh_config:
        argv += ["-F", host.ssh_config if host.ssh_config == "none" else _local_path(host.ssh_config)]
    if host.known_hosts:
        argv += ["-o", f"UserKnownHostsFile={_local_path(host.known_hosts)}"]
    if host.key:
        argv += ["-i", _local_path(host.key), "-o", "IdentitiesOnly=yes"]
    for key, value in host.ssh_options.items():
        argv += ["-o", f"{key}={value}"]
    argv += ["-p", str(host.port)]
    if host.user:
        argv += ["-l", host.user]
    return [*argv, "--", host.destination]


def ssh_argv(host: Any, remote_argv: Sequence[str]) -> list[str]:
    """The full ssh argv running ``remote_argv`` on ``host``; the remote shell sees one quoted string."""
    return [*ssh_base_argv(host), shlex.join(["exec", *(str(a) for a in remote_argv)])]


def remote_module_argv(host: Any, args: Sequence[str]) -> list[str]:
    return ssh_argv(host, [host.python, "-m", MODULE, *args])


def remote_agent_command(node: Any, plan: Any) -> list[str]:
    """The ssh argv that runs one node's torchrun agent under the lifeline wrapper."""
    host = node.target.ssh
    args = ["agent", "--stage", str(plan.stage_dir), "--cwd", os.getcwd(), "--grace-s", str(REMOTE_GRACE_S), "--"]
    return remote_module_argv(host, [*args, *node.argv])


def _explain_failure(host: Any, code: int, stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    last = lines[-1] if lines else f"exit code {code}"
    if code == EXIT_SSH_ERROR:
        return f"unreachable over SSH ({host.user + '@' if host.user else ''}{host.address}:{host.port}): {last}"
    if code == 127 or "No such file or directory" in last and host.python in last:
        return f"python: {host.python} not found there ({last})"
    if "No module named" in stderr and "launcher" in stderr:
        return f"gpulaunch is not installed for {host.python} there (pip install gpulaunch in that environment)"
    return f"remote command failed with exit code {code}: {last}"


def run_remote_module(host: Any, args: Sequence[str], *, timeout_s: float, stdin: bytes | None = None) -> dict[str, Any]:
    """Run ``python -m launcher.backends.ssh ARGS`` on ``host``; return its JSON answer."""
    argv = remote_module_argv(host, args)
    try:
        # its own session: a Ctrl-C at the terminal is the launcher's to handle, not this helper's
        done = subprocess.run(
            argv, input=stdin or b"", capture_output=True, timeout=timeout_s, check=False, start_new_session=True
        )
    except subprocess.TimeoutExpired:
        raise SshError(f"no answer over SSH within {timeout_s:g}s ({host.address}:{host.port})") from None
    except OSError as exc:
        raise SshError(f"cannot run the ssh client: {exc}") from None
    out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    answer = next((ln[len(JSON_TAG) :] for ln in reversed(out.splitlines()) if ln.startswith(JSON_TAG)), None)
    if done.returncode != 0 or answer is None:
        raise SshError(_explain_failure(host, done.returncode, err or out))
    data = json.loads(answer)
    if data.get("error"):
        raise SshError(data["error"])
    return data


def _remote_nodes(plan: Any) -> list[Any]:
    return [n for n in plan.nodes if n.target.ssh is not None]


def _parallel(fn: Any, items: Iterable[Any]) -> list[Any]:
    from concurrent.futures import ThreadPoolExecutor

    items = list(items)
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(items))) as pool:
        return list(pool.map(fn, items))


def prepare_remote_stages(plan: Any, timeout_s: float = 60.0) -> None:
    """Create the stage directory on every remote host and put ``worker.json`` there."""
    from launcher.errors import BackendError

    payload = plan.worker.to_json().encode()

    def prepare(node: Any) -> str | None:
        try:
            run_remote_module(node.target.ssh, ["prepare", "--stage", str(plan.stage_dir)], timeout_s=timeout_s, stdin=payload)
        except SshError as exc:
            return f"{node.host}: cannot prepare the run directory {plan.stage_dir}: {exc}"
        return None

    problems = [p for p in _parallel(prepare, _remote_nodes(plan)) if p]
    if problems:
        raise BackendError("; ".join(problems))


def send_agent_env(proc: subprocess.Popen, node: Any) -> None:
    """Hand the remote wrapper its env (one JSON line); the pipe then stays open as the lifeline."""
    assert proc.stdin is not None
    try:
        proc.stdin.write((json.dumps({"env": dict(node.env)}) + "\n").encode())
        proc.stdin.flush()
    except (BrokenPipeError, OSError):
        pass  # ssh already exited; poll() reports it


def stop_remote_agents(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """Close every lifeline at once, then wait for the ssh clients, which exit when their
    remote wrapper has stopped the agent and its ranks (it uses the same grace period)."""
    for proc in procs:
        if proc.stdin is not None and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
    deadline = time.monotonic() + grace_s + 5.0  # remote grace + SIGKILL + the way back
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass  # the caller's SIGTERM/SIGKILL path takes over


def fetch_reports(plan: Any, logs: Any = None, timeout_s: float = 60.0) -> None:
    """Copy each remote host's rank reports and progress files into the local stage directory."""
    from launcher.procutil import write_json_atomic

    def fetch(node: Any) -> None:
        ranks = [r.rank for r in plan.ranks if r.node_rank == node.node_rank]
        try:
            data = run_remote_module(
                node.target.ssh, ["fetch", "--stage", str(plan.stage_dir), "--ranks", ",".join(map(str, ranks))], timeout_s=timeout_s
            )
        except SshError as exc:
            if logs is not None:
                logs.route(f"gpulaunch: could not fetch rank reports from {node.host}: {exc}", node.host)
            return
        for rel, text in data.get("files", {}).items():
            target = Path(plan.stage_dir) / rel
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                continue
            try:
                if target.exists() and target.read_text() == text:
                    continue  # a shared filesystem: the host wrote it here already
                write_json_atomic(target, json.loads(text))
            except (OSError, ValueError):
                continue

    _parallel(fetch, _remote_nodes(plan))


# ----------------------------------------------------------------------------------- host side


def _answer(data: dict[str, Any]) -> int:
    sys.stdout.write(JSON_TAG + json.dumps(data) + "\n")
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

    from launcher.devices import discover

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
        write_json_atomic(stage / "worker.json", config)
        for sub in ("reports", "progress"):  # a restart must not see the last attempt's files
            for old in (stage / sub).glob("rank*.json"):
                old.unlink(missing_ok=True)
    except (OSError, ValueError) as exc:
        return _answer({"error": f"{type(exc).__name__}: {exc}"})
    return _answer({"stage": str(stage)})


def _cmd_fetch(args: argparse.Namespace) -> int:
    stage = Path(args.stage)
    files = {}
    for rank in (int(r) for r in args.ranks.split(",") if r):
        for sub in ("reports", "progress"):
            path = stage / sub / f"rank{rank}.json"
            try:
                files[f"{sub}/rank{rank}.json"] = path.read_text()
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
    env = {**os.environ, **node_env, "LAUNCHER_PARENT_PID": str(os.getpid())}
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
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="gpulaunch's host-side helper (run over SSH)")
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
