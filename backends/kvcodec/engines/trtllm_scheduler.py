"""TensorRT-LLM's connector, scheduler half (rank 0, on the executor's thread): never blocks.

Per new context request TensorRT-LLM calls ``get_num_new_matched_tokens(request, num_computed_tokens)``
on its executor thread (inside C++ ``addSequence``; on main under the radix-tree mutex): every
generation in flight waits for the answer. So the answer comes from the ``Stage`` alone (a dict
look-up and a few hashes): the longest staged prefix of the prompt, block-aligned after the device's
own prefix hit, one prompt token left (``connector.matched_tokens``), promised as an asynchronous
load, ``(n, True)``. Nothing that can fail is promised: the staged KV is restored, verified and
shaped for the model before it is staged, so a load never falls short of its promise and no stale
KV can enter TensorRT-LLM's block-reuse tree through us. A prompt with nothing staged gets ``(0,
False)`` and is computed; in the stock deployment (``prefetch``) its stored prefix is read into the
stage in the background for the prompts that follow.

``update_state_after_alloc(request, block_ids)`` starts the copy into the request's blocks (on a
copy thread: ``LoadSession.attach``); the worker reports the request in ``get_finished``'s loading
list once it is both started (``started_loading_req_ids``) and loaded. Saves: ``SaveTracker`` names,
in the step whose forward completes them, the prompt's full chunks the store did not give (a stored
copy found corrupt is replaced); the metadata carries them to the worker. Warm-up and padding
dummies are ignored; entries of requests that never finish are bounded (``MAX_TRACKED``).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from ..connector import HandOff, LoadSession, SaveJob, SaveTracker, chunks_to_save, matched_tokens, prompt_key
from ..errors import KVCodecError, Unsupported
from ..format.keys import chunk_keys, reusable_chunks
from ..format.ladder import parse_ladder, rung_name
from ..serving.fetch import Fetcher, Plan
from ..serving.reader import ChunkReader, ChunkRef
from ..store import KVStore, open_store
from . import trtllm_compat as compat
from .trtllm_config import TrtllmConfig, load_config
from .trtllm_stage import MAX_TRACKED, Loads, Stage

log = logging.getLogger("kvcodec.trtllm")

_SchedulerBase, _, _ = compat.bases()


@dataclass
class KVCodecMeta:
    """The step's metadata (pickled to every rank): only the saves; loads are parked requests,
    outside the scheduler output, copied by the scheduler's process."""

    saves: List[SaveJob] = field(default_factory=list)


class Prefetcher:
    """The stock deployment's background reader: a prompt's stored prefix into the stage."""

    def __init__(self, cfg: TrtllmConfig, store: KVStore, stage: Stage) -> None:
        self.cfg, self.stage = cfg, stage
        self.fetcher = Fetcher(store, cfg.card.model_id, cfg.ladder, cfg.chunk_tokens, card=cfg.card,
                               timeout_s=cfg.fetch_timeout_s)
        self.reader = ChunkReader(cfg.card, store, cfg.auth(), decoder=cfg.decoder, threads=cfg.threads,
                                  chunk_tokens=cfg.chunk_tokens)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-prefetch")
        self._inflight: Set[Tuple[int, ...]] = set()
        self.corrupt: "OrderedDict[str, None]" = OrderedDict()  # keys found corrupt: write-back replaces them
        self.counters = {"prefetches": 0, "staged_tokens": 0, "failed": 0}

    def request(self, ids: Sequence[int], salt: str) -> None:
        prefix = tuple(ids[:reusable_chunks(len(ids), self.cfg.chunk_tokens) * self.cfg.chunk_tokens])
        if not prefix or prefix in self._inflight:
            return
        self._inflight.add(prefix)
        self._pool.submit(self._read, prefix, list(ids), salt)

    def _read(self, prefix: Tuple[int, ...], ids: List[int], salt: str) -> None:
        import numpy as np

        try:
            deadline = time.monotonic() + self.cfg.fetch_timeout_s
            plan = self.fetcher.plan(ids, deadline=deadline)
            if not plan:
                return
            refs = [ref_of(plan, i) for i in range(plan.n_chunks)]
            chunks, why, corrupt = self.reader.read_run(refs, deadline)
            for key in corrupt:
                self.corrupt[key] = None
            while len(self.corrupt) > MAX_TRACKED:
                self.corrupt.popitem(last=False)
            if chunks:
                self.stage.put(ids, np.concatenate(chunks, axis=3), salt, self.cfg.chunk_tokens)
                self.counters["prefetches"] += 1
                self.counters["staged_tokens"] += len(chunks) * self.cfg.chunk_tokens
            if why:
                log.info("prefetch stopped after %d chunk(s): %s", len(chunks), why)
        except KVCodecError as exc:
            self.counters["failed"] += 1
            log.warning("prefetch failed: %s", exc)
        finally:
            self._inflight.discard(prefix)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.fetcher.close()
        self.reader.close()


