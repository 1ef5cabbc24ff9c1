"""The host side of the preflight's network check: plain TCP between the hosts' helpers, standard
library only. No torch on the hosts: eight ``import torch`` on a small machine would cost more
than the whole check may take, and the helper already runs on every host for the whole run.

- ``Listener`` (request ``net-listen``): a TCP listener on the host's address on the job's
  network, port 0, served by daemon threads of the helper, gone by itself after ``for_s`` seconds
  (so nothing is left when the launcher dies mid-check). Each connection says its mode in its
  first byte: ``P`` (ping: every byte echoed back until EOF) or ``B`` (bulk: read until EOF, then
  answer the 8-byte count of bytes received).
- ``measure_ring`` (request ``net-ring``): this host's links to its peers, one peer after the
  other: the latency (half the median round trip of one-byte pings, ``TCP_NODELAY``) and the
  throughput (the bytes the receiver acknowledged over the time from the first byte to its
  acknowledgement). Large ``send`` calls of one preallocated buffer and ``recv_into`` on the
  receiver keep Python out of the way. A peer that does not answer in time is an error entry,
  never an exception.

``launcher.backends.ssh.netcheck`` runs both on every host and judges the figures.
"""

from __future__ import annotations

import socket
import statistics
import struct
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

PING = b"P"
BULK = b"B"
CHUNK_BYTES = 4 << 20  # one send/recv_into buffer: large, so the per-call cost of Python vanishes
PINGS = 15
COUNT = struct.Struct("!Q")  # the receiver's answer to a bulk send: bytes received
ACCEPT_POLL_S = 0.25  # how often the accept loop looks at its deadline and its stop flag
MAX_LISTEN_S = 600.0  # a listener never outlives this, whatever a request asks
MIN_IDLE_S = 1.0  # a served connection waits at least this long for its sender, even near the deadline


@dataclass(frozen=True)
class Peer:
    """A host to send to: its name (for the answer), its address on the job's network, the
    port its ``Listener`` answered."""

    name: str
    address: str
    port: int


@dataclass(frozen=True)
class LinkTiming:
    """How long each step of one link's measurement may take."""

    connect_s: float  # each connect, and the first ping's answer: a lost SYN costs 1 s (the kernel's first retry)
    ping_s: float  # the pings after the first, all together: fewer samples on a slow link, not a longer check
    send_s: float  # the bulk send
    drain_s: float  # after the send: the wait for the receiver's count
    max_bytes: int  # the bulk send stops here even before ``send_s``


@dataclass(frozen=True)
class LinkFigure:
    """One link as its sender measured it (``error`` set: no figure)."""

    dst: str
    gbit_s: float | None
    latency_ms: float | None
    bytes: int
    seconds: float
    error: str | None = None
    acknowledged: bool = True  # False: no count in time; ``bytes`` is what the peer's TCP acknowledged

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------- the listener


def _resolve(address: str, port: int = 0) -> tuple[socket.AddressFamily, tuple[Any, ...]]:
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    return family, sockaddr


class Listener:
    """A TCP listener on ``bind`` (port 0), accepting in a daemon thread until ``for_s`` seconds
    have passed or ``close()``; each connection is served in a daemon thread of its own, so a ping
    and a bulk send (or two senders) are served at the same time."""

    def __init__(self, bind: str, for_s: float) -> None:
        family, sockaddr = _resolve(bind)
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind(sockaddr)
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self.port: int = self._sock.getsockname()[1]
        self.deadline = time.monotonic() + min(max(0.0, for_s), MAX_LISTEN_S)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True, name="gpulaunch-netcheck")
        self.thread.start()

    def close(self, wait_s: float = 2.0) -> None:
        self._stop.set()
        self.thread.join(wait_s)

    def _accept(self) -> None:
        try:
            while not self._stop.is_set():
                left = self.deadline - time.monotonic()
                if left <= 0:
                    return
                self._sock.settimeout(min(ACCEPT_POLL_S, left))
                try:
                    conn, _ = self._sock.accept()
                except TimeoutError:
                    continue
                threading.Thread(target=_serve, args=(conn, self.deadline), daemon=True, name="gpulaunch-netcheck-conn").start()
        except OSError:
            return
        finally:
            self._sock.close()


def _serve(conn: socket.socket, deadline: float) -> None:
    """One accepted connection, by the mode in its first byte. A sender that vanishes costs this
    thread until the listener's deadline at most (every wait has that timeout)."""
    with conn:
        try:
            conn.settimeout(max(MIN_IDLE_S, deadline - time.monotonic()))
            mode = conn.recv(1)
            if mode == PING:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while data := conn.recv(64):
                    conn.sendall(data)
            elif mode == BULK:
                conn.sendall(COUNT.pack(_receive_all(conn)))
        except OSError:
            return


def _receive_all(conn: socket.socket) -> int:
    buffer = bytearray(CHUNK_BYTES)
    received = 0
    while count := conn.recv_into(buffer):
        received += count
    return received


# ------------------------------------------------------------------------------------ the sender


def measure_ring(peers: list[Peer], timing: LinkTiming) -> list[LinkFigure]:
    """This host's link to each peer in turn (one at a time: the links of one host must not
    share its NIC while they are measured)."""
    return [measure_link(peer, timing) for peer in peers]


