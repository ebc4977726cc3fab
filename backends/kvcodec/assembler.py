"""Collects a request's restored chunks (they arrive one by one, as separate step calls) and
says when the request is complete.

``add(info, kv)`` returns ``None`` until all ``count`` chunks of ``info.session`` are in, then an
``Assembled``: the KV of the longest run of good chunks from the start (``None`` if there is
none) and the per-request statistics. Sessions that never complete are dropped after ``ttl_s``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from .chunkinfo import ChunkInfo


@dataclass
class Assembled:
    past_kv: Optional[np.ndarray]
    infos: List[ChunkInfo]
    reused_tokens: int
    reason: str = ""  # why reuse stopped short (empty when every planned chunk was used)

    def stats(self) -> dict:
        def total(step: str) -> float:
            return round(sum(i.s.get(step, 0.0) for i in self.infos), 6)

        t_request = min((i.t["request"] for i in self.infos if "request" in i.t), default=None)
        return {
            "reused_tokens": self.reused_tokens,
            "chunks_planned": self.infos[0].count if self.infos else 0,
            "chunks_used": sum(1 for i in self.infos if i.ok and i.count),
            "scheme": self.infos[0].scheme if self.infos else "",
            "schemes": _counts(i.scheme for i in self.infos if i.ok and i.count),
            "miss_reason": self.reason,
            "bytes_fetched": sum(i.bytes for i in self.infos),
            "fetch_s": total("fetch"),
            "decode_s": total("decode"),
            "restore_s": total("restore"),
            "t_request": t_request,
            "pipeline": overlap(self.infos),
            "chunks": [{"index": i.index, "status": i.status, "scheme": i.scheme, "scheme_id": i.scheme_id,
                        "bytes": i.bytes,
                        "t": i.t, "s": i.s, "choice": i.choice, "reason": i.reason} for i in self.infos],
        }


def _counts(names) -> dict:
    out: Dict[str, int] = {}
    for n in names:
        out[n] = out.get(n, 0) + 1
    return out


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


def overlap(infos: List[ChunkInfo]) -> dict:
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
    return {
        "transfer_s": round(sum(b - a for a, b in transfer), 6),
        "decode_s": round(totals["decode"], 6),
        "restore_s": round(totals["restore"], 6),
        "hidden_s": round(hidden, 6),
        "hidden_fraction": round(hidden / work_s, 4) if work_s else 0.0,
        "bound_s": round(max(totals.values()), 6) if used else 0.0,
        "slowest_stage": max(totals, key=totals.get) if used else "",
    }


@dataclass
class _Pending:
    started: float
    chunks: Dict[int, tuple] = field(default_factory=dict)


class Assembler:
    def __init__(self, ttl_s: float = 600.0) -> None:
        self.ttl_s = ttl_s
        self._pending: Dict[str, _Pending] = {}

    def add(self, info: ChunkInfo, kv: np.ndarray) -> Optional[Assembled]:
        self._expire()
        if info.count == 0:
            return Assembled(None, [info], 0, info.reason)
        pending = self._pending.setdefault(info.session, _Pending(time.monotonic()))
        pending.chunks[info.index] = (info, kv)
        if len(pending.chunks) < info.count:
            return None
        del self._pending[info.session]
        ordered = [pending.chunks[i] for i in sorted(pending.chunks)]
        good: List[np.ndarray] = []
        reason = ""
        for chunk_info, chunk_kv in ordered:
            if not chunk_info.ok:
                reason = f"chunk {chunk_info.index}: {chunk_info.status}: {chunk_info.reason}"
                break
            good.append(chunk_kv)
        past = np.concatenate(good, axis=3) if good else None
        reused = int(past.shape[3]) if past is not None else 0
        return Assembled(past, [c for c, _ in ordered], reused, reason)

    def _expire(self) -> None:
        now = time.monotonic()
        for session in [s for s, p in self._pending.items() if now - p.started > self.ttl_s]:
            del self._pending[session]

    def __len__(self) -> int:
        return len(self._pending)
