"""The ingest rate per rung: tokens per second of ``ChunkEncoder`` as ingest uses it (one encoder,
``threads=1``) for the default ladder and the baselines (``kvtc`` where ``SCHEMES`` has it, and
``video`` with a chosen candidate's tools), rungs interleaved (``ingest_rates``); and whole ingests
of the default ladder into a memory store with each number of chunk encoders (``ingest``'s pool),
interleaved (``ingest_pool``).
"""
from __future__ import annotations

import statistics
import time
import uuid
from typing import Any, Dict, List, Sequence

from .encode_common import Candidate, _summary, codec_params


def ingest_rates(engine, kv_chunks, chosen: Candidate, rounds: int, chunk_tokens: int) -> Dict[str, Any]:
    """Tokens/s of ChunkEncoder per rung (threads=1, as ingest's default), rungs interleaved."""
    from dataclasses import replace

    from kvcodec.encode import ChunkEncoder
    from kvcodec.format.auth import ChunkAuth
    from kvcodec.format.codecs import SCHEMES
    from kvcodec.format.ladder import DEFAULT_LADDER, parse_rung

    names = list(dict.fromkeys(list(DEFAULT_LADDER) + ["raw", "int8-zstd", "lossless8", "cachegen",
                                                       "transform-zstd", "video"]
                               + (["kvtc"] if "kvtc" in SCHEMES else [])))
    schemes = {n: parse_rung(n, engine.card) for n in names}
    schemes[f"video+{chosen.name}"] = replace(schemes["video"], codec_params=codec_params(chosen))
    auth = ChunkAuth.random()
    encoders = {n: ChunkEncoder(s, engine.model_id, auth=auth, threads=1) for n, s in schemes.items()}
    secs: Dict[str, Dict[int, List[float]]] = {n: {} for n in schemes}
    size: Dict[str, int] = {n: 0 for n in schemes}
    for r in range(rounds):
        for i, kv in enumerate(kv_chunks):
            for n, enc in encoders.items():
                t0 = time.perf_counter()
                data = enc.encode(kv, f"k{i}", i, i * chunk_tokens)
                secs[n].setdefault(i, []).append(time.perf_counter() - t0)
                if r == 0:
                    size[n] += len(data)
    fp16 = sum(kv.size * 2 for kv in kv_chunks)
    rows = {}
    for n in schemes:
        s = _summary(secs[n])
        rows[n] = {"s_per_chunk": round(s, 3), "tokens_per_s": round(chunk_tokens / s, 1),
                   "ratio_vs_fp16": round(fp16 / size[n], 3), "in_default_ladder": n in DEFAULT_LADDER}
        print(f"  ingest {n}: {s:.3f} s/chunk, {chunk_tokens / s:.0f} tokens/s", flush=True)
    return rows


def ingest_pool(engine, ids: Sequence[int], chunk_tokens: int, workers: Sequence[int], rounds: int,
                threads: int = 1) -> Dict[str, Any]:
    """Whole ingests (prefill + every rung of the default ladder) into a fresh memory store, with
    each number of chunk workers of ``kvcodec.ingest.ingest``, interleaved over ``rounds``."""
    from kvcodec.format.auth import ChunkAuth
    from kvcodec.format.ladder import DEFAULT_LADDER, parse_ladder
    from kvcodec.ingest import ingest
    from kvcodec.store.memory import MemoryStore

    schemes = parse_ladder(list(DEFAULT_LADDER), engine.card)
    auth = ChunkAuth.random()
    secs: Dict[int, List[float]] = {w: [] for w in workers}
    encode_s: Dict[int, List[float]] = {w: [] for w in workers}
    for _ in range(rounds):
        for w in workers:
            store = MemoryStore(f"encode-speed-{uuid.uuid4().hex}")  # a fresh, empty store each run
            t0 = time.perf_counter()
            rep = ingest(engine, store, ids, schemes, chunk_tokens, auth=auth, threads=threads, workers=w)
            secs[w].append(time.perf_counter() - t0)
            assert rep.written == len(schemes) * (len(ids) // chunk_tokens), rep
            for key in list(store._data):
                store.delete(key)
            encode_s[w].append(rep.encode_s)
            print(f"  ingest of the default ladder, workers={w}: {secs[w][-1]:.1f} s", flush=True)
    n = len(ids) // chunk_tokens * chunk_tokens
    return {str(w): {"s": round(statistics.median(secs[w]), 2), "tokens_per_s": round(n / statistics.median(secs[w]), 1),
                     "runs_s": [round(x, 2) for x in secs[w]]} for w in workers}
