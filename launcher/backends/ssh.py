"""The SSH transport: the torchrun backend's way to a remote host, through the OpenSSH client.

One connection per host per run. The preflight logs in to every host once, in parallel, as an
SSH ControlMaster whose own session is the host's helper (``python -m launcher.runtime.hostagent
serve``): the preflight, the rendezvous port, each stage's directory and ``worker.json``, a signal
to the stage's ranks, and the files left on the host at the end are requests to that helper, one
JSON line each way, with no new login and no new interpreter. Each stage's agent runs in a session
multiplexed over the same connection (``ssh -S SOCKET``), its stdin the agent's lifeline (see
``launcher.runtime.hostagent``) and its output the stage's live channel: rank lines, and the
beacons and reports the agent forwards. The control sockets live in a private directory (0700)
that is removed, with every master process, when the run ends (``connection_scope``).

The helper writes a heartbeat line every second and the launcher pings the helper and every
agent's lifeline every second. A host whose connection closes, or that says nothing for
``heartbeat_timeout_s`` (default 5 s), is lost: the backend stops the stage at once, names the
host, and fetches nothing from it; a host that hears nothing from the launcher for as long stops
its agent and ranks by itself.

Every remote command is built with ``shlex.join`` so that no spec value is ever parsed by a shell
(spec values travel in ``worker.json`` and on stdin).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

from launcher.backends.transports import Transport
from launcher.errors import EXIT_JOB_FAILED, BackendError, LauncherError
from launcher.procutil import pid_alive
from launcher.protocol import HOST_ANSWER_TAG, RankProgress, RankReport
from launcher.runtime.devices import NodeInventory
from launcher.runtime.hostagent import BEAT_LINE, BEAT_S, REMOTE_GRACE_S, SILENCE_S
from launcher.stage.events import RankBeacon, RankReported, StageEvent
from launcher.stage.plan import NodeTarget

if TYPE_CHECKING:
    from launcher.spec.cluster import ClusterConfig, HostConfig
    from launcher.stage.logrouting import LogRouter
    from launcher.stage.plan import NodeSlot, StagePlan

HOST_MODULE = "launcher.runtime.hostagent"
SERVER_ALIVE_INTERVAL_S = 5
SERVER_ALIVE_COUNT_MAX = 3
EXIT_SSH_ERROR = 255  # what ssh exits with when it cannot connect or authenticate, or loses the connection
REQUEST_TIMEOUT_S = 60.0  # one request to a host's helper (a slow NFS home, a slow nvidia-smi)


class SshError(Exception):
    """A remote action failed; the message says what, without the host (callers add it)."""


def heartbeat_timeout(host: Any) -> float:
    """Silence after which a host is lost (and the launcher, to the host): the cluster file's
    ``heartbeat_timeout_s`` where it has one, else ``SILENCE_S``."""
    return float(getattr(host, "heartbeat_timeout_s", None) or SILENCE_S)


# ------------------------------------------------------------------------------ the ssh command


def _local_path(path: str | None) -> str | None:
    return None if path is None or path == "none" else os.path.expanduser(path)


def ssh_base_argv(host: Any, extra: Sequence[str] = ()) -> list[str]:
    """``ssh`` with the options every launcher connection uses (and ``extra``), up to the destination."""
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
        argv += ["-F", host.ssh_config if host.ssh_config == "none" else str(_local_path(host.ssh_config))]
    if host.known_hosts:
        argv += ["-o", f"UserKnownHostsFile={_local_path(host.known_hosts)}"]
    if host.key:
        argv += ["-i", str(_local_path(host.key)), "-o", "IdentitiesOnly=yes"]
    for key, value in host.ssh_options.items():
        argv += ["-o", f"{key}={value}"]
    argv += ["-p", str(host.port)]
    if host.user:
        argv += ["-l", host.user]
    return [*argv, *extra, "--", host.destination]


def _remote(remote_argv: Sequence[str]) -> str:
    """The one string the remote shell parses: ``exec`` and every word quoted."""
    return shlex.join(["exec", *(str(a) for a in remote_argv)])


def ssh_argv(host: Any, remote_argv: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """The full ssh argv running ``remote_argv`` on ``host``; the remote shell sees one quoted string."""
    return [*ssh_base_argv(host, extra), _remote(remote_argv)]


def _agent_remote_argv(host: Any, stage_dir: Path, agent_argv: Sequence[str]) -> list[str]:
    return [
        host.python, "-m", HOST_MODULE, "agent", "--stage", str(stage_dir), "--cwd", os.getcwd(),
        "--grace-s", str(REMOTE_GRACE_S), "--silence-s", f"{heartbeat_timeout(host):g}", "--", *agent_argv,
    ]


def remote_agent_command(host: HostConfig, stage_dir: Path, agent_argv: Sequence[str]) -> list[str]:
    """The ssh argv that runs one node's torchrun agent under the lifeline wrapper, as a user
    could type it (the launcher runs the same command over the host's shared connection)."""
    return ssh_argv(host, _agent_remote_argv(host, stage_dir, agent_argv))


def _explain_failure(host: Any, code: int | None, stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    last = lines[-1] if lines else f"exit code {code}"
    if code == EXIT_SSH_ERROR:
        return f"unreachable over SSH ({host.user + '@' if host.user else ''}{host.address}:{host.port}): {last}"
    if code == 127 or "No such file or directory" in last and host.python in last:
        return f"python: {host.python} not found there ({last})"
    if "No module named" in stderr and "launcher" in stderr:
        return f"gpulaunch is not installed for {host.python} there (pip install gpulaunch in that environment)"
    return f"remote command failed with exit code {code}: {last}"


# ------------------------------------------------------------------- one connection per host


class HostLink:
    """One SSH connection to one host for a whole run: a ControlMaster whose session is the
    host's helper. Requests go to the helper; agents run in sessions multiplexed over it."""

    def __init__(self, host: HostConfig, control_path: Path) -> None:
        self.host = host
        self.control_path = control_path
        self.silence_s = heartbeat_timeout(host)
        self.proc: subprocess.Popen | None = None
        self.opened_at = time.monotonic()
        self.heard: float | None = None  # when the helper last said anything (monotonic)
        self.lost_reason: str | None = None
        self.lost_at: float | None = None  # epoch seconds, for the lost ranks' reports
        self._eof = False
        self._closing = False
        self._cond = threading.Condition()
        self._answers: dict[int, dict[str, Any]] = {}
        self._next_id = 0
        self._write = threading.Lock()  # the helper's stdin and the agents' lifelines
        self._agents: list[subprocess.Popen] = []
        self._stderr: deque[str] = deque(maxlen=20)
        self._readers: list[threading.Thread] = []

    # --- the connection

    def open(self) -> None:
        """Start the login (returns at once; requests wait for the helper's first line)."""
        mux = ["-M", "-S", str(self.control_path), "-o", "ControlMaster=yes", "-o", "ControlPersist=no"]
        helper = [self.host.python, "-m", HOST_MODULE, "serve", "--silence-s", f"{self.silence_s:g}", "--beat-s", f"{BEAT_S:g}"]
        self.opened_at = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                ssh_argv(self.host, helper, mux),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # Ctrl-C is the launcher's to handle, not ssh's
            )
        except OSError as exc:
            self._stderr.append(f"cannot run the ssh client: {exc}")
            self._eof = True
            return
        for target, stream in ((self._read_answers, self.proc.stdout), (self._read_stderr, self.proc.stderr)):
            thread = threading.Thread(target=target, args=(stream,), daemon=True, name=f"gpulaunch-ssh-{self.host.name}")
            thread.start()
            self._readers.append(thread)

    def _read_answers(self, stream: Any) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\r\n")
            with self._cond:
                self.heard = time.monotonic()
                if line.startswith(HOST_ANSWER_TAG):
                    try:
                        data = json.loads(line[len(HOST_ANSWER_TAG) :])
                    except ValueError:
                        continue
                    self._answers[int(data.pop("id", 0) or 0)] = data
                    self._cond.notify_all()
                elif line != BEAT_LINE:
                    self._stderr.append(line)  # a login banner, a shell's noise: kept for errors
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _read_stderr(self, stream: Any) -> None:
        for raw in stream:
            self._stderr.append(raw.decode(errors="replace").rstrip())

    def _send(self, pipe: Any, data: bytes) -> bool:
        with self._write:
            try:
                pipe.write(data)
                pipe.flush()
                return True
            except (OSError, ValueError):  # the other end is gone, or we closed it
                return False

    def call(self, cmd: str, *, timeout_s: float = REQUEST_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        """One request to the host's helper; its answer, or SshError saying why there is none."""
        with self._cond:
            self._next_id += 1
            rid = self._next_id
        if self.proc is not None and self.proc.stdin is not None:
            self._send(self.proc.stdin, (json.dumps({"id": rid, "cmd": cmd, "args": args}) + "\n").encode())
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while rid not in self._answers and not self._eof and self.lost() is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SshError(f"no answer over SSH within {timeout_s:g}s ({self.host.address}:{self.host.port})")
                self._cond.wait(min(left, 0.25))
            data = self._answers.pop(rid, None)
        if data is None:
            raise SshError(self._why_closed())
        if data.get("error"):
            raise SshError(str(data["error"]))
        return data

    def _why_closed(self) -> str:
        if self.lost_reason and self.heard is not None:
            return f"lost host {self.host.name} ({self.lost_reason})"
        code = None
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.proc.wait(timeout=5)
        for thread in self._readers:
            thread.join(timeout=1)
        return _explain_failure(self.host, code, "\n".join(self._stderr))

    def lost(self) -> str | None:
        """Why the host is gone (``connection closed``, ``no answer for N s``), or None. Only a
        host that answered once can be lost (a login that fails is a preflight problem), and only
        while the launcher has not closed the connection itself."""
        if self.lost_reason is not None or self._closing or self.heard is None or self.proc is None:
            return self.lost_reason
        if self._eof or self.proc.poll() is not None:
            why = "connection closed"
        elif time.monotonic() - self.heard > self.silence_s:
            why = f"no answer for {self.silence_s:g} s"
        else:
            return None
        self.lost_reason, self.lost_at = why, time.time()
        return why

    def settle(self, wait_s: float) -> str | None:
        """``lost()``, after up to ``wait_s`` for a closing connection to show it closed."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while self.lost() is None and not self._eof and time.monotonic() < deadline:
                self._cond.wait(0.05)
        return self.lost()

    def ping(self) -> None:
        """One heartbeat to the helper and to every agent's lifeline on this host."""
        if self.proc is not None and self.proc.stdin is not None:
            self._send(self.proc.stdin, b"\n")
        for agent in list(self._agents):
            if agent.stdin is not None:
                self._send(agent.stdin, b"\n")

    # --- agents in multiplexed sessions

    def session_argv(self, remote_argv: Sequence[str]) -> list[str]:
        """ssh argv for a new session over this connection: no new login."""
        return ssh_argv(self.host, remote_argv, ["-S", str(self.control_path), "-o", "ControlMaster=no"])

    def adopt(self, agent: subprocess.Popen, first_line: str) -> None:
        """Hand the wrapper its first line; its lifeline is then pinged with the helper's."""
        assert agent.stdin is not None
        self._send(agent.stdin, (first_line + "\n").encode())  # a failure: ssh exited; poll() says so
        self._agents.append(agent)

    def cut(self, agent: subprocess.Popen) -> None:
        """Close one agent's lifeline: its host stops the agent and its ranks."""
        with contextlib.suppress(ValueError):
            self._agents.remove(agent)
        with self._write:
            if agent.stdin is not None and not agent.stdin.closed:
                with contextlib.suppress(OSError):
                    agent.stdin.close()

    # --- the end

    def begin_close(self) -> None:
        """Close the helper's stdin: it exits, and the master with it once no session is left."""
        self._closing = True
        if self.proc is not None and self.proc.stdin is not None:
            with self._write, contextlib.suppress(OSError):
                self.proc.stdin.close()

    def finish_close(self, wait_s: float) -> None:
        """Wait for the master to exit, then end it (and any session left) by pid."""
        self.begin_close()
        for agent in list(self._agents):
            self.cut(agent)
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)
                try:
                    self.proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        for thread in self._readers:
            thread.join(timeout=1)


def _socket_root() -> str:
    """Where the control sockets go: the temp dir, or /tmp where its path is too long for a socket."""
    root = tempfile.gettempdir()
    return root if len(root) <= 64 else "/tmp"


def _socket_dir() -> Path:
    """A new private (0700) directory for one run's control sockets, named after this process.
    The empty ones left by launchers that were killed (their masters removed the sockets on the
    way out) are removed on the way in."""
    root = Path(_socket_root())
    for old in root.glob("gl-ssh-*-*"):
        pid = old.name.split("-")[2]
        with contextlib.suppress(OSError, ValueError):
            if old.stat().st_uid == os.getuid() and not pid_alive(int(pid)):
                old.rmdir()  # only if empty: a socket in it means someone still uses it
    return Path(tempfile.mkdtemp(prefix=f"gl-ssh-{os.getpid()}-", dir=root))


class HostLinks:
    """The connections of one run, one per host, opened on first use, all closed by ``close``.
    One thread pings every helper and agent lifeline each second while any is open."""

    def __init__(self) -> None:
        self._links: dict[str, HostLink] = {}
        self._lock = threading.Lock()
        self._dir: Path | None = None
        self._closed = threading.Event()
        self._pinger: threading.Thread | None = None

    @staticmethod
    def _key(host: Any) -> str:
        return host.model_dump_json() if hasattr(host, "model_dump_json") else repr(host)

    def get(self, host: HostConfig) -> HostLink:
        key = self._key(host)
        with self._lock:
            link = self._links.get(key)
            if link is None:
                if self._dir is None:
                    self._dir = _socket_dir()  # 0700: ours alone
                link = HostLink(host, self._dir / str(len(self._links)))
                link.open()
                self._links[key] = link
                if self._pinger is None:
                    self._pinger = threading.Thread(target=self._ping, daemon=True, name="gpulaunch-ssh-ping")
                    self._pinger.start()
            return link

    def links(self) -> list[HostLink]:
        with self._lock:
            return list(self._links.values())

    def _ping(self) -> None:
        while not self._closed.wait(BEAT_S):
            for link in self.links():
                link.ping()

    def close(self, wait_s: float = 5.0) -> None:
        """Every connection closed (masters gone, by pid if need be), the socket directory removed."""
        self._closed.set()
        links = self.links()
        for link in links:  # all at once: each host ends its helper in parallel
            link.begin_close()
        deadline = time.monotonic() + wait_s
        for link in links:
            link.finish_close(max(0.0, deadline - time.monotonic()))
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def master_pids(self) -> list[int]:
        return [link.proc.pid for link in self.links() if link.proc is not None]


_CURRENT: ContextVar[HostLinks | None] = ContextVar("gpulaunch_ssh_links", default=None)
_DEFAULT: list[HostLinks] = []  # outside any scope (a script calling preflight): closed at exit


def current_links() -> HostLinks:
    """The connections of the run in progress (``connection_scope``), else the process's own."""
    links = _CURRENT.get()
    if links is not None:
        return links
    if not _DEFAULT:
        _DEFAULT.append(HostLinks())
        atexit.register(_DEFAULT[0].close)
    return _DEFAULT[0]


@contextlib.contextmanager
def connection_scope() -> Iterator[HostLinks]:
    """One run's SSH connections: opened as hosts are first used, closed when the block ends."""
    links = HostLinks()
    token = _CURRENT.set(links)
    try:
        yield links
    finally:
        _CURRENT.reset(token)
        links.close()


def _parallel(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    items = list(items)
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(64, len(items))) as pool:
        return list(pool.map(fn, items))


# --------------------------------------------------------------------------------- the transport


class SshTransport(Transport):
    """Remote nodes: each agent runs under the host helper's lifeline wrapper, in a session over
    the host's one connection."""

    remote = True

    def __init__(self) -> None:
        self._link_of: weakref.WeakKeyDictionary[subprocess.Popen, HostLink] = weakref.WeakKeyDictionary()

    def describe(self, node: NodeSlot, plan: StagePlan, agent_argv: Sequence[str]) -> str:
        return shlex.join(remote_agent_command(_host(node), plan.stage_dir, agent_argv))

    def prepare(self, plan: StagePlan, nodes: Sequence[NodeSlot], timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        """Create the stage directory on every remote host and put ``worker.json`` there."""
        links = current_links()

        def prepare(node: NodeSlot) -> str | None:
            try:
                links.get(_host(node)).call("prepare", timeout_s=timeout_s, stage=str(plan.stage_dir), config=plan.worker_for(node).to_json())
            except SshError as exc:
                return f"{node.host}: cannot prepare the run directory {plan.stage_dir}: {exc}"
            return None

        problems = [p for p in _parallel(prepare, nodes) if p]
        if problems:
            raise BackendError("; ".join(problems))

    def spawn(self, node: NodeSlot, plan: StagePlan, agent_argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
        host = _host(node)
        link = current_links().get(host)
        if link.lost():
            raise OSError(f"lost host {node.host} ({link.lost_reason})")
        proc = subprocess.Popen(
            link.session_argv(_agent_remote_argv(host, plan.stage_dir, agent_argv)),
            env=dict(os.environ),
            stdin=subprocess.PIPE,  # the remote agent's lifeline: closing it stops that host
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it decides teardown
        )
        slots = [
            {"rank": r.rank, "local_rank": r.local_rank, "node_rank": r.node_rank, "world_size": plan.world_size, "host": r.host, "device": r.device}
            for r in plan.ranks
            if r.node_rank == node.node_rank
        ]
        link.adopt(proc, json.dumps({"env": env, "ranks": slots}))
        self._link_of[proc] = link
        return proc

    def lost(self, proc: subprocess.Popen) -> str | None:
        link = self._link_of.get(proc)
        if link is None:
            return None
        if proc.poll() == EXIT_SSH_ERROR:  # the session ended with the connection, or just before
            return link.settle(wait_s=1.0)
        return link.lost()

    def stop(self, procs: Sequence[subprocess.Popen], grace_s: float) -> None:
        """Close every lifeline at once, then wait for the ssh clients, which exit when their
        remote wrapper has stopped the agent and its ranks (it uses the same grace period). A lost
        host is not waited for: its sessions and its connection are ended here, by pid."""
        waiting = []
        for proc in procs:
            link = self._link_of.get(proc)
            if link is not None and link.lost():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                link.finish_close(wait_s=0.0)
                continue
            if link is not None:
                link.cut(proc)
            elif proc.stdin is not None and not proc.stdin.closed:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            waiting.append(proc)
        deadline = time.monotonic() + grace_s + 5.0  # remote grace + SIGKILL + the way back
        for proc in waiting:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # the caller's SIGTERM/SIGKILL path takes over

    def signal(self, plan: StagePlan, nodes: Sequence[NodeSlot], signum: int) -> None:
        """``signum`` to every live rank of these hosts: one request to each host's helper, in parallel."""
        links = current_links()

        def send(node: NodeSlot) -> None:
            with contextlib.suppress(SshError):
                links.get(_host(node)).call("signal", timeout_s=10.0, stage=str(plan.stage_dir), signum=int(signum))

        _parallel(send, nodes)

    def collect(self, plan: StagePlan, nodes: Sequence[NodeSlot], logs: LogRouter, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        """Any report the live channel missed (its stream cut short), fetched from its host and
        delivered as an event: one request per host that has such a rank, none when every report
        came. A lost host is not asked: its ranks were lost with it."""
        links = current_links()
        missing = {n.node_rank: [r.rank for r in plan.ranks if r.node_rank == n.node_rank and r.rank not in logs.reported] for n in nodes}
        _parallel(lambda node: _fetch(plan, node, missing[node.node_rank], links.get(_host(node)), logs, timeout_s), [n for n in nodes if missing[n.node_rank]])


def _host(node: NodeSlot) -> HostConfig:
    assert node.target.ssh is not None, f"{node.host} is not reached over SSH"
    return node.target.ssh


def _fetch(plan: StagePlan, node: NodeSlot, ranks: list[int], link: HostLink, logs: LogRouter, timeout_s: float) -> None:
    if link.lost() is not None:
        return
    try:
        data = link.call("fetch", timeout_s=timeout_s, stage=str(plan.stage_dir), ranks=ranks)
    except SshError as exc:
        if link.lost() is None:
            logs.route(f"gpulaunch: could not fetch rank reports from {node.host}: {exc}", node.host)
        return
    events: list[StageEvent] = []
    for rel, text in data.get("files", {}).items():
        try:
            content = json.loads(text)
        except ValueError:
            continue
        if Path(rel).parent.name == plan.paths.progress_dir.name:
            events.append(RankBeacon(int(Path(rel).stem[len("rank") :]), RankProgress.from_dict(content)))
        else:
            events.append(RankReported(RankReport.from_dict(content)))  # the run loop writes it here
    logs.emit(*events)


# --------------------------------------------------------------------------------------- preflight

PREFLIGHT_TIMEOUT_S = 60.0  # a first `import torch`-free check; covers slow NFS home dirs


class PreflightError(LauncherError):
    """One or more hosts failed their checks; one line per problem, each naming its host."""

    exit_code = EXIT_JOB_FAILED

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class HostReport:
    """What one host told the preflight (or why it could not)."""

    host: HostConfig
    problems: tuple[str, ...]
    inventory: NodeInventory | None = None
    torch_version: str | None = None
    seconds: float = 0.0  # from the start of the login to the answer


def local_torch_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def _public(version: str | None) -> str | None:
    return version.split("+", 1)[0] if version else version


def check_host(
    host: HostConfig,
    *,
    torch_version: str | None,
    first: bool,
    timeout_s: float = PREFLIGHT_TIMEOUT_S,
    visible_devices: str | None = None,
    links: HostLinks | None = None,
) -> HostReport:
    """Log in (or reuse the run's connection), ask the host's helper, judge its answer here.
    ``visible_devices``: the job's own ``CUDA_VISIBLE_DEVICES``, applied to the host's GPUs."""
    link = (links or current_links()).get(host)
    try:
        data = link.call(
            "preflight", timeout_s=timeout_s, ifname=host.ifname, bind=host.address if first else None, visible_devices=visible_devices
        )
    except SshError as exc:
        return HostReport(host, (f"{host.name}: {exc}",), seconds=time.monotonic() - link.opened_at)
    inventory, problems = _judge_inventory(host, NodeInventory.from_dict(data["inventory"]))
    remote_torch = data.get("torch")
    if remote_torch is None:
        problems.append(f"{host.name}: torch is not installed for {host.python} (install torch {torch_version} there)")
    elif torch_version and _public(remote_torch) != _public(torch_version):
        problems.append(f"{host.name}: torch {remote_torch} does not match torch {torch_version} on this host")
    if host.ifname and not data.get("ifname_present"):
        present = ", ".join(data.get("interfaces", [])) or "none"
        problems.append(f"{host.name}: ifname: network interface '{host.ifname}' not found (present: {present})")
    if first and data.get("bind_error"):
        problems.append(
            f"{host.name}: cannot open a rendezvous port on {host.address} there ({data['bind_error']}); "
            "address must be one of the host's own addresses"
        )
    return HostReport(host, tuple(problems), inventory, remote_torch, time.monotonic() - link.opened_at)


def _judge_inventory(host: HostConfig, inventory: NodeInventory) -> tuple[NodeInventory, list[str]]:
    """The host's GPUs as the cluster file limits them (``gpus: N``), and what does not fit."""
    if host.gpus == "auto":
        return inventory, []
    if host.gpus > inventory.gpu_count:
        seen = ", ".join(inventory.notes) or inventory.source
        return inventory, [f"{host.name}: gpus: {host.gpus} configured but {inventory.gpu_count} visible ({seen})"]
    limited = NodeInventory(
        inventory.hostname, inventory.cpu_count, inventory.gpus[: host.gpus], inventory.source,
        inventory.cuda_visible_devices, (*inventory.notes, f"cluster file: gpus={host.gpus}"),
    )
    return limited, []


def preflight_reports(cluster: ClusterConfig, job: Any = None, *, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> list[HostReport]:
    """Every host's login started at once from this thread, then every answer judged."""
    torch_version = local_torch_version()
    visible = job.spec.env.get("CUDA_VISIBLE_DEVICES") if job is not None else None
    hosts, links = cluster.hosts, current_links()
    for host in hosts:
        links.get(host)

    def check(index: int) -> HostReport:
        return check_host(hosts[index], torch_version=torch_version, first=index == 0, timeout_s=timeout_s, visible_devices=visible, links=links)

    return _parallel(check, range(len(hosts)))


def preflight(cluster: ClusterConfig, job: Any = None, *, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> list[NodeTarget]:
    """Check every host in parallel; return them as NodeTargets (first host: the rendezvous).
    The connections stay open for the run (``connection_scope``)."""
    reports = preflight_reports(cluster, job, timeout_s=timeout_s)
    problems = [p for r in reports for p in r.problems]
    if problems:
        raise PreflightError([*problems, f"preflight ({cluster.source}): nothing was started"])
    return [
        NodeTarget(name=r.host.name, address=r.host.address, inventory=r.inventory, python=r.host.python, ifname=r.host.ifname, ssh=r.host)
        for r in reports
        if r.inventory is not None
    ]


def remote_free_port(target: NodeTarget) -> int:
    """A TCP port free right now on the target host (its helper binds port 0 on its address)."""
    assert target.ssh is not None
    try:
        data = current_links().get(target.ssh).call("free-port", timeout_s=PREFLIGHT_TIMEOUT_S, bind=target.address)
    except SshError as exc:
        raise PreflightError([f"{target.name}: cannot pick a rendezvous port: {exc}"]) from None
    if data.get("bind_error"):
        raise PreflightError([f"{target.name}: cannot pick a rendezvous port on {target.address}: {data['bind_error']}"])
    return int(data["port"])
