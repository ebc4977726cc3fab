"""Measuring a link: a byte source on its server side, the achieved rate and RTT across it."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from typing import Iterator

from kvcodec_tools.procs import Process

from .base import Link
from .errors import LinkError
from .link import open_link

SOURCE = ("import socket,sys,threading\n"
          "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
          "s.bind((sys.argv[1],0));s.listen(8);print(s.getsockname()[1],flush=True)\n"
          "buf=memoryview(bytes(1<<20))\n"
          "def serve(c):\n"
          " f=c.makefile('rb')\n"
          " for line in f:\n"
          "  n=int(line)\n"
          "  while n>0:\n"
          "   k=min(n,len(buf));c.sendall(buf[:k]);n-=k\n"
          " c.close()\n"
          "while True:\n"
          " c,_=s.accept();threading.Thread(target=serve,args=(c,),daemon=True).start()\n")


@contextlib.contextmanager
def byte_source(link: Link) -> Iterator[int]:
    """A tiny server on the link's server side that answers a line ``N`` with N bytes.
    Yields the port it listens on (at ``link.server_host``)."""
    proc = Process("byte source", [sys.executable, "-c", SOURCE, link.server_host], subprocess.PIPE,
                   wrap=link.wrap, new_session=False).start()
    try:
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise LinkError(f"byte source on {link.server_host} did not start (said {line!r})")
        yield int(line)
    finally:
        proc.stop(grace_s=3.0)


def measure(host: str, port: int, nbytes: int, timeout_s: float = 60.0, pings: int = 5) -> dict:
    """Connect, time ``pings`` 1-byte requests/responses (RTT: the first includes the server's
    start on the connection, the min does not), then a download of ``nbytes``."""
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t_conn = time.perf_counter()
        rtts = []
        for _ in range(pings):
            t = time.perf_counter()
            s.sendall(b"1\n")
            _recv_n(s, 1)
            rtts.append(time.perf_counter() - t)
        t_rtt = time.perf_counter()
        s.sendall(b"%d\n" % nbytes)
        _recv_n(s, nbytes)
        t_end = time.perf_counter()
    secs = t_end - t_rtt
    return {"bytes": nbytes, "seconds": round(secs, 4), "mbit_s": round(nbytes * 8 / secs / 1e6, 1),
            "connect_ms": round((t_conn - t0) * 1e3, 3), "first_rtt_ms": round(rtts[0] * 1e3, 3),
            "rtt_ms": round(min(rtts) * 1e3, 3)}


def _recv_n(s: socket.socket, n: int) -> None:
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    while n > 0:
        k = s.recv_into(view[:min(n, len(buf))])
        if k == 0:
            raise LinkError(f"connection closed with {n} bytes still to come")
        n -= k


def check(rate_mbit: float, delay_ms: float = 0.0, mode: str = "auto", megabytes: float = 30.0) -> dict:
    """Bring a link up, download ``megabytes`` across it, report the achieved rate and RTT."""
    with open_link(rate_mbit, delay_ms, mode) as link, byte_source(link) as port:
        host, xport = link.expose(port)
        m = measure(host, xport, int(megabytes * 1e6))
        return {**link.describe(), "measured": m, "achieved_ratio": round(m["mbit_s"] / rate_mbit, 3)}
