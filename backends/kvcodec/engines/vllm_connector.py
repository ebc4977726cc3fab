"""vLLM's KV connector (``KVConnectorBase_V1``) over the engine-neutral core (``kvcodec.connector``).

How restored KV reaches vLLM's paged cache: an in-process hand-off. The ``llm`` step hosts the
vLLM engine in its own process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (scheduler, worker and
model runner in one process, on the CPU build and on a one-GPU build alike). Before it adds a
request to the engine it posts an ``Offer`` in ``HANDOFF`` under the request id: the restored KV
the ensemble gathered (``[layers, 2, kv_heads, tokens, head_dim]``), whether to save the prompt's
new full chunks (write-back) and where to send them. The connector's two halves read it:

- scheduler side: ``get_num_new_matched_tokens`` answers from the offer (block-aligned, at least
  one prompt token left to compute: ``connector.plan.matched_tokens``); ``update_state_after_alloc``
  records the blocks vLLM allocated; ``build_connector_meta`` lists, for the step, the loads (new
  requests with matched tokens) and the saves (requests whose prefill completes in this step);
- worker side: ``register_kv_caches`` sees the pool as ``connector.KVPages`` (the layout checked
  at run time), ``start_load_kv`` writes each offered chunk into the request's blocks before the
  forward pass, ``wait_for_save`` reads the finished full chunks back out of the blocks (one copy)
  and hands them to the offer's sink (the write-back queue, or ingest's capture list).

The loads are synchronous (``get_num_new_matched_tokens`` returns ``False`` for async): the KV is
already in this process when the request is added, the copy into the blocks is a memcpy.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..connector import KVPages, chunks_to_save, matched_tokens

log = logging.getLogger("kvcodec.vllm")

SaveSink = Callable[[int, int, np.ndarray], None]  # (chunk index, token start, kv) -> None


@dataclass
class Offer:
    """What the ``llm`` step offers the connector for one request."""

    past_kv: Optional[np.ndarray] = None  # the restored KV of the prompt's first tokens
    chunk_tokens: int = 256
    save: Optional[SaveSink] = None  # receives the prompt's full chunks not served from ``past_kv``
    loaded_tokens: int = 0  # filled in by the connector
    load_s: float = 0.0
    save_s: float = 0.0
    saved_chunks: int = 0

    @property
    def tokens(self) -> int:
        return 0 if self.past_kv is None else int(self.past_kv.shape[3])


class HandOff:
    """Offers by request id (thread-safe; one per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offers: Dict[str, Offer] = {}

    def post(self, request_id: str, offer: Offer) -> None:
        with self._lock:
            self._offers[request_id] = offer

    def get(self, request_id: str) -> Optional[Offer]:
        with self._lock:
            return self._offers.get(request_id)

    def find(self, engine_request_id: str) -> Tuple[str, Optional[Offer]]:
        """The offer of a request as the engine names it: vLLM appends ``-<8 random characters>``
        to the id it was given; returns (the id it was given, its offer)."""
        with self._lock:
            if engine_request_id in self._offers:
                return engine_request_id, self._offers[engine_request_id]
            given = engine_request_id.rsplit("-", 1)[0]
            return given, self._offers.get(given)

    def pop(self, request_id: str) -> Optional[Offer]:
        with self._lock:
            return self._offers.pop(request_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._offers)


HANDOFF = HandOff()


@dataclass
class _Load:
    request_id: str
    block_ids: List[int]
    start: int  # first token position to write (tokens vLLM already had are not rewritten)
    tokens: int


@dataclass
class _Save:
    request_id: str
    block_ids: List[int]
    chunks: List[Tuple[int, int, int]]  # (index, start, end)


@dataclass
class KVCodecMetadata(KVConnectorMetadata):
    loads: List[_Load] = field(default_factory=list)
    saves: List[_Save] = field(default_factory=list)


@dataclass
class _Tracked:
    """A request with chunks to save once its prefill is done (scheduler side)."""

    prompt_tokens: int
    chunks: List[Tuple[int, int, int]]
    block_ids: List[int] = field(default_factory=list)


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
        self._loads: Dict[str, _Load] = {}
        self._tracked: Dict[str, _Tracked] = {}
        self._given: Dict[str, str] = {}  # engine request id -> the id the offer was posted under
        self._computed: Dict[str, int] = {}  # tokens vLLM had itself (its prefix cache) at the match

    # -- scheduler side --------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> Tuple[int, bool]:
        given, offer = HANDOFF.find(request.request_id)
        if offer is None:
            return 0, False
        self._given[request.request_id] = given
        prompt = len(request.prompt_token_ids or [])
        if offer.save is not None and request.request_id not in self._tracked:
            chunks = chunks_to_save(prompt, offer.tokens, offer.chunk_tokens)
            if chunks:
                self._tracked[request.request_id] = _Tracked(prompt, chunks)
        self._computed[request.request_id] = num_computed_tokens
        return matched_tokens(offer.tokens, prompt, self.block_size, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        start = self._computed.pop(request.request_id, 0)
        given = self._given.get(request.request_id, request.request_id)
        self._loads[request.request_id] = _Load(given, block_ids, start, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVCodecMetadata:
        meta = KVCodecMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            load = self._loads.pop(new.req_id, None)
            if load is not None:
                meta.loads.append(load)
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                self._maybe_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            added = cached.new_block_ids[i] if cached.new_block_ids else None
            if added:
                tracked.block_ids.extend(added[0])
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _maybe_save(self, meta: KVCodecMetadata, req_id: str, computed_after_step: int) -> None:
        tracked = self._tracked[req_id]
        if computed_after_step >= tracked.chunks[-1][2]:
            del self._tracked[req_id]
            meta.saves.append(_Save(self._given.get(req_id, req_id), list(tracked.block_ids), tracked.chunks))

    def request_finished(self, request, block_ids) -> Tuple[bool, Optional[Dict[str, Any]]]:
        self._loads.pop(request.request_id, None)
        self._tracked.pop(request.request_id, None)
        self._computed.pop(request.request_id, None)
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
        log.info("kvcodec connector: %d layers, %d blocks of %d tokens, %s", self.pages.layers,
                 self.pages.num_blocks, self.pages.block_size, self.pages.dtype)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for load in meta.loads:
            offer = HANDOFF.get(load.request_id)
            if offer is None or offer.past_kv is None:
                continue
            t = time.perf_counter()
            end = load.start + load.tokens
            chunk = offer.chunk_tokens
            for pos in range(load.start, end, chunk):  # chunk by chunk, as the ensemble delivered them
                stop = min(end, (pos // chunk + 1) * chunk)
                self.pages.write(load.block_ids, pos, offer.past_kv[:, :, :, pos:stop])
            offer.loaded_tokens = end
            offer.load_s += time.perf_counter() - t

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for save in meta.saves:
            offer = HANDOFF.get(save.request_id)
            if offer is None or offer.save is None:
                continue
            for index, start, end in save.chunks:
                t = time.perf_counter()
                kv = self.pages.read(save.block_ids, start, end - start).numpy()
                offer.save_s += time.perf_counter() - t
                try:
                    offer.save(index, start, kv)
                    offer.saved_chunks += 1
                except Exception:  # a sink's failure never fails the engine's step
                    log.exception("kvcodec connector: saving chunk %d of %s failed", index, save.request_id)

    def get_finished(self, finished_req_ids):
        return None, None
