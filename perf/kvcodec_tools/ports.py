"""Free TCP ports, for servers started by the CLI, the benchmarks and the tests.

A port found here is free now; another process may still take it before the server binds.
"""
from __future__ import annotations

import os
import socket
import time
from typing import List, Sequence

from .procs import ServiceError


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """``n`` distinct ports the kernel picked on ``host`` (all bound at once, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port the kernel picked on ``host``."""
    (port,) = free_ports(1, host)
    return port


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port_run(n: int, host: str = "127.0.0.1", offsets: Sequence[int] = (0,), lo: int = 20000,
                  hi: int = 40000) -> int:
    """A base port B with B+i+o free for every i < n and o in ``offsets`` (e.g. (0, 10000) for redis
    cluster bus ports); ``ServiceError`` if there is none in [lo, hi)."""
    start = lo + (os.getpid() * 7919 + time.monotonic_ns()) % (hi - lo)
    for step in range(0, hi - lo, n):
        base = lo + (start - lo + step) % (hi - lo - n)
        if all(port_is_free(host, base + i + o) for i in range(n) for o in offsets):
            return base
    raise ServiceError(f"no run of {n} free ports on {host} in [{lo}, {hi})")
