"""The host side of gpulaunch's SSH transport: ``python -m launcher.runtime.hostagent CMD`` on a node.

Standard library plus the light runtime modules (device discovery, process helpers): it runs on
every remote host, before and around the ranks, and never imports the control side.

- ``serve``: the host's helper for a whole run, on the one SSH connection the launcher opens to
  the host (the connection's first session; the agents' sessions share it, multiplexed). It
  answers requests (one JSON line each on stdin: ``preflight``, ``free-port``, ``prepare``,
  ``fetch``, ``signal``, ``evidence``, and the network check's ``net-listen`` and ``net-ring``,
  see ``launcher.runtime.linkprobe``) with one tagged JSON line each on stdout, one request at a
  time (``net-ring`` holds the loop for its seconds), and writes a heartbeat line every second,
  by which the launcher tells a live host from a lost one. It exits when the launcher closes its
  stdin, or says nothing (requests or pings) for ``--silence-s`` seconds.
- ``agent``: the wrapper around one torchrun agent. It reads one JSON line on stdin (the node's
  env, so no secret is on a command line, and the node's ranks), starts the agent in its own
  session, and then watches stdin. stdin is the lifeline: the launcher keeps the pipe open for
  the whole stage and writes a ping on it every second, so EOF, or ``--silence-s`` seconds
  without a ping, means the launcher stopped the node, was killed, or lost the connection. Then
  (or on SIGTERM/SIGHUP) the wrapper stops the agent (SIGTERM, then SIGKILL after a grace
  period), kills any rank still alive by pid, writes a ``stopped`` report with the phases it saw
  in the beacon of each rank that wrote none, forwards every rank's report on its output (the
  stage's live channel: the agent that forwarded the rest is gone) and exits; the agent dies with
  the wrapper too (the agent's parent-death signal). Before it forwards them, each rank that is
  gone gets its exact step count in its beacon from its step counter
  (``launcher.runtime.stepcount``), as ``fetch`` does too. No pseudo-terminal (``-T``) is needed for
  any of this. While the agent runs, the agent itself forwards its ranks' beacons and reports.
- ``preflight`` / ``free-port`` / ``prepare`` / ``fetch``: the same requests as one command each
  (one JSON line out), for a look by hand over a plain ``ssh``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from launcher.protocol import ENV_PARENT_PID, HOST_ANSWER_TAG, RankReport, RankStatus, StagePaths
from launcher.runtime.forwarder import RankForwarder, print_line

REMOTE_GRACE_S = 5.0  # the wrapper's SIGTERM -> SIGKILL grace for the agent and its ranks
BEAT_S = 1.0  # how often the helper says it is alive, and the launcher pings back
SILENCE_S = 5.0  # default: how long either side waits without a word before it gives the other up
BEAT_LINE = "gpulaunch-beat"  # the helper's heartbeat, one line on stdout
BEACON_POLL_S = 0.1  # how often the wrapper reads its ranks' progress beacons


# ---------------------------------------------------------------------------------- the requests


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


def torch_version() -> str | None:
    """The version of the torch this interpreter would import, from its distribution's folder name
    on ``sys.path`` (``torch-2.13.0+cpu.dist-info``), found as ``importlib.metadata`` finds it:
    without importing that package, whose import is a third of a login's cost on the host."""
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            for suffix in (".dist-info", ".egg-info"):
                if name.startswith("torch-") and name.endswith(suffix):
                    return name[len("torch-") : -len(suffix)]
    return None


def do_preflight(ifname: str | None = None, bind: str | None = None, visible_devices: str | None = None) -> dict[str, Any]:
    import platform
    import socket

    from launcher.hardware.devices import discover

    try:
        interfaces = sorted(name for _, name in socket.if_nameindex())
    except OSError:
        interfaces = []
    data: dict[str, Any] = {
        "inventory": json.loads(discover(visible_override=visible_devices).to_json()),
        "torch": torch_version(),
        "python": platform.python_version(),
        "interfaces": interfaces,
        "ifname_present": ifname in interfaces if ifname else None,
    }
    if bind:
        data["port"], data["bind_error"] = _try_bind(bind)
    return data


