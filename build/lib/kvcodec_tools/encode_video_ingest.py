"""Whole ingests of one rung each (``RUNG@WORKERS``: ``video@1``, ``video-fast@2``) into a memory
store, interleaved over rounds (``video_ingest``): the encodes' wall clock (the ingest's less its
prefill), the speed-up and bytes against the first, tokens per second of the whole ingest.
"""
from __future__ import annotations

import statistics
import time
import uuid
from typing import Any, Dict, List, Sequence


def video_ingest(engine, ids: Sequence[int], chunk_tokens: int, configs: Sequence[tuple], rounds: int,
                 threads: int = 1) -> Dict[str, Any]:
    """Whole ingests of one rung each (``configs``: ``(rung spec, workers)``) into a fresh memory
    store, interleaved over ``rounds``: the wall clock of the encodes (the ingest's wall clock less
    its prefill, the same work for every config), tokens per second of the whole ingest, and the
    bytes stored. ``speedup`` and ``bytes_vs_first`` are against the first config (the rung as
    ingest ran it before: ``video``, one chunk at a time)."""
    from kvcodec.format.auth import ChunkAuth
    from kvcodec.format.ladder import parse_rung
    from kvcodec.ingest import ingest
    from kvcodec.store.memory import MemoryStore

    auth = ChunkAuth.random()
    name = lambda spec, w: f"{spec} x{w}"  # noqa: E731
    encode: Dict[str, List[float]] = {name(*c): [] for c in configs}
    total: Dict[str, List[float]] = {name(*c): [] for c in configs}
    size: Dict[str, int] = {}
    for _ in range(rounds):
        for spec, w in configs:
            store = MemoryStore(f"video-ingest-{uuid.uuid4().hex}")
            t0 = time.perf_counter()
            rep = ingest(engine, store, ids, [parse_rung(spec, engine.card)], chunk_tokens, auth=auth,
                         threads=threads, workers=w)
            wall = time.perf_counter() - t0
            for key in list(store._data):
                store.delete(key)
            n = name(spec, w)
            total[n].append(wall)
            encode[n].append(wall - rep.prefill_s)
            size[n] = rep.bytes_written
            print(f"  ingest {n}: {wall:.1f} s, of which encode {wall - rep.prefill_s:.1f} s", flush=True)
    first = name(*configs[0])
    tokens = len(ids) // chunk_tokens * chunk_tokens
    e0 = statistics.median(encode[first])
    return {n: {"encode_wall_s": round(statistics.median(encode[n]), 2),
                "speedup": round(e0 / statistics.median(encode[n]), 3),
                "ingest_tokens_per_s": round(tokens / statistics.median(total[n]), 1),
                "bytes": size[n], "bytes_vs_first": round(size[n] / size[first] - 1, 5),
                "encode_runs_s": [round(x, 2) for x in encode[n]]} for n in encode}
