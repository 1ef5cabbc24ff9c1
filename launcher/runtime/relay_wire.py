"""The wire between a node's ``NodeRelay`` and the launcher's sink (``launcher.backends.ray_sink``).

A relay's answers (its ranks' new output lines and beacons) travel over one TCP connection per
node instead of Ray's object path: Ray's per-answer cost in the driver (a generator item reported
to its owner, then fetched) was most of the launcher's CPU at 1,024 actors (BENCHMARKS.md). The
connection opens with a hello, ``{"token": ..., "node": ...}``, the stage's random token that the
launcher gave the relay at its creation (a peer that cannot say it is closed unread); then every
frame is a 4-byte big-endian length and that many bytes of JSON (never pickle: the bytes come
from the network), as the torchrun agents send their lines over their pipes. Standard library only.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct("!I")
HELLO_MAX = 1024  # bytes: a hello longer than this is not one (the sink closes the peer unread)
FRAME_MAX = 256 * 1024**2  # a relay's answer holds at most 100,000 lines per rank; a bound, not a size


@dataclass(frozen=True)
class SinkAddress:
    """Where a node's relay sends its answers, and what it says first: the stage's token and its node."""

    host: str
    port: int
    token: str
    node: str


def frame(obj: Any) -> bytes:
    """One frame: ``obj`` as compact JSON behind its length."""
    payload = json.dumps(obj, separators=(",", ":")).encode()
    return HEADER.pack(len(payload)) + payload


def connect(sink: SinkAddress, timeout_s: float) -> socket.socket:
    """A connection to the sink, its hello sent (blocking afterwards; no Nagle delay on small answers)."""
    sock = socket.create_connection((sink.host, sink.port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(frame({"token": sink.token, "node": sink.node}))
        sock.settimeout(None)
    except OSError:
        sock.close()
        raise
    return sock


class FrameReader:
    """Frames out of a byte stream that arrives in pieces."""

    def __init__(self, limit: int = FRAME_MAX) -> None:
        self.buf = bytearray()
        self.limit = limit

    def feed(self, data: bytes) -> list[Any]:
        """The frames completed by ``data``; ValueError for a frame past the limit or not JSON."""
        self.buf += data
        out = []
        while len(self.buf) >= HEADER.size:
            (size,) = HEADER.unpack_from(self.buf)
            if size > self.limit:
                raise ValueError(f"a frame of {size} bytes (at most {self.limit})")
            end = HEADER.size + size
            if len(self.buf) < end:
                break
            out.append(json.loads(bytes(self.buf[HEADER.size : end])))
            del self.buf[:end]
        return out

    def wanted(self) -> int:
        """How many more bytes complete the frame begun (at least its header's)."""
        if len(self.buf) < HEADER.size:
            return HEADER.size - len(self.buf)
        size: int = HEADER.unpack_from(self.buf)[0]
        return HEADER.size + size - len(self.buf)


def decode_answer(obj: Any) -> dict[str, Any]:
    """A relay's answer off the wire, as ``NodeRelay.drain`` returns it (JSON made its ranks strings)."""
    if not isinstance(obj, dict):
        raise ValueError(f"an answer is an object, not {type(obj).__name__}")
    lines, beacons, dirs = (obj.get(key) or {} for key in ("lines", "beacons", "dirs"))
    return {
        "seq": int(obj.get("seq", 0)),
        "lines": {int(rank): [str(line) for line in got] for rank, got in lines.items()},
        "beacons": {int(rank): beacon for rank, beacon in beacons.items() if isinstance(beacon, dict)},
        "dirs": {int(rank): str(path) for rank, path in dirs.items()},
    }
