"""Ports for servers a test starts on fixed ports it must name in advance (a Ray head's ten).

``free_port()`` (bind to 0) hands out a port from the kernel's ephemeral range, free at that
instant only: until the server binds it, any process here may get the same port for an outgoing
connection or its own bind to 0, and with several pytest workers starting Ray clusters, torchrun
stores and Prometheus at once that happens (a Ray head whose client server lost its port takes its
whole cluster down, and this process, its driver, with it). These ports come from below the
ephemeral range and above Ray's worker ports (10002-19999), from a slice of their own per pytest
worker, handed out in turn: nothing else here takes them, and a worker never reuses one before it
has cycled through its slice.
"""

from __future__ import annotations

import itertools
import os
import socket

_FIRST, _LAST = 20000, 32000  # the kernel's ephemeral range starts at 32768 (ip_local_port_range)
_SLICES = 16  # pytest-xdist workers gw0..gw15 (a replacement for a crashed worker takes a new number)


def _worker_slice() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) % _SLICES if worker.isdigit() else 0
    size = (_LAST - _FIRST) // _SLICES
    return range(_FIRST + index * size, _FIRST + (index + 1) * size)


_CANDIDATES = itertools.cycle(_worker_slice())


def unshared_port(host: str = "127.0.0.1") -> int:
    """The next port of this worker's slice that is free to bind on ``host`` now."""
    for _ in range(len(_worker_slice())):
        port = next(_CANDIDATES)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port left in {_worker_slice()}")
