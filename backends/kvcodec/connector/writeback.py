"""Save-after-miss off the critical path: a bounded queue and one background worker.

``WriteBack(store_fn, max_pending=4)`` starts one daemon thread that runs ``store_fn(job)`` for each
accepted job, in order (the caller builds one only if write-back is wanted):

- ``offer(job) -> bool``: never blocks; False (counted as dropped) when ``max_pending`` jobs already
  wait, or after ``close``;
- an exception from ``store_fn`` is logged and counted, never raised into the caller; the worker
  goes on with the next job; ``store_fn`` returning ``SKIPPED`` counts the job as skipped (the
  caller chose not to store it: its store is kept out by a breaker);
- ``stats()``: ``queued`` (jobs accepted), ``stored``, ``dropped``, ``failed``, ``skipped``,
  ``pending`` (waiting or running now) and ``busy_s`` (seconds spent in ``store_fn``);
- ``flush(timeout_s) -> bool``: waits until no job waits or runs (False on timeout);
- ``close(timeout_s) -> bool``: accepts no more jobs, lets the worker finish those accepted, and
  waits for it (False if it is still busy at the timeout).

``Increments`` turns successive ``stats()`` (summed over queues: ``merged``) into counter increments
for the metrics endpoint (``kvcodec_writeback_total{state}``; ``CHUNK_COUNTS`` for
``kvcodec_writeback_chunks_total{outcome}``): a put refused by a full store is ``failed`` there,
never the request's error.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterable, Optional

log = logging.getLogger(__name__)
SKIPPED = "skipped"  # what a store_fn returns for a job it chose not to store


class WriteBack:
    def __init__(self, store_fn: Callable[[Any], None], max_pending: int = 4, name: str = "kv-writeback") -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.store_fn = store_fn
        self.max_pending = max_pending
        self._jobs: Deque[Any] = deque()
        self._cond = threading.Condition()
        self._running = False
        self._closed = False
        self._counts = {k: 0 for k in COUNTS}
        self._busy_s = 0.0
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def offer(self, job: Any) -> bool:
        with self._cond:
            if self._closed or len(self._jobs) >= self.max_pending:
                self._counts["dropped"] += 1
                return False
            self._jobs.append(job)
            self._counts["queued"] += 1
            self._cond.notify_all()
            return True

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._running = True
            t0 = time.perf_counter()
            outcome = "stored"
            try:
                if self.store_fn(job) == SKIPPED:
                    outcome = "skipped"
            except Exception:
                outcome = "failed"
                log.exception("write-back job failed")
            with self._cond:
                self._busy_s += time.perf_counter() - t0
                self._counts[outcome] += 1
                self._running = False
                self._cond.notify_all()

    def stats(self) -> Dict[str, float]:
        with self._cond:
            return dict(self._counts, pending=len(self._jobs) + int(self._running), busy_s=self._busy_s)

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._running, timeout_s)

    def close(self, timeout_s: Optional[float] = None) -> bool:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


COUNTS = ("queued", "stored", "dropped", "failed", "skipped")
CHUNK_COUNTS = ("written", "present")  # WriteBackSink's, per chunk copy (one per rung)


def merged(stats: Iterable[Dict[str, float]]) -> Dict[str, float]:
    """The sum of several queues' ``stats()``."""
    out: Dict[str, float] = {k: 0 for k in (*COUNTS, *CHUNK_COUNTS, "pending", "busy_s")}
    for one in stats:
        for k in out:
            out[k] += one.get(k, 0)
    return out


class Increments:
    """``since(stats)``: how much each count of ``names`` (default ``COUNTS``) grew since the last
    call (a count that went down, a queue replaced, starts again from its new value)."""

    def __init__(self, names: Iterable[str] = COUNTS) -> None:
        self._last = {k: 0 for k in names}

    def since(self, stats: Dict[str, float]) -> Dict[str, int]:
        out = {}
        for k in self._last:
            now = int(stats.get(k, 0))
            out[k] = now - self._last[k] if now >= self._last[k] else now
            self._last[k] = now
        return out
