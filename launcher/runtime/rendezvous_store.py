"""Rank 0's TCPStore server, bound to the rendezvous address alone.

Its own module so that the torchrun agent, which serves the store before it spawns a script's
ranks, imports this and not the whole rank runtime (``launcher.runtime.worker``).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from typing import Any

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # "True": the store is served already; every rank is a client


def store_listener(addr: str, port: int) -> int | None:
    """A socket listening on ``addr:port`` alone, as the file descriptor ``TCPStore(master_listen_fd=...)``
    takes (torch's own TCPStore server listens on every interface, ``::``, and has no option to
    bind one address); None where torch's own bind must do: ``addr`` is a name, not an IP
    address, or an address this machine does not hold (peers reach it through NAT, a
    container's published port). On a rendezvous at 127.0.0.1 the store is reachable from this
    machine alone. A port already taken raises OSError(EADDRINUSE)."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    if ip.is_unspecified:
        return None
    sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own listener
        sock.bind((addr, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            return None
        raise
    return sock.detach()  # the store's server owns it from here (libuv closes it when it stops)


def serve_store(addr: str, port: int, timeout: Any, **options: Any) -> Any | None:
    """A TCPStore server on ``addr:port`` alone (``store_listener``), with torch's own options
    (``world_size``, ``wait_for_workers``, ``multi_tenant``, ``use_libuv``); None where torch's
    own TCPStore, listening on every interface, must serve it. A port already taken raises
    ``DistNetworkError`` naming EADDRINUSE, as torch's own bind does."""
    from torch.distributed import DistNetworkError, TCPStore

    try:
        fd = store_listener(addr, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise DistNetworkError(f"the store cannot listen on {addr}:{port}: EADDRINUSE ({exc.strerror})") from exc
        raise
    if fd is None:
        return None
    world_size = options.pop("world_size", None)
    options.setdefault("wait_for_workers", world_size is not None)
    try:
        return TCPStore(addr, port, world_size, True, timeout, master_listen_fd=fd, **options)
    except BaseException:
        os.close(fd)  # not the store's yet: a port left listening with nobody accepting would hang its clients
        raise


def torch_store(addr: str, port: int, timeout: Any, use_libuv: bool) -> Any:
    """Rank 0's store where the launcher cannot bind its socket (a name, an address of NAT):
    torch's own server, listening as torch does (every interface), as env:// would make it."""
    from torch.distributed import TCPStore

    return TCPStore(addr, port, None, True, timeout, multi_tenant=True, wait_for_workers=False, use_libuv=use_libuv)
