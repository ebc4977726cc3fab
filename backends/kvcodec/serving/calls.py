"""One store's calls: a fixed pool of threads, each call held to its request's deadline, counted,
and fed to the store's circuit breaker (``store.breaker``).

``StoreCalls(store, threads, breaker)``:

- ``submit(fn, *args, deadline=at) -> Future``: runs ``fn(*args)`` on one of ``threads`` threads
  inside ``store.deadline.call_deadline(at + CUT_GRACE_S)``, so a network store ends the call then
  (its socket closed, never reused), just after its waiter has given up (a hang reads as a timeout,
  not as the error of the cut). The pool never grows: a call waits in the queue for a free thread.
- ``wait(futures, at, what) -> list``: their results in order. A call's ``StoreUnavailable`` is
  raised (the calls not yet started are cancelled). At ``at`` it raises ``StoreTimeout``: queued
  calls are cancelled, running ones are abandoned (counted until their own deadline ends them).
- ``gate(wait_s) -> str``: '' when calls may go to the store; else why not (the breaker is open).
  When the breaker is due a probe, one ``store.exists(PROBE_KEY)`` runs on the probe thread (its own,
  so hung calls in the pool cannot delay it), and ``gate`` waits up to ``wait_s`` for its answer.
- ``snapshot() -> dict``: ``breaker`` (state), ``threads``, ``running``, ``queued``, ``abandoned``
  (running calls whose request stopped waiting), ``opened`` (times the breaker opened).

The breaker hears every call that ends with an answer (success, a miss too), every
``StoreUnavailable`` (failure), and one failure per ``wait`` that timed out; calls abandoned by their
request are not heard when they end (their request already counted them). Each time it opens, the
store's ``drop_connections()`` is called (it matters to network stores): connections made during a
sick spell are not reused once the store heals.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, List, Optional, Sequence

from ..errors import StoreTimeout, StoreUnavailable
from ..store import KVStore
from ..store.breaker import Breaker
from ..store.deadline import call_deadline

PROBE_KEY = "kvcodec-probe"  # never stored: the probe's answer (a miss) only shows the store answers
PROBE_TIMEOUT_S = 2.0
CUT_GRACE_S = 0.1


class _Call:
    __slots__ = ("state", "abandoned")

    def __init__(self) -> None:
        self.state, self.abandoned = "queued", False


class StoreCalls:
    def __init__(self, store: KVStore, threads: int = 16, breaker: Optional[Breaker] = None) -> None:
        self.store, self.threads = store, threads
        self.breaker = breaker or Breaker()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kv-store")
        self._prober = ThreadPoolExecutor(1, thread_name_prefix="kv-store-probe")
        self._lock = threading.Lock()
        self._queued = self._running = self._abandoned = 0

    # -- calls -------------------------------------------------------------------------------
    def submit(self, fn: Callable, *args: Any, deadline: Optional[float]) -> Future:
        call = _Call()

        def run():
            with self._lock:
                call.state = "running"
                self._queued -= 1
                self._running += 1
            error: Optional[str] = None
            try:
                with call_deadline(None if deadline is None else deadline + CUT_GRACE_S):
                    return fn(*args)
            except StoreUnavailable as exc:
                error = str(exc) or "store unavailable"
                raise
            finally:
                self._ended(call, error)

        with self._lock:
            self._queued += 1
        future = self._pool.submit(run)
        future.kv_call = call
        return future

    def _ended(self, call: _Call, error: Optional[str]) -> None:
        with self._lock:
            call.state = "done"
            self._running -= 1
            if call.abandoned:
                self._abandoned -= 1
                return
        if error is None:
            self.breaker.success()
        else:
            self._failed(error)

    def _failed(self, error: str, probe: bool = False) -> None:
        opened = self.breaker.opened
        if probe:
            self.breaker.probe_done(False, error)
        else:
            self.breaker.failure(error)
        if self.breaker.opened != opened:
            self.store.drop_connections()

    def wait(self, futures: Sequence[Future], at: Optional[float], what: str) -> List[Any]:
        out = []
        try:
            for f in futures:
                out.append(f.result(timeout=None if at is None else max(0.0, at - time.monotonic())))
        except FutureTimeout:
            self.abandon(futures)
            self._failed(f"{what}: no answer in time")
            raise StoreTimeout(f"the store did not answer the {what} in time") from None
        except BaseException:
            self.abandon(futures)
            raise
        return out

    def abandon(self, futures: Sequence[Future]) -> None:
        """Stop waiting for these calls: cancel those not started, count those still running."""
        for f in futures:
            call = getattr(f, "kv_call", None)
            if f.cancel():
                with self._lock:
                    self._queued -= 1
                continue
            with self._lock:
                if call is not None and call.state == "running" and not call.abandoned:
                    call.abandoned = True
                    self._abandoned += 1

    # -- the breaker ---------------------------------------------------------------------------
    def gate(self, wait_s: float = 0.2) -> str:
        if self.breaker.allow():
            return ""
        if self.breaker.take_probe():
            probe = self._prober.submit(self._probe)
            try:
                probe.result(timeout=wait_s)
            except FutureTimeout:
                pass  # it reports to the breaker when it ends; this request goes without the store
            if self.breaker.allow():
                return ""
        return f"store skipped: its circuit breaker is {self.breaker.describe()}"

    def _probe(self) -> None:
        try:
            with call_deadline(time.monotonic() + PROBE_TIMEOUT_S):
                self.store.exists(PROBE_KEY)
        except Exception as exc:  # any failure keeps the store out
            self._failed(f"probe: {exc}", probe=True)
        else:
            self.breaker.probe_done(True)

    def snapshot(self) -> dict:
        with self._lock:
            counts = {"threads": self.threads, "running": self._running, "queued": self._queued,
                      "abandoned": self._abandoned}
        return {"breaker": self.breaker.state, "opened": self.breaker.opened, **counts}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._prober.shutdown(wait=False, cancel_futures=True)
