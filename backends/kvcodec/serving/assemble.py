"""Collects a request's restored chunks (they arrive one by one, as separate step calls) and
says when the request is complete.

``add(info, kv)`` copies each chunk into its slot of one preallocated float16 array per request
(no concatenation, and no reference kept to the step's input buffers) and returns ``None`` until
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
from .stats import Pipeline, RequestStats


@dataclass
class Assembled:
    past_kv: Optional[np.ndarray]  # float16 [layers, 2, kv_heads, reused_tokens, head_dim] (a view), or None
    infos: List[ChunkInfo]
    reused_tokens: int
    reason: str = ""  # why reuse stopped short (empty when every planned chunk was used)

    def stats(self) -> RequestStats:
        return RequestStats.from_chunks(self.infos, self.reused_tokens, self.reason)


def _union(intervals: List[tuple]) -> List[tuple]:
    merged: List[list] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [tuple(m) for m in merged]


def _intersection(a: List[tuple], b: List[tuple]) -> float:
    total = 0.0
    for x0, x1 in a:
        for y0, y1 in b:
            total += max(0.0, min(x1, y1) - max(x0, y0))
    return total


def overlap(infos: List[ChunkInfo]) -> Pipeline:
    """How much of the decode and restore work ran while chunks were still on the wire.

    Intervals come from each chunk's wall-clock stamps: transfer ``[fetch_start, sent]``, decode
    ``[decoded - s.decode, decoded]``, restore ``[restored - s.restore, restored]``. ``hidden_s`` is
    the decode and restore time that fell inside some transfer; ``bound_s`` (the pipeline bound
    without the first-token compute) is the slowest stage's total.
    """
    used = [i for i in infos if i.count and "fetch_start" in i.t and "sent" in i.t]
    transfer = _union([(i.t["fetch_start"], i.t["sent"]) for i in used])
    work = []
    for i in used:
        for stamp, step in (("decoded", "decode"), ("restored", "restore")):
            if stamp in i.t and step in i.s:
                work.append((i.t[stamp] - i.s[step], i.t[stamp]))
    totals = {step: sum(i.s.get(step, 0.0) for i in used) for step in ("fetch", "decode", "restore")}
    work_s = totals["decode"] + totals["restore"]
    hidden = _intersection(_union(work), transfer)
    return Pipeline(
        transfer_s=round(sum(b - a for a, b in transfer), 6),
        decode_s=round(totals["decode"], 6),
        restore_s=round(totals["restore"], 6),
        hidden_s=round(hidden, 6),
        hidden_fraction=round(hidden / work_s, 4) if work_s else 0.0,
        bound_s=round(max(totals.values()), 6) if used else 0.0,
        slowest_stage=max(totals, key=totals.get) if used else "",
    )


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
                    pending.kv = np.empty((layers, two, heads, info.count * info.tokens, dim), dtype=np.float16)
                start = info.index * info.tokens
                if pending.kv.shape[:3] + pending.kv.shape[4:] != kv.shape[:3] + kv.shape[4:]:
                    info.fail("error", f"restored KV has shape {list(kv.shape)}, other chunks "
                                       f"{list(pending.kv.shape)}")
                else:
                    pending.kv[:, :, :, start:start + info.tokens] = kv
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
