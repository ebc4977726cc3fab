"""Free TCP ports, for servers started by the CLI, the benchmarks and the tests.

A port found here is free now; another process may still take it before the server binds.
"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .procs import ServiceError


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """``n`` distinct ports free on ``host`` now, outside the kernel's ephemeral range (see
    ``free_port_run``)."""
    base = free_port_run(n, host)
    return list(range(base, base + n))


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on ``host`` now, outside the kernel's ephemeral range."""
    (port,) = free_ports(1, host)
    return port


def port_is_free(host: str, port: int, reuse: bool = True) -> bool:
    """``host:port`` can be bound now; with ``reuse`` (SO_REUSEADDR, as servers bind) a port whose
    last connections linger in TIME_WAIT counts as free, without it not (ports picked for us)."""
    with socket.socket() as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> Tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (inclusive), (32768, 60999) if
    it cannot be read."""
    try:
        lo, hi = (int(x) for x in Path(path).read_text().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port_run(n: int, host: str = "127.0.0.1", offsets: Sequence[int] = (0,), lo: int = 10000,
                  hi: int = 65536, avoid: Optional[Tuple[int, int]] = None) -> int:
    """A base port B with B+i+o free for every i < n and o in ``offsets`` (e.g. (0, 10000) for redis
    cluster bus ports and SeaweedFS gRPC ports); ``ServiceError`` if there is none in [lo, hi).

    No port of the run falls in ``avoid`` (inclusive; the kernel's ephemeral range unless given): a
    port there that is free now can become the local end of any outgoing connection before the
    server binds it (a SeaweedFS admin port can be taken so)."""
    a_lo, a_hi = ephemeral_range() if avoid is None else avoid
    span = n - 1 + max(offsets)
    # the run at offset o, [b + o, b + o + n - 1], must not overlap [a_lo, a_hi]
    bases = [b for b in range(lo, hi - span) if not any(b + o <= a_hi and b + o + n - 1 >= a_lo for o in offsets)]
    if not bases:
        raise ServiceError(f"no run of {n} ports in [{lo}, {hi}) outside the ephemeral range {a_lo}-{a_hi}")
    start = (os.getpid() * 7919 + time.monotonic_ns()) % len(bases)
    for step in range(0, len(bases), n):
        base = bases[(start + step) % len(bases)]
        if all(port_is_free(host, base + i + o, reuse=False) for i in range(n) for o in offsets):
            return base
    raise ServiceError(f"no run of {n} free ports on {host} in [{lo}, {hi})")
