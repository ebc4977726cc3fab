"""Collects a request's restored chunks (they arrive one by one, as separate step calls) into its
``LoadSession``, and says when the request is complete.

``arrive(info, kv) -> Arrival`` files each chunk with its request (``info.session``): the first
chunk's arrival makes the request's ``Chunks`` (a ``connector.LoadSession`` of ``info.count``
chunks, and the chunk infos for the statistics), so an engine that takes the session
(``takes_session``) can take the request at once; every chunk is put into the session (a copy: no
reference is kept to the step's input buffers), or failed there when its info is not ``ok`` or its
KV does not have the request's shape. ``Arrival.first`` marks the first chunk, ``Arrival.complete``
the last one (every chunk's info is in); ``Chunks.assembled()`` is then an ``Assembled``: the KV of
the longest run of good chunks from the start (in host memory; an engine that takes the session
takes its chunks where they are, on the device when the steps ran there) (float16, or float32 once a float32 chunk, ``raw`` on
a float32 engine, is among them: float16 widens exactly) and the per-request statistics.
``add(info, kv)`` is the one-call form: ``None`` until the request is complete, then its
``Assembled``. Requests that never complete are dropped after ``ttl_s``.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from ..connector import LoadSession
from .chunkinfo import ChunkInfo
from .stats import RequestStats


@dataclass
class Assembled:
    past_kv: Optional[np.ndarray]  # float16|float32 [layers, 2, kv_heads, reused_tokens, head_dim], or None
    infos: List[ChunkInfo]
    reused_tokens: int
    reason: str = ""  # why reuse stopped short (empty when every planned chunk was used)

    def stats(self) -> RequestStats:
        return RequestStats.from_chunks(self.infos, self.reused_tokens, self.reason)


@dataclass
class Chunks:
    """One request's chunks as they come: the load session and the infos."""

    session: LoadSession
    count: int
    started: float = 0.0
    infos: Dict[int, ChunkInfo] = field(default_factory=dict)
    shape: Optional[tuple] = None  # the first good chunk's shape: the others must match
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def complete(self) -> bool:
        with self._cond:
            return len(self.infos) >= self.count

    def wait_complete(self, timeout_s: Optional[float] = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.infos) >= self.count, timeout_s)

    def assembled(self, with_kv: bool = True) -> Assembled:
        """The request as it stands (complete or not): the good run (numpy, in host memory: for
        engines that take the whole prefix at once) and the infos so far."""
        with self._cond:
            ordered = [self.infos[i] for i in sorted(self.infos)]
        reused, reason = 0, ""
        for expected, info in enumerate(ordered):
            if info.index != expected:
                reason = f"chunk {expected}: missing"
                break
            if not info.ok:
                reason = f"chunk {info.index}: {info.status}: {info.reason}"
                break
            reused += info.tokens
        if not reason and len(ordered) < self.count:
            reason = f"chunk {len(ordered)}: missing"
        reused = min(reused, self.session.staged_tokens)
        past = self.session.past_kv(host=True) if with_kv and reused else None
        return Assembled(None if past is None else past[:, :, :, :reused], ordered, reused, reason)


@dataclass
class Arrival:
    chunks: Optional[Chunks]  # None for a request with nothing to reuse (``count == 0``)
    first: bool
    complete: bool
    assembled: Optional[Assembled] = None  # set when there is nothing to wait for (``count == 0``)


class Assembler:
    def __init__(self, ttl_s: float = 600.0) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._pending: Dict[str, Chunks] = {}

    def arrive(self, info: ChunkInfo, kv: np.ndarray) -> Arrival:
        if info.count == 0:
            return Arrival(None, True, True, Assembled(None, [info], 0, info.reason))
        with self._lock:
            self._expire()
            request = self._pending.get(info.session)
            first = request is None
            if first:
                request = self._pending[info.session] = Chunks(LoadSession(max(1, info.tokens), info.count),
                                                               info.count, time.monotonic())
        self._file(request, info, kv)
        with request._cond:
            request.infos[info.index] = info
            complete = len(request.infos) >= request.count
            request._cond.notify_all()
        if complete:
            with self._lock:
                self._pending.pop(info.session, None)
        return Arrival(request, first, complete)

    def add(self, info: ChunkInfo, kv: np.ndarray) -> Optional[Assembled]:
        arrival = self.arrive(info, kv)
        if arrival.assembled is not None:
            return arrival.assembled
        return arrival.chunks.assembled() if arrival.complete else None

    @staticmethod
    def _file(request: Chunks, info: ChunkInfo, kv: np.ndarray) -> None:
        session = request.session
        if not 0 <= info.index < request.count:
            info.fail("error", f"chunk {info.index} outside the request's {request.count}")
            return
        if info.ok:
            if kv.ndim != 5 or kv.shape[3] != info.tokens or info.tokens != session.chunk_tokens:
                info.fail("error", f"restored KV has shape {list(kv.shape)}, expected {info.tokens} tokens")
            elif _dtype(kv) not in ("float16", "float32"):
                info.fail("error", f"restored KV is {_dtype(kv)}, not float16 or float32")
            elif request.shape is not None and request.shape != tuple(kv.shape):
                info.fail("error", f"restored KV has shape {list(kv.shape)}, other chunks {list(request.shape)}")
        try:
            if info.ok:
                request.shape = request.shape or tuple(kv.shape)
                session.put(info.index, kv)
            else:
                session.fail(info.index, f"{info.status}: {info.reason}")
        except ValueError as exc:  # the same chunk twice
            info.fail("error", str(exc))

    def _expire(self) -> None:  # (called with the lock held)
        now = time.monotonic()
        for session in [s for s, p in self._pending.items() if now - p.started > self.ttl_s]:
            del self._pending[session]

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)


def _dtype(kv) -> str:
    """numpy's or torch's dtype name: ``float16``, ``float32``..."""
    return np.dtype(kv.dtype).name if isinstance(kv, np.ndarray) else str(kv.dtype).replace("torch.", "")
