"""A TCP proxy in front of a real store that misbehaves on purpose (the store-fault tests, ``kvcodec soak --chaos``).

``FaultProxy(upstream)`` listens on 127.0.0.1 (``.port``) and relays to ``upstream`` (host, port)
on an asyncio loop of its own thread. ``set_mode(mode)`` says how connections accepted from then on
behave, for their whole life:

- ``ok``: relayed both ways;
- ``reset``: reset (RST) as soon as accepted;
- ``trickle``: the store's answers reach the client one byte every ``trickle_s``;
- ``blackhole``: accepted and read, never answered, never closed;
- ``stall``: the first ``stall_after`` bytes of the store's answers pass, then nothing more (the
  connection stays open).
An upstream that refuses (the store killed) gets the client's connection reset at once.

Switching into a fault resets the connections still open from before, so that a client's idle
keep-alive connection cannot bypass the fault; healing (``set_mode("ok")``) leaves the faulty
connections as they are, misbehaving until the client gives up on them, as a sick network path
does. ``accepted`` counts connections by the mode they got; ``open`` is how many are still open.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections import Counter
from typing import Optional, Set, Tuple

MODES = ("ok", "reset", "trickle", "blackhole", "stall")


class _Conn:
    def __init__(self, mode: str, writer: asyncio.StreamWriter) -> None:
        self.mode, self.writer = mode, writer
        self.upstream: Optional[asyncio.StreamWriter] = None


def _reset(writer: Optional[asyncio.StreamWriter]) -> None:
    if writer is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    def __init__(self, upstream: Tuple[str, int], trickle_s: float = 0.05, stall_after: int = 200_000) -> None:
        self.upstream, self.trickle_s, self.stall_after = upstream, trickle_s, stall_after
        self.mode = "ok"
        self.accepted: Counter = Counter()
        self._conns: Set[_Conn] = set()
        self._loop = asyncio.new_event_loop()
        self._closed = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        self._server = self._run(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]

    def _run(self, coro, timeout_s: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    @property
    def open(self) -> int:
        return len(self._conns)

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown proxy mode {mode!r} (known: {', '.join(MODES)})")

        async def switch():
            self.mode = mode
            if mode != "ok":
                for conn in [c for c in self._conns if c.mode == "ok"]:
                    _reset(conn.writer)
                    _reset(conn.upstream)

        self._run(switch())

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(self.mode, writer)
        self.accepted[conn.mode] += 1
        self._conns.add(conn)
        try:
            if conn.mode == "reset":
                _reset(writer)
                return
            if conn.mode == "blackhole":
                while await reader.read(65536):
                    pass  # read everything, answer nothing
                await self._closed.wait()
                return
            try:
                up_reader, conn.upstream = await asyncio.open_connection(*self.upstream)
            except OSError:
                _reset(writer)  # the store refused: so does the proxy, at once
                return
            await asyncio.gather(self._pipe(reader, conn.upstream, "ok"), self._pipe(up_reader, writer, conn.mode))
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:  # close(): the task ends normally (3.11's stream callback would
            pass  # print the cancellation of every connection still open as an error)
        finally:
            self._conns.discard(conn)
            for w in (writer, conn.upstream):
                if w is not None:
                    w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, mode: str) -> None:
        sent = 0
        try:
            while data := await reader.read(65536):
                if mode == "stall":
                    data = data[:max(0, self.stall_after - sent)]
                if mode == "trickle":
                    for i in range(len(data)):
                        writer.write(data[i:i + 1])
                        await writer.drain()
                        await asyncio.sleep(self.trickle_s)
                elif data:
                    writer.write(data)
                    await writer.drain()
                sent += len(data)
            if mode == "stall":
                await self._closed.wait()  # the answer never ends
            elif writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass

    def close(self) -> None:
        async def stop():
            self._closed.set()
            self._server.close()
            for conn in list(self._conns):
                _reset(conn.writer)
                _reset(conn.upstream)
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self._run(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
