"""Where every engine's saved chunks go: one write-back sink (keys, encode, sign, put), off the step.

``WriteBackSink(saver, max_pending=8)`` wraps a ``ChunkSaver`` (the rungs, the store, the key) in a
``WriteBack`` queue (one background thread, bounded: a full queue drops, counted):

- ``for_prompt(ids, salt="") -> SaveSink``: the sink the worker core hands a request's chunks to
  (``(index, start, kv)`` with ``kv`` a ``worker.HostCopy`` or an array); one queued job per chunk,
  the count accepted returned. The chunk keys (of the request's cache salt: its tenant's) are
  computed on the write-back thread, once per prompt (a hash chain over the prompt: never on the
  engine's step);
- ``corrupt`` (a ``KeySet``, may be shared with a reader): keys whose stored copy was found corrupt;
  the next save of that chunk replaces it instead of keeping it (bounded, oldest forgotten first);
- a dead store does not hold the write-back thread: the sink has its own circuit breaker
  (``store.breaker.Breaker``; a store error opens it). While it is open, jobs are skipped at
  once (``skipped``), and once its cooldown is over the next job goes to the store as the probe
  (its success closes the breaker, its failure doubles the cooldown). Without it, every miss
  against a store that accepts and never answers queued one hung call after another;
- ``stats()``: ``WriteBack.stats`` (jobs, ``skipped`` included) plus ``written`` (chunk copies, one
  per rung, this sink stored), ``present`` (copies another writer had stored first: seen before
  encoding, or refused by the store's create) and ``breaker`` (its state),
  ``flush(timeout_s)``, ``close(timeout_s=30)`` (also closes the store when the sink opened it).

``open_sink(store_url, card, rungs, chunk_tokens, auth, max_pending=8)`` makes one; None when
``rungs`` is empty (write-back off). From ``Settings``: ``kvcodec.compose.open_writes``.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import StoreUnavailable
from ..format.keys import chunk_keys, tenant_id
from ..store.breaker import Breaker
from .save import ChunkSaver
from .writeback import SKIPPED, WriteBack

MAX_CORRUPT = 4096


class _PromptKeys:
    """The chunk keys of one prompt at every rung, computed once, on first use (any thread)."""

    def __init__(self, saver: ChunkSaver, ids: Sequence[int], chunks: int, salt: str = "") -> None:
        self._saver, self._ids, self._chunks, self.salt = saver, list(ids), chunks, salt
        self.tenant = tenant_id(salt)
        self._lock = threading.Lock()
        self._keys: Optional[List[Tuple[str, ...]]] = None

    def of(self, index: int) -> Tuple[str, ...]:
        with self._lock:
            if self._keys is None:
                s = self._saver
                per_rung = [chunk_keys(self._ids, s.model_id, scheme.identity, s.chunk_tokens, max_chunks=self._chunks,
                                       salt=self.salt) for scheme in s.schemes]
                self._keys = [tuple(k[i] for k in per_rung) for i in range(self._chunks)]
            return self._keys[index]


class KeySet:
    """A bounded, thread-safe set of store keys (the oldest forgotten first)."""

    def __init__(self, max_keys: int = MAX_CORRUPT) -> None:
        self.max_keys = max_keys
        self._keys: "OrderedDict[str, None]" = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: str) -> None:
        with self._lock:
            self._keys[key] = None
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)

    def discard(self, key: str) -> None:
        with self._lock:
            self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._keys

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)


class WriteBackSink:
    def __init__(self, saver: ChunkSaver, max_pending: int = 8, owns_store: bool = False,
                 corrupt: Optional[KeySet] = None, name: str = "kv-writeback",
                 breaker: Optional[Breaker] = None) -> None:
        self.saver = saver
        self.breaker = breaker or Breaker()
        self.queue = WriteBack(self._store, max_pending=max_pending, name=name)
        self._owns_store = owns_store
        self.corrupt = KeySet() if corrupt is None else corrupt
        self._lock = threading.Lock()
        self._written = self._present = 0  # rung copies: stored by this sink / found stored by another writer

    def for_prompt(self, ids: Sequence[int], salt: str = ""):
        keys = _PromptKeys(self.saver, ids, len(ids) // self.saver.chunk_tokens, salt)

        def sink(chunks: List[Tuple[int, int, Any]]) -> int:
            return sum(bool(self.queue.offer((keys, index, start, kv))) for index, start, kv in chunks)

        return sink

    def _store(self, job) -> Optional[str]:
        keys, index, start, kv = job
        probe = False
        if not self.breaker.allow():
            probe = self.breaker.take_probe()
            if not probe:
                return SKIPPED  # the store is kept out: no call waits on it
        chunk_keys_ = keys.of(index)
        replace = frozenset(k for k in chunk_keys_ if k in self.corrupt)
        try:
            array = kv if isinstance(kv, np.ndarray) else kv.get()  # inside: a probe must be reported
            saved = self.saver.save(chunk_keys_, index, start, array, replace, keys.tenant)
        except StoreUnavailable as exc:
            if probe:
                self.breaker.probe_done(False, str(exc))
            else:
                self.breaker.failure(str(exc))
            raise
        except BaseException:
            if probe:  # not the store's fault, and nothing learnt of it: the next job probes again
                self.breaker.probe_void()
            raise
        if probe:
            self.breaker.probe_done(True)
        else:
            self.breaker.success()
        with self._lock:
            self._written += saved.written
            self._present += saved.present
        for k in replace:
            self.corrupt.discard(k)

    def stats(self) -> dict:
        with self._lock:
            return dict(self.queue.stats(), written=self._written, present=self._present, breaker=self.breaker.state)

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        return self.queue.flush(timeout_s)

    def close(self, timeout_s: float = 30) -> None:
        self.queue.close(timeout_s=timeout_s)
        if self._owns_store:
            self.saver.store.close()


def open_sink(store, card, rungs: Sequence[str], chunk_tokens: int, auth, max_pending: int = 8,
              corrupt: Optional[KeySet] = None, name: str = "kv-writeback", costs=None,
              owns: Optional[bool] = None) -> Optional[WriteBackSink]:
    """A sink storing at ``rungs`` (ladder specs) into ``store`` (a URL, opened and owned, or a store,
    owned when ``owns``); ``costs`` (a ``serving.costs.CostModel``) learns each rung's size and decode
    time from it."""
    if not rungs:
        return None
    from ..format.ladder import parse_ladder
    from ..store import open_store

    opened = isinstance(store, str)
    owns = opened if owns is None else owns
    store = open_store(store) if opened else store
    saver = ChunkSaver(store, card.model_id, parse_ladder(list(rungs), card), chunk_tokens, auth=auth,
                       observe=costs.observe_rung if costs is not None else None)
    return WriteBackSink(saver, max_pending=max_pending, owns_store=owns, corrupt=corrupt, name=name)
