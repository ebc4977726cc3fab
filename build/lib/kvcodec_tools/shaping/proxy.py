"""The userspace shaping proxy: a TCP relay on 127.0.0.1 in front of ``target``, as a child
process (``python -m kvcodec_tools.shaping proxy``) so that it does not share the benchmark's GIL.

One token bucket per direction, shared by all connections; each chunk is held until it has been
"serialized" at the rate, then delivered ``delay_ms`` later. Without a rate it only delays (the
netns link's relay where the kernel has no netem). The child prints ``{"port": P}`` once it
listens, and stops on SIGTERM or SIGINT; unless detached, it also dies with the process that
started it.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

from kvcodec_tools.procs import Process

from .bucket import TokenBucket, proxy_params
from .errors import LinkError

# --- the child --------------------------------------------------------------------------------


async def _pipe(reader, writer, bucket: Optional[TokenBucket], delay: float, p: dict):
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue(maxsize=p["queue"])

    async def pump_in():
        try:
            while data := await reader.read(p["chunk"]):
                wait = bucket.reserve(len(data), loop.time()) if bucket else 0.0
                await q.put((loop.time() + wait + delay, data))
                if wait > 0:
                    await asyncio.sleep(wait)  # hold the reader: no credit, no reading
        except (ConnectionError, OSError):
            pass
        finally:
            await q.put(None)

    async def pump_out():
        try:
            while (item := await q.get()) is not None:
                due, data = item
                if (d := due - loop.time()) > 0:
                    await asyncio.sleep(d)
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass

    await asyncio.gather(pump_in(), pump_out())


async def _serve_proxy(target: tuple[str, int], rate_mbit: Optional[float], delay_ms: float,
                       ready: Callable[[int], None]):
    p = proxy_params(rate_mbit, delay_ms)
    now = asyncio.get_running_loop().time()
    buckets = [TokenBucket(p["rate"], p["burst"], now) if p["rate"] else None for _ in range(2)]
    delay = delay_ms / 1e3

    async def handle(c_reader, c_writer):
        try:
            s_reader, s_writer = await asyncio.open_connection(*target)
        except OSError:
            c_writer.close()
            return
        for w in (c_writer, s_writer):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(_pipe(c_reader, s_writer, buckets[0], delay, p),
                                 _pipe(s_reader, c_writer, buckets[1], delay, p))
        finally:
            for w in (c_writer, s_writer):
                w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=p["chunk"])
    ready(server.sockets[0].getsockname()[1])
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def run_proxy(target: str, rate_mbit: Optional[float], delay_ms: float, detach: bool) -> int:
    """The child's entry (``python -m kvcodec_tools.shaping proxy --target HOST:PORT ...``): serve until stopped."""
    host, _, port = target.rpartition(":")
    if not detach:  # die with the process that opened the link
        import ctypes
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            return 0

    def ready(p: int) -> None:
        print(json.dumps({"port": p}), flush=True)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)

    asyncio.run(_serve_proxy((host, int(port)), rate_mbit, delay_ms, ready))
    return 0


# --- the parent -------------------------------------------------------------------------------


def start_proxy(target: tuple[str, int], rate_mbit: Optional[float], delay_ms: float,
                detach: bool = False) -> tuple[Process, int]:
    """Start a proxy child in front of ``target``; (its process, the port it listens on at
    127.0.0.1). A detached one leads its own session and outlives this process."""
    argv = [sys.executable, "-m", "kvcodec_tools.shaping", "proxy", "--target", f"{target[0]}:{target[1]}",
            "--delay-ms", str(delay_ms)]
    if rate_mbit is not None:
        argv += ["--rate-mbit", str(rate_mbit)]
    if detach:
        argv.append("--detach")
    proc = Process("link proxy", argv, subprocess.PIPE, env=_child_env(), new_session=detach).start()
    line = proc.stdout.readline()
    proc.stdout.close()
    try:
        return proc, int(json.loads(line)["port"])
    except (ValueError, KeyError, TypeError):
        proc.stop(grace_s=0.0)
        raise LinkError(f"link proxy to {target[0]}:{target[1]} did not start (said {line!r})") from None


def _child_env() -> dict:
    env = dict(os.environ)
    root = Path(__file__).resolve().parents[3]  # the repository: kvcodec_tools under perf/, kvcodec under backends/
    paths = [str(root / "perf"), str(root / "backends"), str(root / "clients")]
    paths += [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def is_our_proxy(pid: int) -> bool:
    """Whether ``pid`` runs a proxy started by ``start_proxy`` (checked before stopping one by a
    PID read from a state file)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"kvcodec_tools.shaping" in cmd and b"proxy" in cmd
