"""vLLM's KV connector (``KVConnectorBase_V1``) over the engine-neutral core (``kvcodec.connector``).

How restored KV reaches vLLM's paged cache: an in-process hand-off (``connector.HandOff``). The
``llm`` step hosts the vLLM engine in its own process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
(scheduler, worker and model runner in one process, on the CPU build and on a one-GPU build alike).
Before it adds a request to the engine it posts an ``Offer`` under the request id: the request's
``LoadSession`` (the restored chunks, arriving while the request waits), whether to save the
prompt's new full chunks (write-back) and where to send them. The connector's two halves read it:

- scheduler side: ``get_num_new_matched_tokens`` answers from the session: the tokens it can still
  deliver (``bound_tokens``: the plan, cut at a chunk known to have failed; block-aligned, one
  prompt token left: ``connector.plan.matched_tokens``). A session already settled loads
  synchronously (``(n, False)``); one whose chunks are still coming loads asynchronously
  (``(n, True)``: vLLM parks the request in WAITING_FOR_REMOTE_KVS with its blocks allocated and
  goes on stepping the others); with ``defer`` (setting ``async_loads`` 0) it answers ``(None,
  False)``, "ask again later", until the session settles, then loads synchronously: the request
  is scheduled in the step after its last chunk, not one step after its load is reported.
  ``update_state_after_alloc`` attaches the blocks to the session:
  the chunks kept so far are written at once, later ones by the thread that delivers them, as they
  arrive. ``build_connector_meta`` names the step's new loads and its saves (``SaveTracker``: the
  step whose forward completes a request's last new full chunk);
- worker side: ``register_kv_caches`` sees the pool as ``connector.KVPages`` (the layout checked at
  run time) and registers it in the hand-off; ``get_finished`` reports an asynchronous load once its
  session is loaded; ``get_block_ids_with_load_errors`` then names the promised blocks past what
  was loaded (a chunk that failed after the promise, a write that failed), and vLLM recomputes them
  (``kv_load_failure_policy="recompute"``, set by the engine): a failed load never leaves blocks
  vLLM would take as computed. ``wait_for_save`` reads the finished full chunks out of the blocks
  (one copy) and hands them to the offer's sink (the write-back queue, or ingest's capture list).
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..connector import HandOff, KVPages, LoadSession, SaveJob, SaveTracker, chunks_to_save, matched_tokens

log = logging.getLogger("kvcodec.vllm")

SaveSink = Callable[[int, int, np.ndarray], None]  # (chunk index, token start, kv) -> None


@dataclass
class Offer:
    """What the ``llm`` step offers the connector for one request."""

    session: Optional[LoadSession] = None  # the restored chunks of the prompt's first tokens
    chunk_tokens: int = 256
    save: Optional[SaveSink] = None  # receives the prompt's full chunks not served from the session
    promised_tokens: int = 0  # filled in by the connector
    loaded_tokens: int = 0
    asynchronous: bool = False
    defer: bool = False  # chunks still coming: ask again later, load once they are in (no asynchronous load)
    load_s: float = 0.0
    save_s: float = 0.0
    saved_chunks: int = 0


HANDOFF = HandOff()


@dataclass
class _Load:
    request_id: str  # the engine's id
    given: str  # the id the offer was posted under
    start: int
    tokens: int
    asynchronous: bool


@dataclass
class KVCodecMetadata(KVConnectorMetadata):
    loads: List[_Load] = field(default_factory=list)
    saves: List[SaveJob] = field(default_factory=list)


def _layer_index(name: str) -> int:
    found = re.findall(r"\d+", name)
    return int(found[0]) if found else 0


class KVCodecConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        model = vllm_config.model_config
        self.kv_heads = int(model.get_total_num_kv_heads())
        self.head_dim = int(model.get_head_size())
        self.pages: Optional[KVPages] = None
        self._matched: Dict[str, _Load] = {}  # answered, blocks not yet attached
        self._attached: List[_Load] = []  # attached since the last metadata
        self._saves: SaveTracker = SaveTracker()
        self._given: Dict[str, str] = {}  # engine request id -> the id the offer was posted under
        # worker side
        self._loading: Dict[str, _Load] = {}
        self._load_errors: Set[int] = set()

    # -- scheduler side --------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        given, offer = HANDOFF.find(request.request_id)
        if offer is None:
            return 0, False
        self._given[request.request_id] = given
        prompt = len(request.prompt_token_ids or [])
        session = offer.session
        settled = session is None or session.settled
        if not settled and offer.defer and session.bound_tokens:
            return None, False  # vLLM keeps the request waiting and asks again at its next step
        stored = 0 if session is None else (session.usable_tokens if settled else session.bound_tokens)
        if offer.save is not None:
            self._saves.track(request.request_id, chunks_to_save(prompt, stored, offer.chunk_tokens))
        n = matched_tokens(stored, prompt, self.block_size, num_computed_tokens)
        if n == 0 or num_computed_tokens % self.block_size:
            return 0, False
        self._matched[request.request_id] = _Load(request.request_id, given, num_computed_tokens, n, not settled)
        offer.promised_tokens, offer.asynchronous = n, not settled
        return n, not settled

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        load = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or load is None:
            return
        offer = HANDOFF.get(load.given)
        if offer is None or offer.session is None:
            return
        block_ids = list(blocks.get_block_ids()[0])
        t = time.perf_counter()
        offer.session.attach(HANDOFF.pages, block_ids, load.start, num_external_tokens)
        offer.load_s += time.perf_counter() - t
        load.tokens = num_external_tokens
        self._attached.append(load)

    def build_connector_meta(self, scheduler_output) -> KVCodecMetadata:
        meta = KVCodecMetadata(loads=self._attached)
        self._attached = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._saves:
                self._saves.add_blocks(new.req_id, new.block_ids[0], replace=True)
                self._step_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._saves:
                continue
            added = cached.new_block_ids[i] if cached.new_block_ids else None
            if added:
                self._saves.add_blocks(req_id, added[0])
            self._step_save(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _step_save(self, meta: KVCodecMetadata, req_id: str, computed_after_step: int) -> None:
        job = self._saves.step(req_id, computed_after_step)
        if job is not None:
            job.extra["given"] = self._given.get(req_id, req_id)
            meta.saves.append(job)

    def request_finished(self, request, block_ids) -> Tuple[bool, Optional[Dict[str, Any]]]:
        self._matched.pop(request.request_id, None)
        self._saves.forget(request.request_id)
        self._given.pop(request.request_id, None)
        return False, None

    # -- worker side -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        from vllm.platforms import current_platform

        layers = [kv_caches[name] for name in sorted(kv_caches, key=_layer_index)]
        # vLLM 0.32 hands every backend's layer as [blocks, heads, block_size, 2*head_dim]; the CPU
        # kernel stores K transposed in it (measured), the GPU backends one token's [K|V] per row
        # (flash_attn.py splits the last dim; not run here: no GPU build of vLLM on these machines)
        layout = "cpu_attn" if current_platform.is_cpu() else "token_kv"
        self.pages = KVPages.from_vllm(layers, self.kv_heads, self.head_dim, block_size=self.block_size,
                                       layout=layout)
        HANDOFF.pages = self.pages
        log.info("kvcodec connector: %d layers, %d blocks of %d tokens, %s", self.pages.layers,
                 self.pages.num_blocks, self.pages.block_size, self.pages.dtype)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for load in meta.loads:
            self._loading[load.request_id] = load  # written by the session as the chunks arrive

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for job in meta.saves:
            offer = HANDOFF.get(job.extra["given"])
            if offer is None or offer.save is None:
                continue
            for index, start, end in job.chunks:
                t = time.perf_counter()
                kv = self.pages.read(job.block_ids, start, end - start).numpy()
                offer.save_s += time.perf_counter() - t
                try:
                    offer.save(index, start, kv)
                    offer.saved_chunks += 1
                except Exception:  # a sink's failure never fails the engine's step
                    log.exception("kvcodec connector: saving chunk %d of %s failed", index, job.request_id)

    def get_finished(self, finished_req_ids):
        """Loads whose session is loaded: asynchronous ones are reported as received; every one whose
        blocks fell short of the promise has them named by ``get_block_ids_with_load_errors``."""
        done: Set[str] = set()
        for rid, load in list(self._loading.items()):
            offer = HANDOFF.get(load.given)
            session = offer.session if offer is not None else None
            if session is not None and not session.loaded:
                if load.asynchronous:
                    continue  # chunks still coming
                session.wait_loaded()  # settled when promised synchronously: only writes in flight
            del self._loading[rid]
            if load.asynchronous:
                done.add(rid)
            if session is None:
                continue
            offer.loaded_tokens = session.loaded_tokens
            bad = session.failed_block_ids()
            if bad:
                self._load_errors.update(bad)
                log.warning("request %s: loaded %d of %d promised tokens (%s): %d block(s) to recompute", rid,
                            session.loaded_tokens - load.start, load.tokens, session.reason, len(bad))
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