def measure_link(peer: Peer, timing: LinkTiming) -> LinkFigure:
    started = time.monotonic()
    step, wait_s = "connect", timing.connect_s
    try:
        with _connect(peer, PING, timing) as sock:
            step = "ping"
            latency_s = _ping(sock, timing)
        step = "connect"
        with _connect(peer, BULK, timing) as sock:
            step, wait_s = "bulk send", timing.drain_s
            received, seconds, acknowledged = _bulk(sock, timing)
    except OSError as exc:  # refused, reset, unreachable, and every timeout (TimeoutError)
        where = f"{step} to {peer.address}:{peer.port}"
        why = f"no answer within {wait_s:.2g} s" if isinstance(exc, TimeoutError) else exc.strerror or type(exc).__name__
        return LinkFigure(peer.name, None, None, 0, time.monotonic() - started, f"{where}: {why}")
    gbit_s = received * 8 / seconds / 1e9 if received > 0 and seconds > 0 else None
    error = None if gbit_s is not None else f"{peer.address}:{peer.port}: nothing arrived in {seconds:.2g} s"
    return LinkFigure(peer.name, gbit_s, latency_s * 1e3, received, seconds, error, acknowledged)


def _connect(peer: Peer, mode: bytes, timing: LinkTiming) -> socket.socket:
    sock = socket.create_connection((peer.address, peer.port), timeout=timing.connect_s)
    try:
        if mode == PING:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one byte must leave at once
        sock.sendall(mode)
    except OSError:
        sock.close()
        raise
    return sock


def _ping(sock: socket.socket, timing: LinkTiming) -> float:
    """Half the median round trip of up to ``PINGS`` one-byte pings: the first may take
    ``connect_s``; the others, as many as fit in ``ping_s`` (a busy link: fewer samples)."""
    trips: list[float] = []
    deadline = time.monotonic() + timing.ping_s
    while len(trips) < PINGS:
        left = deadline - time.monotonic()
        if trips and left <= 0:
            break
        sock.settimeout(left if trips else timing.connect_s)
        t0 = time.perf_counter()
        sock.sendall(b"x")
        try:
            echoed = sock.recv(1)
        except TimeoutError:
            if trips:
                break  # one sample is enough for a figure; the connection is dropped with its ping
            raise
        if not echoed:
            raise ConnectionResetError(0, "closed during the pings")
        trips.append(time.perf_counter() - t0)
    return statistics.median(trips) / 2


def _bulk(sock: socket.socket, timing: LinkTiming) -> tuple[int, float, bool]:
    """(bytes received, seconds from the first byte to the receiver's count, counted by it)."""
    payload = memoryview(bytes(CHUNK_BYTES))
    sent = 0
    started = time.perf_counter()
    send_end = started + timing.send_s
    while sent < timing.max_bytes:
        left = send_end - time.perf_counter()
        if left <= 0:
            break
        sock.settimeout(left)  # a timed-out socket's send returns what fitted, so the end is on time
        try:
            sent += sock.send(payload[: min(CHUNK_BYTES, timing.max_bytes - sent)])
        except TimeoutError:
            break
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(timing.drain_s)
    try:
        return _read_count(sock), time.perf_counter() - started, True
    except TimeoutError:
        # A slow link still drains the socket's buffer (megabytes): rather than wait for it,
        # count what the peer's TCP acknowledged so far, where the kernel says (Linux).
        queued = _unacknowledged(sock)
        # Closed with a reset, not a FIN: the kernel drops what is still queued instead of
        # sending it on behind the next round's measurement.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if queued is None:
            raise
        return max(0, sent - queued), time.perf_counter() - started, False


def _read_count(sock: socket.socket) -> int:
    raw = b""
    while len(raw) < COUNT.size:
        chunk = sock.recv(COUNT.size - len(raw))
        if not chunk:
            raise ConnectionResetError(0, "the receiver closed without its count")
        raw += chunk
    return int(COUNT.unpack(raw)[0])


def _unacknowledged(sock: socket.socket) -> int | None:
    """Bytes still in the socket's send queue, not yet acknowledged by the peer (SIOCOUTQ)."""
    try:
        import fcntl
        import termios

        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4)
    except (ImportError, AttributeError, OSError):
        return None
    return int(struct.unpack("i", raw)[0])


# ------------------------------------------------------------------------------- the requests


def listen_request(bind: str, for_s: float) -> dict[str, Any]:
    """``net-listen``: a listener on ``bind`` for ``for_s`` seconds; its port."""
    return {"port": Listener(bind, float(for_s)).port}


def ring_request(
    peers: list[list[Any]],
    send_s: float,
    max_mb: float,
    connect_s: float = 1.5,
    ping_s: float = 0.1,
    drain_s: float | None = None,
) -> dict[str, Any]:
    """``net-ring``: this host's link to each of ``peers`` (``[name, address, port]``), in order."""
    timing = LinkTiming(
        connect_s=float(connect_s),
        ping_s=float(ping_s),
        send_s=float(send_s),
        drain_s=float(drain_s) if drain_s is not None else max(0.5, float(send_s) / 2),
        max_bytes=int(float(max_mb) * 1e6),
    )
    targets = [Peer(str(name), str(address), int(port)) for name, address, port in peers]
    return {"links": [figure.to_dict() for figure in measure_ring(targets, timing)]}
