"""The x265 candidates on the ``video`` rung's planes: each candidate encodes every chunk's planes
once a round, the candidates interleaved within each round (``time_candidates``: ``s_per_chunk``,
the median over rounds, mean over chunks, wall clock; ``cpu_s_per_chunk``, the process's CPU time
over the same encodes, x265's threads included; ``bytes`` of the chunks' bitstreams), and the
restored KV's error against the engine's of each candidate's streams (``kv_mse``).
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Sequence

import numpy as np

from .encode_common import Candidate, _coder, _cpu, _summary


def time_candidates(planes: Sequence[np.ndarray], candidates: Sequence[Candidate], rounds: int,
                    pools: int = 0) -> Dict[str, Dict[str, Any]]:
    """Each candidate encodes each chunk's planes once a round, candidates interleaved."""
    wall: Dict[str, Dict[int, List[float]]] = {c.name: {} for c in candidates}
    cpu: Dict[str, Dict[int, List[float]]] = {c.name: {} for c in candidates}
    streams: Dict[str, List[bytes]] = {}
    for r in range(rounds):
        for i, p in enumerate(planes):
            for c in candidates:
                coder = _coder(c, pools=pools)
                c0, t0 = _cpu(), time.perf_counter()
                data = coder.encode(p)
                wall[c.name].setdefault(i, []).append(time.perf_counter() - t0)
                cpu[c.name].setdefault(i, []).append(_cpu() - c0)
                if r == 0:
                    streams.setdefault(c.name, []).append(data)
        print(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{c.name} {_summary(wall[c.name]):.2f}s" for c in candidates), flush=True)
    return {c.name: {"s_per_chunk": round(_summary(wall[c.name]), 3),
                     "cpu_s_per_chunk": round(_summary(cpu[c.name]), 3),
                     "bytes": sum(len(d) for d in streams[c.name]), "_streams": streams[c.name]}
            for c in candidates}


def kv_mse(layout, chunks, streams: Sequence[bytes]) -> float:
    """Mean squared error of the restored KV against the engine's, over every chunk's elements."""
    from kvcodec.bitstream.hevc import PyAVDecoder
    from kvcodec.format.geometry import Geometry

    dec = PyAVDecoder(threads=1)
    total, n = 0.0, 0
    for (kv, planes, side, start), data in zip(chunks, streams, strict=True):
        f, h, w = planes.shape
        decoded = np.stack(dec.decode(data, w, h, 10))
        restored = layout.from_planes(decoded, side, Geometry.of(kv), token_start=start).astype(np.float64)
        total += float(np.sum((restored - kv.astype(np.float64)) ** 2))
        n += kv.size
    return total / n
