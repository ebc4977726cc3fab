"""Ingest: prefill a context once and store its KV, chunk by chunk, under prefix-chained keys.

Chunks already in the store are not written again; when every chunk is there, prefill is skipped.
Only full chunks are stored (the tail of a context is recomputed at request time).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .chunk import ChunkEncoder
from .keys import chunk_keys
from .schemes import Scheme
from .store import KVStore


@dataclass
class IngestReport:
    tokens: int
    chunks: int
    written: int
    bytes_written: int
    fp16_bytes: int
    prefill_s: float
    encode_s: float

    @property
    def ratio_vs_fp16(self) -> float:
        return self.fp16_bytes / self.bytes_written if self.bytes_written else 0.0


def ingest(engine, store: KVStore, token_ids: Sequence[int], scheme: Scheme, chunk_tokens: int,
           threads: int = 1, progress: Optional[Callable[[int], None]] = None) -> IngestReport:
    """Store every full chunk of ``token_ids``; ``progress(n)`` is called as each chunk is done."""
    keys = chunk_keys(token_ids, engine.model_id, scheme.identity, chunk_tokens)
    report = IngestReport(len(token_ids), len(keys), 0, 0, 0, 0.0, 0.0)
    if all(store.exists(k) for k in keys):
        if progress:
            progress(len(keys))
        return report
    encoder = ChunkEncoder(scheme, engine.model_id, threads=threads)
    t = time.perf_counter()
    for i, kv in enumerate(engine.prefill_chunks(token_ids, chunk_tokens)):
        t_enc = time.perf_counter()
        report.prefill_s += t_enc - t
        if not store.exists(keys[i]):
            data = encoder.encode(kv, keys[i], i, i * chunk_tokens)
            store.put(keys[i], data)
            report.written += 1
            report.bytes_written += len(data)
            report.fp16_bytes += kv.size * 2
        t = time.perf_counter()
        report.encode_s += t - t_enc
        if progress:
            progress(1)
    return report
