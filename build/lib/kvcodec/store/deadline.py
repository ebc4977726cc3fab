"""Call deadlines for stores that cross a network.

A caller that must not wait past a moment runs its store calls inside ``call_deadline(at)`` (``at``
a ``time.monotonic()``; per thread, nestable: the earlier deadline wins). A network store reads
``left()`` (seconds to the deadline, or None without one) at the start of each call and makes the
whole call end by then: connect, send, and every read of a body that trickles in. A call started
after its deadline raises at once; one that runs past it raises ``StoreUnavailable`` saying it
timed out, and its connection is closed, never reused.

``Reaper`` is how a store holds a call to its deadline while a read blocks: one daemon thread per
store (started on first use) that shuts down the socket of every watched call still running at its
deadline, so the blocked read returns and the thread is released. ``watch(conn, at)`` returns a
``Watch``; ``done(watch)`` ends it; ``watch.fired`` says whether the reaper cut that call.
``conn`` is anything with a ``sock`` attribute (``http.client`` connections).
"""
from __future__ import annotations

import heapq
import itertools
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator, List, Optional, Tuple

_local = threading.local()


@contextmanager
def call_deadline(at: Optional[float]) -> Iterator[None]:
    """Store calls of this thread inside the block end by ``at`` (``time.monotonic()``; None: no bound)."""
    before = getattr(_local, "at", None)
    _local.at = at if before is None else (before if at is None else min(at, before))
    try:
        yield
    finally:
        _local.at = before


def left() -> Optional[float]:
    """Seconds until this thread's call deadline (may be <= 0), or None without one."""
    at = getattr(_local, "at", None)
    return None if at is None else at - time.monotonic()


class Watch:
    __slots__ = ("conn", "at", "fired", "done")

    def __init__(self, conn, at: float) -> None:
        self.conn, self.at, self.fired, self.done = conn, at, False, False


class Reaper:
    def __init__(self, name: str = "kv-reaper") -> None:
        self.name = name
        self._heap: List[Tuple[float, int, Watch]] = []
        self._count = itertools.count()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False

    def watch(self, conn, at: float) -> Watch:
        w = Watch(conn, at)
        with self._cond:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (at, next(self._count), w))
            self._cond.notify()
        return w

    def done(self, w: Watch) -> None:
        with self._cond:
            w.done = True  # left in the heap; dropped when its time comes

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                _, _, w = heapq.heappop(self._heap)
                w.fired = True
                sock = getattr(w.conn, "sock", None)
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)  # the blocked read returns; the caller closes it
                    except OSError:
                        pass