def do_free_port(bind: str | None = None) -> dict[str, Any]:
    port, error = _try_bind(bind)
    return {"port": port, "bind_error": error}


def do_prepare(stage: str, config: str) -> dict[str, Any]:
    """The stage directory and ``worker.json``; a restart must not see the last attempt's files."""
    from launcher.procutil import write_json_atomic

    try:
        paths = StagePaths(Path(stage))
        paths.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(paths.worker_config, json.loads(config))
        for folder, pattern in ((paths.reports, "rank*.json"), (paths.progress_dir, "rank*.json"), (paths.progress_dir, "rank*.steps")):
            for old in folder.glob(pattern):
                old.unlink(missing_ok=True)
    except (OSError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"stage": stage}


def do_signal(stage: str, signum: int) -> dict[str, Any]:
    """``signum`` to every live rank of the stage on this host (found by its beacon's pid and start
    time): SIGUSR1 makes each dump its stacks into its log."""
    from launcher.procutil import stage_worker_pids

    sent = []
    for rank, pid in stage_worker_pids(stage).items():
        try:
            os.kill(pid, int(signum))
            sent.append(rank)
        except (ProcessLookupError, PermissionError):
            continue
    return {"ranks": sorted(sent)}


def do_evidence(stage: str, host: str, ranks: list[int]) -> dict[str, Any]:
    """A stalled stage's evidence from this host's ranks (``launcher.runtime.hangdump``)."""
    from launcher.runtime.hangdump import gather_as_dicts

    return {"evidence": gather_as_dicts(stage, host, ranks)}


def do_fetch(stage: str, ranks: list[int]) -> dict[str, Any]:
    """The reports and beacons of ``ranks``; a beacon of a rank that is gone with its count behind
    its step counter's is settled first (``launcher.runtime.stepcount``): the count is exact."""
    paths = StagePaths(Path(stage))
    _settle_steps(paths, ranks)
    files = {}
    for rank in ranks:
        for path in (paths.report(rank), paths.progress(rank)):
            try:
                files[str(path.relative_to(paths.root))] = path.read_text()
            except OSError:
                continue
    return {"files": files}


def do_net_listen(bind: str, for_s: float) -> dict[str, Any]:
    """The network check's listener on this host (``launcher.runtime.linkprobe``), for ``for_s`` s."""
    from launcher.runtime.linkprobe import listen_request

    return listen_request(bind, for_s)


def do_net_ring(peers: list[list[Any]], send_s: float, max_mb: float, **timing: Any) -> dict[str, Any]:
    """This host's links to ``peers`` (``[name, address, port]``), measured one after the other."""
    from launcher.runtime.linkprobe import ring_request

    return ring_request(peers, send_s, max_mb, **timing)


REQUESTS: dict[str, Callable[..., dict[str, Any]]] = {
    "preflight": do_preflight,
    "free-port": do_free_port,
    "prepare": do_prepare,
    "fetch": do_fetch,
    "signal": do_signal,
    "evidence": do_evidence,
    "net-listen": do_net_listen,
    "net-ring": do_net_ring,
}


def _answer(data: dict[str, Any]) -> int:
    sys.stdout.write(HOST_ANSWER_TAG + json.dumps(data) + "\n")
    sys.stdout.flush()
    return 0


# ------------------------------------------------------------------------------------ the helper


