"""Free TCP ports on loopback, for servers started by the CLI, the benchmarks and the tests."""
from __future__ import annotations

import socket
from typing import List


def free_ports(n: int) -> List[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
