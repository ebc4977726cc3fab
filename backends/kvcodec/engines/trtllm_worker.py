"""TensorRT-LLM's connector, worker half (every rank; the connector supports one): translates its calls
to ``connector.WorkerCore``. Why, read in TensorRT-LLM's source: docs/deploy-trtllm.md ("Which
variant": a failed load; "Versions").

- ``register_kv_caches(pool)``: the primary pool (``KVPages.from_trtllm_pool``: its shape checked
  against the model card, float16/bfloat16/float32), shared with the scheduler half; refused
  (``Unsupported``, ``trtllm_compat.check_pool_args``): tensor or pipeline parallelism, a host
  pool, an attention backend other than TRTLLM.
- ``start_load_kv(stream)``: the step's loads are written into their blocks on ``stream`` before the
  forward and their staged KV leaves the stage (held until the stream is past the copies). It never
  raises (1.2 calls it outside any ``try``: a raise ends the executor): a failure is kept
  (``WorkerCore.load_or_defer``) and raised as ``LoadFailed`` by ``wait_for_layer_load`` at the
  forward's first layer (or ``wait_for_save``), inside ``_forward_step``'s ``try``, which fails
  the step's requests instead of computing over stale blocks.
- ``wait_for_save(stream)``: the step's saves are copied out of the blocks to host memory without a
  synchronize (``connector.HostCopy``) and handed to the write-back sink, off the executor's path.
- ``get_finished``: nothing is loaded asynchronously, ``([], [])``; releases staged tensors whose
  copies the device has done. ``save_kv_layer``: nothing (whole chunks after the forward).
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..compose import open_writes
from ..connector import KVPages, WorkerCore, WriteBackSink, merged
from ..store import KVStore
from . import trtllm_compat as compat
from .trtllm_config import TrtllmConfig, load_config
from .trtllm_shared import SHARED, Shared

log = logging.getLogger("kvcodec.trtllm")

_, _WorkerBase, _ = compat.bases()

SINKS: "weakref.WeakSet[WriteBackSink]" = weakref.WeakSet()  # live workers' write-back sinks (metrics)


def writeback_stats() -> Optional[dict]:
    """The live workers' write-back counts summed (``connector.merged``), None when none writes back."""
    sinks = list(SINKS)
    return merged(s.stats() for s in sinks) if sinks else None


class KVCodecWorker(_WorkerBase):
    def __init__(self, llm_args: Any = None, config: Optional[TrtllmConfig] = None,
                 store: Optional[KVStore] = None, shared: Optional[Shared] = None) -> None:
        super().__init__(llm_args)
        self.cfg = config or load_config()
        self.shared = SHARED if shared is None else shared
        self.core = WorkerCore()
        # the deployment's write-back (kvcodec.compose): into the local tier too, each rung priced
        self.sink: Optional[WriteBackSink] = open_writes(self.cfg.to_settings(), self.cfg.card, store=store,
                                                         auth=self.cfg.auth(), corrupt=self.shared.corrupt)
        if self.sink is not None:
            SINKS.add(self.sink)

    @property
    def counters(self) -> dict:
        return self.core.counters

    @property
    def pages(self) -> Optional[KVPages]:
        return self.core.pages

    # -- TensorRT-LLM's calls ----------------------------------------------------------------------
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        card, t = self.cfg.card, kv_cache_tensor
        compat.check_pool_args(self._llm_args)
        pages = KVPages.from_trtllm_pool(t, card.layers, card.kv_heads, card.head_dim,
                                         compat.tokens_per_block(self._llm_args))
        self.core.register(pages)
        self.shared.pages = pages
        if str(t.dtype).removeprefix("torch.") != card.kv_dtype:
            log.warning("KV pool is %s, the model card's kv_dtype %s: the raw rung is not bit-exact here",
                        t.dtype, card.kv_dtype)
        log.info("kvcodec connector: %d layers, %d blocks of %d tokens, %s", pages.layers, pages.num_blocks,
                 pages.block_size, pages.dtype)

    def start_load_kv(self, stream: Any = None) -> None:
        # never raises (see the module's docstring): a failure is raised from the forward instead
        for job in getattr(self.get_connector_meta(), "loads", ()):
            load = self.shared.loads.pop(job.request_id)
            self.core.load_or_defer(load, stream, job.request_id, job.tokens)
            if load is not None and load.extra.get("entry") is not None:
                self.shared.stage.drop(load.extra["entry"])  # in the blocks now: TensorRT-LLM's reuse tree has it

    def wait_for_layer_load(self, layer_idx: int, stream: Any = None) -> None:
        # the layer pre-hook, inside _forward_step's try: a raise here fails the active requests
        self.core.raise_deferred()

    def save_kv_layer(self, layer_idx: int, stream: Any = None) -> None:
        return  # whole chunks are copied out after the forward, in wait_for_save

    def wait_for_save(self, stream: Any = None) -> None:
        self.core.raise_deferred()  # a forward whose layers ran no hook (1.2 calls this inside _forward_step's try)
        saves = getattr(self.get_connector_meta(), "saves", ())
        if saves and self.sink is not None:
            self.core.save(saves, lambda job: self.sink.for_prompt(
                job.extra["ids"], self.shared.salts.store_salt(job.extra.get("salt", ""))), stream)

    def get_finished(self, finished_gen_req_ids: Sequence[int],
                     started_loading_req_ids: Sequence[int]) -> Tuple[List[int], List[int]]:
        self.core.release()  # staged tensors whose copies the device has done
        return [], []  # every load is synchronous (start_load_kv): none is ever parked

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