class _Out:
    """stdout shared by the request loop and the heartbeat thread: whole lines only."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def line(self, text: str) -> bool:
        with self._lock:
            try:
                sys.stdout.write(text + "\n")
                sys.stdout.flush()
                return True
            except (OSError, ValueError):
                return False


def _handle(request: dict[str, Any]) -> dict[str, Any]:
    handler = REQUESTS.get(str(request.get("cmd")))
    if handler is None:
        return {"error": f"unknown request {request.get('cmd')!r}"}
    try:
        return handler(**(request.get("args") or {}))
    except Exception as exc:  # noqa: BLE001 - one bad request must not end the host's helper
        return {"error": f"{type(exc).__name__}: {exc}"}


def _cmd_serve(args: argparse.Namespace) -> int:
    from launcher.procutil import die_with_parent

    die_with_parent(signal.SIGTERM)  # sshd's session process gone: the launcher is gone
    out = _Out()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(args.beat_s):
            if not out.line(BEAT_LINE):
                stop.set()

    threading.Thread(target=beat, daemon=True, name="gpulaunch-beat").start()
    out.line(BEAT_LINE)  # at once: the launcher counts silence from here
    heard, buffer = time.monotonic(), b""
    while not stop.is_set():
        ready, _, _ = select.select([0], [], [], min(0.5, args.silence_s))
        if not ready:
            if time.monotonic() - heard > args.silence_s:
                return 3  # the launcher is gone or cut off: nothing here outlives it
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return 0  # the launcher closed the connection: the run is over
        heard = time.monotonic()
        buffer += chunk
        while b"\n" in buffer:
            raw, buffer = buffer.split(b"\n", 1)
            if not raw.strip():
                continue  # a ping
            try:
                request = json.loads(raw)
            except ValueError:
                continue
            answer = _handle(request)
            out.line(HOST_ANSWER_TAG + json.dumps({**answer, "id": request.get("id")}))
    return 0


# ----------------------------------------------------------------------------------- the wrapper


class _Lifeline:
    """Set when the launcher closes our stdin, stops pinging it, or a stop signal arrives."""

    def __init__(self, silence_s: float) -> None:
        self.event = threading.Event()
        self.reason = ""
        self.silence_s = silence_s
        self.heard = time.monotonic()

    def cut(self, reason: str) -> None:
        self.reason = self.reason or reason
        self.event.set()

    def watch(self, fd: int) -> None:
        def run() -> None:
            try:
                while os.read(fd, 4096):
                    self.heard = time.monotonic()  # a ping (anything after the first line)
            except OSError:
                pass
            self.cut("the launcher closed the connection")

        threading.Thread(target=run, daemon=True, name="gpulaunch-lifeline").start()

    def wait(self, timeout_s: float) -> bool:
        if self.event.wait(timeout_s):
            return True
        if time.monotonic() - self.heard > self.silence_s:
            self.cut(f"no word from the launcher for {self.silence_s:g} s")
        return self.event.is_set()


# A beacon's phase, and the report's stamp that its start marks: a rank that reports "rendezvous"
# has imported its code, "pg_init" has joined the group, "running" has it initialised. A script
# goes from "importing" straight to "running" (it joins the group inside its own run).
_PHASE_STAMPS = (("rendezvous", "imported"), ("pg_init", "joined"), ("running", "pg_ready"))
_SCRIPT_STAMPS = (("running", "imported"),)
_PHASE_ORDER = ("starting", "importing", "rendezvous", "pg_init", "running", "finished", "failed")


class _Beacons:
    """What the wrapper saw of its ranks' progress beacons: the stamps of the phases they reached,
    for a rank that is stopped before it writes its own report. A stamp is the beacon's own time
    when its phase first shows (read every 0.1 s; a phase passed between two reads gets the next
    one's time); ``spawned`` is the process's start, read the way the rank reads it."""

    def __init__(self, paths: StagePaths, slots: list[dict[str, Any]]) -> None:
        from launcher.procutil import read_json

        self.paths = paths
        self.slots = {int(s["rank"]): s for s in slots}
        config = read_json(paths.worker_config)
        self.phase_stamps = _SCRIPT_STAMPS if isinstance(config, dict) and not config.get("entrypoint") else _PHASE_STAMPS
        self.stamps: dict[int, dict[str, float]] = {rank: {} for rank in self.slots}
        self.last: dict[int, str] = {}

    def read(self) -> None:
        from launcher.procutil import process_spawn_time, read_json

        for rank, stamps in self.stamps.items():
            data = read_json(self.paths.progress(rank))
            if not isinstance(data, dict) or not isinstance(data.get("t"), (int, float)) or data.get("phase") not in _PHASE_ORDER:
                continue
            phase, t = data["phase"], float(data["t"])
            if "started" not in stamps and phase in ("starting", "importing"):
                stamps["started"] = t
                spawned = process_spawn_time(int(data["pid"])) if isinstance(data.get("pid"), int) else None
                stamps["spawned"] = spawned if spawned is not None else t
            if "started" in stamps:  # seen from its start: later phases can be dated
                for name, stamp in self.phase_stamps:
                    if _PHASE_ORDER.index(phase) >= _PHASE_ORDER.index(name):
                        stamps.setdefault(stamp, t)
            if isinstance(data.get("phases"), dict):  # the rank's own stamps (RankProgress.phases), exact
                stamps.update({k: float(v) for k, v in data["phases"].items() if isinstance(v, (int, float))})
            self.last[rank] = phase

    def write_stopped(self) -> None:
        """A ``stopped`` report, with the phases seen, for each rank that wrote none."""
        from launcher.procutil import write_json_atomic

        for rank, slot in self.slots.items():
            path = self.paths.report(rank)
            if path.exists():
                continue
            report = RankReport(
                rank=rank,
                local_rank=int(slot["local_rank"]),
                node_rank=int(slot["node_rank"]),
                world_size=int(slot["world_size"]),
                host=str(slot["host"]),
                device=str(slot["device"]),
                status=RankStatus.STOPPED,
                phases=dict(self.stamps[rank]),
                last_phase=self.last.get(rank),
            )
            try:
                write_json_atomic(path, report.to_dict())
            except OSError:
                continue


def _settle_steps(paths: StagePaths, ranks: Any) -> dict[int, int]:
    """Each gone rank's exact step count into its beacon (best effort: see ``stepcount.settle``)."""
    from launcher.runtime.stepcount import settle

    try:
        return settle(paths, ranks)
    except Exception:  # noqa: BLE001 - the beacons say what they said
        return {}


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
    lifeline = _Lifeline(args.silence_s)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: lifeline.cut(signal.Signals(signum).name))
    first = _read_line(0)  # unbuffered: the lifeline thread reads the same fd afterwards
    if not first:
        return 143  # the launcher went away before the start
    start = json.loads(first)
    node_env = start.get("env", {})
    if args.cwd and os.path.isdir(args.cwd):
        os.chdir(args.cwd)
    env = {**os.environ, **node_env, ENV_PARENT_PID: str(os.getpid())}
    argv = list(args.command[1:] if args.command[:1] == ["--"] else args.command)
    beacons = _Beacons(StagePaths(Path(args.stage)), list(start.get("ranks") or []))
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    lifeline.heard = time.monotonic()  # silence counts from the start, not from our own start-up
    lifeline.watch(0)
    while proc.poll() is None and not lifeline.wait(BEACON_POLL_S):
        beacons.read()
    if proc.poll() is None:
        beacons.read()
        _teardown(proc, Path(args.stage), args.grace_s)
        _settle_steps(beacons.paths, beacons.slots)  # the ranks are gone: their exact step counts
        beacons.write_stopped()
        RankForwarder(beacons.paths, beacons.slots, print_line).sweep()  # the agent forwarded the rest, if it could
        print_line(f"gpulaunch: stopped the torchrun agent ({lifeline.reason})")
        return 143
    if _settle_steps(beacons.paths, beacons.slots):  # the agent did not (it died before its last sweep)
        RankForwarder(beacons.paths, beacons.slots, print_line).sweep()
    code = proc.returncode
    return 128 - code if code < 0 else code


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.runtime.hostagent", description="gpulaunch's host-side helper (run over SSH)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--silence-s", type=float, default=SILENCE_S)
    p.add_argument("--beat-s", type=float, default=BEAT_S)
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
    p.add_argument("--silence-s", type=float, default=SILENCE_S)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.cmd == "serve":
        return _cmd_serve(args)
    if args.cmd == "agent":
        return _cmd_agent(args)
    if args.cmd == "preflight":
        return _answer(do_preflight(args.ifname, args.bind, args.visible_devices))
    if args.cmd == "free-port":
        return _answer(do_free_port(args.bind))
    if args.cmd == "prepare":
        return _answer(do_prepare(args.stage, sys.stdin.read()))
    return _answer(do_fetch(args.stage, [int(r) for r in args.ranks.split(",") if r]))


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    os._exit(status)  # never wait at shutdown for the lifeline thread blocked in read()
