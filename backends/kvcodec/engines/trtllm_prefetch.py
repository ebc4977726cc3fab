"""The stock LLM-API deployment's background reader: a prompt's stored prefix into the stage.

TensorRT-LLM's unmodified llmapi model has no kv_fetch -> kv_decode -> kv_restore steps in front of
it, so the connector reads the store itself, never on the executor's thread: a prompt that finds
nothing staged calls ``request(ids, salt)`` (returns at once; one read per prefix in flight) and is
computed; a background thread plans the stored prefix (``serving.fetch.Fetcher``), reads, verifies,
decodes and restores its chunks (``serving.reader.ChunkReader``) and stages them in the pool's dtype
and device (``trtllm_shared.to_pool``) for the prompts that follow. Keys found corrupt go to the
shared ``corrupt`` set (the write-back sink replaces them). ``counters``: ``prefetches``,
``staged_tokens``, ``failed``.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Sequence, Set, Tuple

from ..errors import KVCodecError
from ..format.keys import reusable_chunks
from ..format.ladder import rung_name
from ..serving.fetch import Plan
from ..serving.reader import ChunkRef
from .trtllm_config import TrtllmConfig
from .trtllm_shared import Shared, to_pool

log = logging.getLogger("kvcodec.trtllm")


def ref_of(plan: Plan, index: int) -> ChunkRef:
    candidates = plan.candidates(index)
    candidates.sort(key=lambda c: c[0].identity != plan.scheme.identity)  # the run's rung first
    return ChunkRef(index, tuple(k for _, k in candidates), tuple(rung_name(s) for s, _ in candidates))


class Prefetcher:
    def __init__(self, cfg: TrtllmConfig, reads, shared: Shared) -> None:
        """``reads``: the scheduler's ``kvcodec.compose.Reads`` (its fetcher plans, its reader reads)."""
        self.cfg, self.shared = cfg, shared
        self.fetcher = reads.fetcher
        self.reader = reads.reader()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-prefetch")
        self._inflight: Set[Tuple[str, Tuple[int, ...]]] = set()
        self.counters = {"prefetches": 0, "staged_tokens": 0, "failed": 0}

    def request(self, ids: Sequence[int], salt: str) -> None:
        prefix = tuple(ids[:reusable_chunks(len(ids), self.cfg.chunk_tokens) * self.cfg.chunk_tokens])
        if not prefix or (salt, prefix) in self._inflight:  # one read per prefix and tenant
            return
        self._inflight.add((salt, prefix))
        self._pool.submit(self._read, prefix, list(ids), salt)

    @property
    def busy(self) -> bool:
        return bool(self._inflight)

    def _read(self, prefix: Tuple[int, ...], ids: List[int], salt: str) -> None:
        import numpy as np

        try:
            deadline = time.monotonic() + self.cfg.fetch_timeout_s
            # the tenant's chunks only: the store salt of the request's stage salt (trtllm_shared.Salts)
            plan = self.fetcher.plan(ids, deadline=deadline, salt=self.shared.salts.store_salt(salt))
            if not plan:
                return
            refs = [ref_of(plan, i) for i in range(plan.n_chunks)]
            chunks, why, corrupt = self.reader.read_run(refs, deadline)
            for key in corrupt:
                self.shared.corrupt.add(key)
            if chunks:
                kv = to_pool(np.concatenate(chunks, axis=3), self.shared.pages)
                if self.shared.stage.put(ids, kv, salt, self.cfg.chunk_tokens):
                    self.counters["prefetches"] += 1
                    self.counters["staged_tokens"] += len(chunks) * self.cfg.chunk_tokens
            if why:
                log.info("prefetch stopped after %d chunk(s): %s", len(chunks), why)
        except KVCodecError as exc:
            self.counters["failed"] += 1
            log.warning("prefetch failed: %s", exc)
        finally:
            self._inflight.discard((salt, prefix))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.reader.close()  # the fetcher is the reads' (closed with them)
