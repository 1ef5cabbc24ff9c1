"""One SSH connection per host for a whole run: a ControlMaster whose own session is the host's
helper (``python -m launcher.runtime.hostagent serve``). Requests (preflight, a free port, a
stage's directory, a signal to its ranks, reports the live channel missed) are one JSON line each
way; each stage's agent runs in a session multiplexed over the same connection. The helper beats
every second and the launcher pings it and every agent's lifeline: a host whose connection closes,
or that says nothing for ``heartbeat_timeout_s``, is lost. The control sockets live in a private
directory (0700), removed with every master when the run ends (``connection_scope``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

from launcher.backends.ssh.command import HOST_MODULE, REQUEST_TIMEOUT_S, SshError, _explain_failure, heartbeat_timeout, ssh_argv
from launcher.procutil import pid_alive
from launcher.protocol import HOST_ANSWER_TAG
from launcher.runtime.hostagent import BEAT_LINE, BEAT_S

if TYPE_CHECKING:
    from launcher.spec.cluster import HostConfig

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
        self.opened = threading.Event()  # set once ``open`` has started the ssh client (or failed to)

    # --- the connection

    def open(self) -> None:
        """Start the login (returns once the ssh client runs; requests wait for the helper's first
        line). Logins to many hosts are opened from as many threads (``HostLinks.get``): on a
        loaded machine one fork and exec of ssh takes 10-30 ms, 32 of them in a row most of a second."""
        mux = ["-M", "-S", str(self.control_path), "-o", "ControlMaster=yes", "-o", "ControlPersist=no"]
        helper = [self.host.python, "-m", HOST_MODULE, "serve", "--silence-s", f"{self.silence_s:g}", "--beat-s", f"{BEAT_S:g}"]
        self.opened_at = time.monotonic()
        try:
            with self._write:  # not after begin_close: a run that ends while logins start leaves no master
                if self._closing:
                    raise OSError("the run's connections are closing")
                self.proc = subprocess.Popen(
                    ssh_argv(self.host, helper, mux),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # Ctrl-C is the launcher's to handle, not ssh's
                )
        except OSError as exc:
            self._stderr.append(f"cannot run the ssh client: {exc}")
            with self._cond:
                self._eof = True
                self._cond.notify_all()
            return
        finally:
            self.opened.set()
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
        with self._write:
            self._closing = True
            if self.proc is not None and self.proc.stdin is not None:
                with contextlib.suppress(OSError):
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
        self._lost: list[HostLink] = []  # links to hosts that were lost, replaced by a new login (closed at the end)
        self._made = 0  # links made so far: each its own control socket
        self._lock = threading.Lock()
        self._dir: Path | None = None
        self._closed = threading.Event()
        self._pinger: threading.Thread | None = None

    @staticmethod
    def _key(host: Any) -> str:
        return host.model_dump_json() if hasattr(host, "model_dump_json") else repr(host)

    def get(self, host: HostConfig) -> HostLink:
        """The host's connection, its login started by the first caller (outside the lock, so
        callers in parallel threads start their hosts' logins in parallel). A host whose
        connection was lost gets a new login: it may be back (a node that rebooted, a spare
        again); if it is not, that login fails as any other."""
        key = self._key(host)
        with self._lock:
            link = self._links.get(key)
            if link is not None and link.lost() is not None:
                self._lost.append(link)
                link = None
            created = link is None
            if link is None:
                if self._dir is None:
                    self._dir = _socket_dir()  # 0700: ours alone
                link = HostLink(host, self._dir / str(self._made))
                self._made += 1
                self._links[key] = link
                if self._pinger is None:
                    self._pinger = threading.Thread(target=self._ping, daemon=True, name="gpulaunch-ssh-ping")
                    self._pinger.start()
        if created:
            link.open()
        else:
            link.opened.wait()
        return link

    def open_all(self, hosts: Iterable[HostConfig]) -> list[HostLink]:
        """Every host's login started, from parallel threads; the links, in order."""
        return _parallel(self.get, hosts)

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
        with self._lock:
            links = [*self._links.values(), *self._lost]
        for link in links:  # all at once: each host ends its helper in parallel
            link.begin_close()
        deadline = time.monotonic() + wait_s
        # in parallel too: a master that does not exit in time costs its SIGTERM grace (2 s), once
        # for all of them rather than once per host (a partition at the end of a run)
        _parallel(lambda link: link.finish_close(max(0.0, deadline - time.monotonic())), links)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def master_pids(self) -> list[int]:
        with self._lock:
            return [link.proc.pid for link in (*self._links.values(), *self._lost) if link.proc is not None]


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


