"""The launcher's end of a Ray stage's live channel: a TCP listener that its nodes' relays send to.

One per stage, on the address the relays reach the driver at (127.0.0.1 for an embedded Ray; the
driver's node address as Ray knows it otherwise), on a port the system picks. Each relay connects,
says the stage's token (``secrets``, 256 bits, given to the relays at their creation), and then
sends its answers as frames (``launcher.runtime.relay_wire``). A peer whose first frame is not
the token is closed without reading anything more from it; a peer that says nothing within
``HELLO_WAIT_S`` too. Nothing here blocks: ``take`` reads what has arrived (one ``select`` with a
zero timeout when nothing has), called from the stage's ``poll``.
"""

from __future__ import annotations

import hmac
import secrets
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from launcher.runtime.relay_wire import HELLO_MAX, FrameReader, SinkAddress, decode_answer

HELLO_WAIT_S = 10.0  # a connection that has not said the token by then is closed
READ_BYTES = 1 << 20


@dataclass
class _Peer:
    sock: socket.socket
    since: float
    reader: FrameReader = field(default_factory=lambda: FrameReader(HELLO_MAX))
    node: str | None = None  # once it said the token


@dataclass
class Taken:
    """What ``take`` found: the answers in arrival order (node id, answer) and the nodes whose
    authenticated connection closed or broke (their relay is gone, or gave up)."""

    answers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)


class RelaySink:
    """A stage's listener for its relays' answers (see the module's description)."""

    def __init__(self, host: str) -> None:
        self.token = secrets.token_hex(32)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=1024)
        self._listener.setblocking(False)
        self.host, self.port = host, int(self._listener.getsockname()[1])
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._peers: dict[socket.socket, _Peer] = {}
        self._strangers: set[socket.socket] = set()  # connected, not authenticated yet
        self.seq: dict[str, int] = {}  # node -> the last answer's number taken from it
        self.refused = 0  # peers closed for a wrong or missing token
        self.ended: set[str] = set()  # nodes whose connection closed

    def address_for(self, node: str) -> SinkAddress:
        return SinkAddress(self.host, self.port, self.token, node)

    def take(self, timeout_s: float = 0.0) -> Taken:
        """Everything that has arrived (waiting up to ``timeout_s`` for something)."""
        got = Taken()
        for key, _ in self._sel.select(timeout_s):
            sock: Any = key.fileobj
            if sock is self._listener:
                self._accept()
            else:
                self._read(self._peers[sock], got)
        self._drop_silent()
        return got

    def wait_for(self, wanted: dict[str, int], timeout_s: float) -> Taken:
        """Read until each node's answer numbered ``wanted[node]`` has arrived (or its connection
        closed), at most ``timeout_s``: what a relay sent before its final answer, all of it."""
        got = Taken()
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [n for n, seq in wanted.items() if self.seq.get(n, 0) < seq and n not in self.ended]
            left = deadline - time.monotonic()
            if not missing or left <= 0:
                return got
            more = self.take(min(left, 0.05))
            got.answers += more.answers
            got.closed += more.closed

    def close(self) -> None:
        for peer in list(self._peers.values()):
            self._close(peer)
        self._sel.close()
        self._listener.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        self._peers[sock] = _Peer(sock, time.monotonic())
        self._strangers.add(sock)
        self._sel.register(sock, selectors.EVENT_READ)

    def _read(self, peer: _Peer, got: Taken) -> None:
        # before the token: no byte past the hello (a stranger's data is never read)
        want = READ_BYTES if peer.node else peer.reader.wanted()
        try:
            data = peer.sock.recv(want)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        try:
            frames = peer.reader.feed(data) if data else []
        except ValueError:  # not our wire: a peer that said the token breaking it, or a stranger
            frames, data = [], b""
            self.refused += peer.node is None
        if peer.node is None:
            if frames and not self._hello(peer, frames[0]):
                return
            frames = frames[1:]
        for obj in frames:
            try:
                answer = decode_answer(obj)
            except (ValueError, TypeError, AttributeError):
                data = b""
                break
            assert peer.node is not None
            self.seq[peer.node] = answer["seq"]
            got.answers.append((peer.node, answer))
        if not data:
            if peer.node:
                got.closed.append(peer.node)
                self.ended.add(peer.node)
            self._close(peer)

    def _hello(self, peer: _Peer, hello: Any) -> bool:
        token = hello.get("token") if isinstance(hello, dict) else None
        node = hello.get("node") if isinstance(hello, dict) else None
        if not (isinstance(token, str) and isinstance(node, str) and hmac.compare_digest(token.encode(), self.token.encode())):
            self.refused += 1
            self._close(peer)
            return False
        peer.node = node
        self._strangers.discard(peer.sock)
        peer.reader.limit = FrameReader().limit
        return True

    def _drop_silent(self) -> None:
        if not self._strangers:
            return
        cutoff = time.monotonic() - HELLO_WAIT_S
        for peer in [self._peers[s] for s in self._strangers if self._peers[s].since < cutoff]:
            self.refused += 1
            self._close(peer)

    def _close(self, peer: _Peer) -> None:
        self._peers.pop(peer.sock, None)
        self._strangers.discard(peer.sock)
        try:
            self._sel.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.sock.close()
