"""Ingest: prefill a context once and store its KV, chunk by chunk, under prefix-chained keys.

Each chunk is stored once per rung of the ladder given (several quality levels let the fetcher
adapt to the link); the context is prefilled once for all of them. Chunks already in the store are
not written again; when every chunk of every rung is there, prefill is skipped. Only full chunks
are stored (the tail of a context is recomputed at request time). What it measures (bytes and
decode time per rung, prefill time) goes to the cost model the serving fetcher reads.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Union

from .encode import ChunkEncoder
from .format.auth import ChunkAuth
from .format.codecs import Scheme
from .format.keys import chunk_keys
from .format.ladder import rung_name
from .serving.costs import CostModel
from .store import KVStore


@dataclass
class RungReport:
    written: int = 0
    bytes_written: int = 0
    fp16_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0

    @property
    def ratio_vs_fp16(self) -> float:
        return self.fp16_bytes / self.bytes_written if self.bytes_written else 0.0


@dataclass
class IngestReport:
    tokens: int
    chunks: int
    written: int
    bytes_written: int
    fp16_bytes: int
    prefill_s: float
    encode_s: float
    rungs: Dict[str, RungReport] = field(default_factory=dict)

    @property
    def ratio_vs_fp16(self) -> float:
        return self.fp16_bytes / self.bytes_written if self.bytes_written else 0.0


def ingest(engine, store: KVStore, token_ids: Sequence[int], scheme: Union[Scheme, Sequence[Scheme]],
           chunk_tokens: int, *, auth: ChunkAuth, threads: int = 1,
           progress: Optional[Callable[[int], None]] = None, costs: Optional[CostModel] = None) -> IngestReport:
    """Store every full chunk of ``token_ids`` for each scheme, signed with ``auth``; ``progress(n)``
    is called as each chunk is done (all its rungs)."""
    schemes: List[Scheme] = [scheme] if isinstance(scheme, Scheme) else list(scheme)
    keys = {s.identity: chunk_keys(token_ids, engine.model_id, s.identity, chunk_tokens) for s in schemes}
    n_chunks = len(token_ids) // chunk_tokens
    report = IngestReport(len(token_ids), n_chunks, 0, 0, 0, 0.0, 0.0,
                          {rung_name(s): RungReport() for s in schemes})
    if all(store.exists(k) for ks in keys.values() for k in ks):
        if progress:
            progress(n_chunks)
        return report
    encoders = {s.identity: ChunkEncoder(s, engine.model_id, auth=auth, threads=threads) for s in schemes}
    t = time.perf_counter()
    for i, kv in enumerate(engine.prefill_chunks(token_ids, chunk_tokens)):
        report.prefill_s += time.perf_counter() - t
        for s in schemes:
            key, rung = keys[s.identity][i], report.rungs[rung_name(s)]
            if store.exists(key):
                continue
            t_enc = time.perf_counter()
            data = encoders[s.identity].encode(kv, key, i, i * chunk_tokens)
            store.put(key, data)
            rung.encode_s += time.perf_counter() - t_enc
            rung.decode_s += encoders[s.identity].last_decode_s
            rung.written += 1
            rung.bytes_written += len(data)
            rung.fp16_bytes += kv.size * 2
            if costs is not None:
                costs.observe_rung(s.identity, chunk_tokens, len(data), encoders[s.identity].last_decode_s)
        t = time.perf_counter()
        if progress:
            progress(1)
    for rung in report.rungs.values():
        report.written += rung.written
        report.bytes_written += rung.bytes_written
        report.fp16_bytes += rung.fp16_bytes
        report.encode_s += rung.encode_s
    if costs is not None and report.prefill_s:
        costs.observe_prefill(n_chunks * chunk_tokens, report.prefill_s)
    return report


def ingest_rungs(settings, engine, token_ids: Sequence[int], rungs: Union[str, Sequence[str], None] = None,
                 store_url: Optional[str] = None, threads: Optional[int] = None,
                 progress: Optional[Callable[[int], None]] = None) -> IngestReport:
    """The one ingest path of the CLI and the tools: ``token_ids`` into the store at each rung
    (a ladder spec; default: the settings' ladder), bound to the engine's card (codec profile, KV
    dtype: ``Scheme.for_card``), with the measured costs recorded where the serving steps of
    ``settings`` read them; signed with the deployment's chunk key (``format.auth.load_auth``)."""
    from dataclasses import replace

    from .format.auth import load_auth
    from .format.ladder import parse_ladder
    from .serving.costs import for_settings
    from .store import open_store

    schemes = parse_ladder(rungs or list(settings.ladder), engine.card)
    url = store_url or settings.store
    costs = for_settings(replace(settings, store=url), engine.geometry(1).fp16_bytes)
    with open_store(url) as store:
        return ingest(engine, store, token_ids, schemes, settings.chunk_tokens, auth=load_auth(settings.key_file),
                      threads=max(1, threads if threads is not None else settings.threads), progress=progress,
                      costs=costs)