def ref_of(plan: Plan, index: int) -> ChunkRef:
    candidates = plan.candidates(index)
    candidates.sort(key=lambda c: c[0].identity != plan.scheme.identity)  # the run's rung first
    return ChunkRef(index, tuple(k for _, k in candidates), tuple(rung_name(s) for s, _ in candidates))


class KVCodecScheduler(_SchedulerBase):
    def __init__(self, llm_args: Any = None, config: Optional[TrtllmConfig] = None,
                 store: Optional[KVStore] = None, stage: Optional[Stage] = None, loads: Optional[Loads] = None,
                 pages_of=None, prefetch: Optional[bool] = None) -> None:
        from . import trtllm_connector as shared  # the process-wide stage, loads and pool

        super().__init__(llm_args)
        self.cfg = config or load_config()
        self.tokens_per_block = compat.tokens_per_block(llm_args)
        if self.tokens_per_block is None:
            raise Unsupported("llm_args.kv_cache_config.tokens_per_block not found: not TensorRT-LLM 1.2's llm_args?")
        compat.check_cuda_graphs(llm_args, compat.version())
        reuse = getattr(getattr(llm_args, "kv_cache_config", None), "enable_block_reuse", True)
        if reuse is False:
            log.warning("kv_cache_config.enable_block_reuse is off: TensorRT-LLM ignores KV connectors then")
        card = self.cfg.card
        self.store = store or open_store(self.cfg.store)
        self.stage = shared.STAGE if stage is None else stage
        self.loads = shared.LOADS if loads is None else loads
        self._handoff: HandOff = shared.HANDOFF if pages_of is None else HandOff()
        self._pages_of = pages_of or (lambda: shared.HANDOFF.pages)
        prefetch = self.cfg.prefetch if prefetch is None else prefetch
        self.prefetcher = Prefetcher(self.cfg, self.store, self.stage) if prefetch else None
        self.writeback = parse_ladder(list(self.cfg.writeback), card) if self.cfg.writeback else []
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        self._matched: "OrderedDict[int, Tuple[LoadSession, int, int]]" = OrderedDict()
        self._first_step: Dict[int, int] = {}
        self._saves: SaveTracker = SaveTracker()
        self.counters = {"requests": 0, "matched_tokens": 0, "staged_misses": 0, "dummies": 0}

    # -- TensorRT-LLM's calls ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        rid = request.request_id
        self._forget(rid)
        if compat.is_dummy(request):
            self.counters["dummies"] += 1
            return 0, False
        ids, salt = compat.prompt(request), compat.cache_salt(request)
        chunk, computed = self.cfg.chunk_tokens, int(num_computed_tokens)
        kv, staged = self.stage.longest(ids, chunk, salt, limit=len(ids) - 1)
        if kv is None and self.prefetcher is not None:
            self.prefetcher.request(ids, salt)
            self.counters["staged_misses"] += 1
        aligned = computed % self.tokens_per_block == 0  # a device hit ending inside a block: no load
        n = matched_tokens(staged, len(ids), self.tokens_per_block, computed) if aligned and kv is not None else 0
        if n and not self._fits(kv):
            n = 0
        if self.writeback:
            self._track(rid, ids, max(staged if n else 0, computed))
        self.counters["requests"] += 1
        if not n:
            return 0, False
        self._matched[rid] = (LoadSession.of(kv[:, :, :, :computed + n], chunk), computed, n)
        self._first_step[rid] = n
        while len(self._matched) > MAX_TRACKED:
            self._matched.popitem(last=False)
        self.counters["matched_tokens"] += n
        if self.prefetcher is None:  # the ensemble's engine (trtllm_engine) reports what was promised
            self._handoff.post("promised:" + prompt_key(ids, salt), n)
        log.info("request %s: %d of %d prompt tokens from the stage (device had %d)", rid, n, len(ids), computed)
        return n, True

    def commit_new_matched_tokens(self, request: Any, num_tokens: int) -> None:
        """1.3+ (KVCacheManagerV2): the runtime took ``num_tokens`` of those offered; load only those."""
        entry = self._matched.get(request.request_id)
        if entry is not None and 0 <= num_tokens < entry[2]:
            session, start, _ = entry
            if num_tokens == 0:
                self._matched.pop(request.request_id)
            else:
                self._matched[request.request_id] = (session, start, num_tokens)

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int]) -> None:
        rid = request.request_id
        blocks = [int(b) for b in block_ids]
        self._saves.add_blocks(rid, blocks, replace=True)
        entry = self._matched.pop(rid, None)
        if entry is None:
            return
        session, start, n = entry
        self.loads.put(rid, session)
        pages = self._pages_of()
        self._copier.submit(self._copy, rid, session, pages, blocks, start, n)

    @staticmethod
    def _copy(rid: int, session: LoadSession, pages, blocks: List[int], start: int, n: int) -> None:
        try:
            session.attach(pages, blocks, start, n)
        except Exception:  # nothing staged can fail here but a device error: said loudly, counted by the worker
            log.exception("request %s: copying its staged KV into the blocks failed", rid)

    def build_connector_meta(self, scheduler_output: Any) -> KVCodecMeta:
        meta = KVCodecMeta()
        for req in scheduler_output.new_requests:
            # ``computed_position`` leaves out the connector's tokens on a request's first step
            extra = self._first_step.pop(req.request_id, 0)
            if req.request_id in self._saves:
                if not self._saves.has_blocks(req.request_id):
                    self._saves.add_blocks(req.request_id, req.new_block_ids, replace=True)
                self._step_save(meta, req.request_id, req.computed_position + extra + req.num_scheduled_tokens)
        for req in scheduler_output.cached_requests:
            if req.request_id in self._saves:
                self._saves.add_blocks(req.request_id, req.new_block_ids)
                self._step_save(meta, req.request_id, req.computed_position + req.num_scheduled_tokens)
        return meta

    def request_finished(self, request: Any, cache_block_ids: Sequence[int]) -> bool:
        self._forget(request.request_id)
        return False  # saves are copied out of the blocks in the step that completes the prefill

    # -- helpers -----------------------------------------------------------------------------------
    def _fits(self, kv) -> bool:
        card = self.cfg.card
        want = (card.layers, 2, card.kv_heads, card.head_dim)
        ok = kv.ndim == 5 and (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) == want
        if not ok:
            log.error("staged KV of shape %s does not fit model %s: not promised", tuple(kv.shape), card.name)
        return ok

    def _track(self, rid: int, ids: List[int], reused: int) -> None:
        chunk = self.cfg.chunk_tokens
        todo = chunks_to_save(len(ids), reused, chunk)
        if not todo:
            return
        keys = [chunk_keys(ids, self.cfg.card.model_id, s.identity, chunk, max_chunks=todo[-1][0] + 1)
                for s in self.writeback]
        chunk_keys_ = [tuple(k[i] for k in keys) for i, _, _ in todo]
        corrupt = self.prefetcher.corrupt if self.prefetcher is not None else {}
        replace = frozenset(key for ks in chunk_keys_ for key in ks if key in corrupt)
        self._saves.track(rid, todo, keys=chunk_keys_, replace=replace)

    def _step_save(self, meta: KVCodecMeta, rid: int, computed_after_step: int) -> None:
        job = self._saves.step(rid, computed_after_step)
        if job is not None:
            meta.saves.append(job)

    def _forget(self, rid: int) -> None:
        self._matched.pop(rid, None)
        self._first_step.pop(rid, None)
        self._saves.forget(rid)

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.store.close()
