"""TensorRT-LLM's connector, scheduler half (rank 0, on the executor's thread): translates its calls
to ``connector.SchedulerCore``; never blocks. Why each answer is what it is, read in TensorRT-LLM's
source: docs/deploy-trtllm.md ("Which variant", "Versions").

- ``get_num_new_matched_tokens`` (inside C++ ``addSequence``: generations wait for it) answers from
  the ``Stage`` alone: the longest staged prefix, block-aligned after the device's own hit, one
  prompt token left. Only what cannot fail is promised (KV staged in the pool's dtype, device and
  shape: ``trtllm_shared.fits``), synchronously, ``(n, False)``: TensorRT-LLM cannot be told of a
  failed load. A prompt with nothing staged gets ``(0, False)``; with ``prefetch`` its stored
  prefix is read into the stage in the background (``trtllm_prefetch``) for the prompts after it.
- ``update_state_after_alloc`` hands the load to the worker (the shared ``loads``);
  ``build_connector_meta`` names the step's loads and the saves the core says the forward completes.
  A new request's ``computed_position`` leaves out the tokens matched in the same step
  (``build_scheduler_output`` subtracts ``external_loads``): they are added back for that step only.
  Warm-up and padding dummies are ignored.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..compose import open_reads
from ..connector import LoadSession, SaveJob, SchedulerCore
from ..errors import Unsupported
from ..store import KVStore
from . import trtllm_compat as compat
from .trtllm_config import TrtllmConfig, load_config
from .trtllm_prefetch import Prefetcher
from .trtllm_shared import SHARED, Shared, fits

log = logging.getLogger("kvcodec.trtllm")

_SchedulerBase, _, _ = compat.bases()


@dataclass
class LoadJob:
    """A load the worker writes in this step: positions ``[start, start + tokens)`` into ``block_ids``."""

    request_id: int
    block_ids: List[int]
    start: int
    tokens: int


@dataclass
class KVCodecMeta:
    """The step's metadata (pickled to every rank): its loads and its saves."""

    loads: List[LoadJob] = field(default_factory=list)
    saves: List[SaveJob] = field(default_factory=list)


class KVCodecScheduler(_SchedulerBase):
    def __init__(self, llm_args: Any = None, config: Optional[TrtllmConfig] = None,
                 store: Optional[KVStore] = None, shared: Optional[Shared] = None,
                 prefetch: Optional[bool] = None) -> None:
        super().__init__(llm_args)
        self.cfg = config or load_config()
        tokens_per_block = compat.tokens_per_block(llm_args)
        if tokens_per_block is None:
            raise Unsupported("llm_args.kv_cache_config.tokens_per_block not found: not TensorRT-LLM 1.2's llm_args?")
        compat.check_cuda_graphs(llm_args, compat.version())
        reuse = getattr(getattr(llm_args, "kv_cache_config", None), "enable_block_reuse", True)
        if reuse is False:
            log.warning("kv_cache_config.enable_block_reuse is off: TensorRT-LLM ignores KV connectors then")
        self.shared = SHARED if shared is None else shared
        self.shared.stage.max_bytes = self.cfg.stage_bytes
        # the deployment's reads (kvcodec.compose): the store behind the local tier, its breaker, the key
        self.reads = open_reads(self.cfg.to_settings(), self.cfg.card, store=store, auth=self.cfg.auth())
        self._given_store = store
        self.store = self.reads.store
        prefetch = self.cfg.prefetch if prefetch is None else prefetch
        self.prefetcher = Prefetcher(self.cfg, self.reads, self.shared) if prefetch else None
        self.core: SchedulerCore = SchedulerCore(tokens_per_block, self.cfg.chunk_tokens)
        self._accepted: List[LoadJob] = []
        self._external: Dict[int, int] = {}  # tokens matched in this step: left out of computed_position
        self.counters = {"requests": 0, "matched_tokens": 0, "staged_misses": 0, "dummies": 0}

    @property
    def tokens_per_block(self) -> int:
        return self.core.block_size

    # -- TensorRT-LLM's calls ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        if compat.is_dummy(request):
            self.counters["dummies"] += 1
            return 0, False
        rid = request.request_id
        ids, salt = compat.prompt(request), compat.cache_salt(request)
        chunk = self.cfg.chunk_tokens
        staged = self.shared.stage.longest(ids, chunk, salt, limit=len(ids) - 1)
        if staged is None and self.prefetcher is not None:
            self.prefetcher.request(ids, salt)
            self.counters["staged_misses"] += 1
        session, stored, entry = None, 0, None
        if staged is not None and fits(staged.kv, self.cfg.card, self.shared.pages):
            session, stored, entry = LoadSession.of(staged.kv, chunk), staged.tokens, staged.entry
        save = {"ids": ids, "salt": salt} if self.cfg.writeback else None
        n = self.core.match(rid, len(ids), stored, int(num_computed_tokens), session, asynchronous=False,
                            save=save, entry=entry)
        self.counters["requests"] += 1
        if not n:
            return 0, False
        self.counters["matched_tokens"] += n
        if self.prefetcher is None:  # the ensemble's engine (trtllm_engine) reports what was promised
            self.shared.promised.post(n, compat.client_id(request), ids, salt)
        log.info("request %s: %d of %d prompt tokens from the stage (device had %d)", rid, n, len(ids),
                 num_computed_tokens)
        return n, False

    def commit_new_matched_tokens(self, request: Any, num_tokens: int) -> None:
        """1.3+ (KVCacheManagerV2): the runtime took ``num_tokens`` of those offered; load only those."""
        self.core.narrow(request.request_id, int(num_tokens))

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int]) -> None:
        load = self.core.allocated(request.request_id, block_ids)
        if load is None:
            return
        self.shared.loads.post(load.request_id, load)
        self._accepted.append(LoadJob(load.request_id, load.block_ids, load.start, load.tokens))
        self._external[load.request_id] = load.tokens

    def build_connector_meta(self, scheduler_output: Any) -> KVCodecMeta:
        meta = KVCodecMeta(loads=self._accepted)
        external, self._accepted, self._external = self._external, [], {}
        for first, requests in ((True, scheduler_output.new_requests), (False, scheduler_output.cached_requests)):
            for req in requests:
                # a new request's computed_position leaves out what the connector matched in this step
                # (build_scheduler_output subtracts external_loads; after an asynchronous load it would
                # count them: this connector loads synchronously only)
                done = req.computed_position + (external.get(req.request_id, 0) if first else 0)
                job = self.core.scheduled(req.request_id, done + req.num_scheduled_tokens, req.new_block_ids,
                                          first=first)
                if job is not None:
                    meta.saves.append(job)
        return meta

    def request_finished(self, request: Any, cache_block_ids: Sequence[int]) -> bool:
        self.core.finished(request.request_id)
        self.shared.loads.pop(request.request_id)
        return False  # saves are copied out of the blocks in the step that completes the prefill

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.reads.close()
        if self._given_store is not None:
            self._given_store.close()  # as before: the scheduler closes the store it was handed
