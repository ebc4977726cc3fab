"""Ingest: prefill a context once and store its KV, chunk by chunk, under prefix-chained keys.

Each chunk is stored once per rung of the ladder given (several quality levels let the fetcher
adapt to the link); the context is prefilled once for all of them. Chunks already in the store are
not written again; when every chunk of every rung is there, prefill is skipped. Only full chunks
are stored (the tail of a context is recomputed at request time). What it measures (bytes and
decode time per rung, prefill time) goes to the cost model the serving fetcher reads.

``workers`` chunk encoders run side by side (threads, each with its own encoders: x265, zstd and
FFmpeg's decode release the GIL), over the chunks as prefill makes them, so that encoding overlaps
prefill and the next chunks; results are stored and counted in chunk order, as with one worker.
x265 alone keeps ~1.6 of 2 cores busy on a chunk (3 rows of wavefronts); two chunks at once fill
both (``perf/results/README.md``, "Encode speed").
"""
from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

from .connector.save import ChunkSaver
from .format.auth import ChunkAuth
from .format.codecs import Scheme
from .format.keys import chunk_keys, tenant_id
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


def default_workers() -> int:
    """Chunk encoders ingest runs side by side unless told: one per core this process may use, at
    most 2 (measured on 2 cores; more would only share the same cores)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


def ingest(engine, store: KVStore, token_ids: Sequence[int], scheme: Union[Scheme, Sequence[Scheme]],
           chunk_tokens: int, *, auth: ChunkAuth, threads: int = 1, workers: int = 1,
           progress: Optional[Callable[[int], None]] = None, costs: Optional[CostModel] = None,
           salt: str = "") -> IngestReport:
    """Store every full chunk of ``token_ids`` for each scheme, signed with ``auth``, under the keys of
    cache salt ``salt`` (a tenant's; "" unsalted); ``progress(n)``
    is called as each chunk is done (all its rungs). ``workers`` chunks are encoded at once (each
    encoder with ``threads`` threads); ``encode_s`` then adds up the workers' seconds."""
    schemes: List[Scheme] = [scheme] if isinstance(scheme, Scheme) else list(scheme)
    keys = {s.identity: chunk_keys(token_ids, engine.model_id, s.identity, chunk_tokens, salt=salt) for s in schemes}
    tenant = tenant_id(salt)
    n_chunks = len(token_ids) // chunk_tokens
    report = IngestReport(len(token_ids), n_chunks, 0, 0, 0, 0.0, 0.0,
                          {rung_name(s): RungReport() for s in schemes})
    if all(store.exists(k) for ks in keys.values() for k in ks):
        if progress:
            progress(n_chunks)
        return report
    workers = max(1, int(workers))
    encoders = ChunkSaver(store, engine.model_id, schemes, chunk_tokens, auth=auth, threads=threads)  # per thread
    # (chunk's fp16 bytes, [(scheme, key, result)]) per chunk, oldest first: stored in this order
    pending: Deque[Tuple[int, List[Tuple[Scheme, str, Future]]]] = deque()

    def finish_oldest() -> None:
        fp16, jobs = pending.popleft()
        for s, key, job in jobs:
            data, encode_s, decode_s, restore_s = job.result()
            rung = report.rungs[rung_name(s)]
            rung.encode_s += encode_s
            rung.decode_s += decode_s
            if store.put(key, data):  # False: another writer stored this chunk meanwhile (its copy stays)
                rung.written += 1
                rung.bytes_written += len(data)
                rung.fp16_bytes += fp16
            if costs is not None:
                costs.observe_rung(s.identity, chunk_tokens, len(data), decode_s, restore_s)
        if progress:
            progress(1)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvcodec-ingest") if workers > 1 else \
            _Inline() as pool:
        try:
            t = time.perf_counter()
            for i, kv in enumerate(engine.prefill_chunks(token_ids, chunk_tokens)):
                report.prefill_s += time.perf_counter() - t
                jobs = [(s, keys[s.identity][i], pool.submit(encoders.encode, s, kv, keys[s.identity][i], i,
                                                             i * chunk_tokens, tenant))
                        for s in schemes if not store.exists(keys[s.identity][i])]
                pending.append((kv.size * 2, jobs))
                # one worker: each chunk stored at once; else ``workers`` chunks encode while
                # prefill makes the next one (bounded memory: at most workers + 1 chunks held)
                while len(pending) > (workers if workers > 1 else 0):
                    finish_oldest()
                t = time.perf_counter()
            while pending:
                finish_oldest()
        except BaseException:
            for _, jobs in pending:
                for _, _, job in jobs:
                    job.cancel()
            raise
    for rung in report.rungs.values():
        report.written += rung.written
        report.bytes_written += rung.bytes_written
        report.fp16_bytes += rung.fp16_bytes
        report.encode_s += rung.encode_s
    if costs is not None and report.prefill_s:
        costs.observe_prefill(n_chunks * chunk_tokens, report.prefill_s)
    return report


class _Inline:
    """``ThreadPoolExecutor``'s ``submit`` run at once in the caller (one worker: no thread)."""

    def __enter__(self) -> "_Inline":
        return self

    def __exit__(self, *exc) -> None:
        pass

    @staticmethod
    def submit(fn, *args) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args))
        except BaseException as exc:  # raised where the result is read, as from a pool
            f.set_exception(exc)
        return f


def ingest_rungs(settings, engine, token_ids: Sequence[int], rungs: Union[str, Sequence[str], None] = None,
                 store_url: Optional[str] = None, threads: Optional[int] = None,
                 progress: Optional[Callable[[int], None]] = None, workers: Optional[int] = None,
                 salt: str = "") -> IngestReport:
    """The one ingest path of the CLI and the tools: ``token_ids`` into the store at each rung
    (a ladder spec; default: the settings' ladder), bound to the engine's card (codec profile, KV
    dtype: ``Scheme.for_card``), with the measured costs recorded where the serving steps of
    ``settings`` read them; signed with the deployment's chunk key (``format.auth.auth_for``).
    ``workers``: chunk encoders side by side (default: the settings' ``ingest_workers``, whose 0
    means ``default_workers()``); ``salt``: the tenant's cache salt (``format.keys``)."""
    from dataclasses import replace

    from .format.auth import auth_for
    from .format.ladder import parse_ladder
    from .serving.costs import for_settings
    from .store import open_store

    schemes = parse_ladder(rungs or list(settings.ladder), engine.card)
    url = store_url or settings.store
    costs = for_settings(replace(settings, store=url), engine.geometry(1).fp16_bytes)
    with open_store(url) as store:
        return ingest(engine, store, token_ids, schemes, settings.chunk_tokens, auth=auth_for(settings),
                      threads=max(1, threads if threads is not None else settings.threads), progress=progress,
                      costs=costs, workers=_workers(settings, workers), salt=salt)


def _workers(settings, workers: Optional[int]) -> int:
    if workers is None:
        workers = settings.ingest_workers or default_workers()
    return max(1, int(workers))
