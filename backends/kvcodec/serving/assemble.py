"""Collects a request's restored chunks (they arrive one by one, as separate step calls) and
says when the request is complete.

``add(info, kv)`` copies each chunk into its slot of one preallocated array per request (no
concatenation, and no reference kept to the step's input buffers), in float16, or in float32 once a
float32 chunk (``raw`` on a float32 engine) is among them: the adaptive fetcher may mix rungs, and
float16 widens to float32 exactly, so every chunk stays what it restored to. It returns ``None`` until
all ``count`` chunks of ``info.session`` are in, then an ``Assembled``: the KV of the longest run
of good chunks from the start (a view of that array; ``None`` if there is none) and the
per-request statistics. Sessions that never complete are dropped after ``ttl_s``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from .chunkinfo import ChunkInfo
from .stats import RequestStats


@dataclass
class Assembled:
    past_kv: Optional[np.ndarray]  # float16|float32 [layers, 2, kv_heads, reused_tokens, head_dim] (a view), or None
    infos: List[ChunkInfo]
    reused_tokens: int
    reason: str = ""  # why reuse stopped short (empty when every planned chunk was used)

    def stats(self) -> RequestStats:
        return RequestStats.from_chunks(self.infos, self.reused_tokens, self.reason)


@dataclass
class _Pending:
    started: float
    infos: Dict[int, ChunkInfo] = field(default_factory=dict)
    kv: Optional[np.ndarray] = None  # the request's KV, one slot per chunk, allocated at its first good chunk


class Assembler:
    def __init__(self, ttl_s: float = 600.0) -> None:
        self.ttl_s = ttl_s
        self._pending: Dict[str, _Pending] = {}

    def add(self, info: ChunkInfo, kv: np.ndarray) -> Optional[Assembled]:
        """Copy ``kv`` (which may be a view of a step's input buffer) into its slot of the request."""
        self._expire()
        if info.count == 0:
            return Assembled(None, [info], 0, info.reason)
        pending = self._pending.setdefault(info.session, _Pending(time.monotonic()))
        pending.infos[info.index] = info
        if info.ok:
            if kv.ndim != 5 or kv.shape[3] != info.tokens:
                info.fail("error", f"restored KV has shape {list(kv.shape)}, expected {info.tokens} tokens")
            else:
                if pending.kv is None:
                    layers, two, heads, _, dim = kv.shape
                    pending.kv = np.empty((layers, two, heads, info.count * info.tokens, dim), dtype=kv.dtype)
                start = info.index * info.tokens
                if pending.kv.shape[:3] + pending.kv.shape[4:] != kv.shape[:3] + kv.shape[4:]:
                    info.fail("error", f"restored KV has shape {list(kv.shape)}, other chunks "
                                       f"{list(pending.kv.shape)}")
                else:
                    if kv.dtype.itemsize > pending.kv.dtype.itemsize:  # a float32 chunk among float16 ones:
                        pending.kv = pending.kv.astype(kv.dtype)  # widen the request (exact), once
                    pending.kv[:, :, :, start:start + info.tokens] = kv  # float16 into float32: exact
        if len(pending.infos) < info.count:
            return None
        del self._pending[info.session]
        ordered = [pending.infos[i] for i in sorted(pending.infos)]
        reused, reason = 0, ""
        for chunk_info in ordered:
            if not chunk_info.ok:
                reason = f"chunk {chunk_info.index}: {chunk_info.status}: {chunk_info.reason}"
                break
            reused += chunk_info.tokens
        past = pending.kv[:, :, :, :reused] if reused and pending.kv is not None else None
        return Assembled(past, ordered, reused, reason)

    def _expire(self) -> None:
        now = time.monotonic()
        for session in [s for s, p in self._pending.items() if now - p.started > self.ttl_s]:
            del self._pending[session]

    def __len__(self) -> int:
        return len(self._pending)
