"""TensorRT-LLM's connector, worker half (every rank; the connector supports one).

- ``register_kv_caches(pool)``: the primary pool ``[num_blocks, num_layers, 2, kv_heads *
  tokens_per_block * head_dim]`` (``KVPages.from_trtllm``), checked against the model card and
  registered in the process's hand-off for the scheduler's copies. Refused (``Unsupported``): a pool
  that does not fit the card, tensor or pipeline parallelism, an attention backend other than
  TRTLLM (FlashInfer and vanilla view blocks token-major), a KV dtype other than float16, bfloat16
  or float32 (FP8 needs its scales).
- ``get_finished(finished_gen_req_ids, started_loading_req_ids)``: a load is reported in the second
  list only after TensorRT-LLM named it started and once its ``LoadSession`` is loaded; a load that
  fell short (a device error: nothing that can fail is ever promised) is counted
  (``short_loads``) and said loudly, since TensorRT-LLM cannot be told.
- ``wait_for_save(stream)``: the step's saves are gathered out of the blocks on the step's stream
  and copied to host memory without blocking the executor (no stream synchronize: a CUDA event
  marks when the copy is done, and the write-back thread waits for it before encoding);
  ``connector.WriteBack`` + ``ChunkSaver`` encode, sign and store them off the executor's path.
- ``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``: nothing (loads are copied when their
  blocks are allocated; saves are whole chunks after the forward).
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import Any, List, Optional, Sequence, Set, Tuple

import torch

from ..connector import ChunkSaver, KVPages, WriteBack, merged
from ..errors import Unsupported
from ..format.ladder import parse_ladder
from ..store import KVStore, open_store
from . import trtllm_compat as compat
from .trtllm_config import TrtllmConfig, load_config

log = logging.getLogger("kvcodec.trtllm")

_, _WorkerBase, _ = compat.bases()
POOL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _HostCopy:
    """A device tensor's copy to host memory, started on the current stream; ``get()`` waits for it."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.event = None
        if kv.is_cuda:
            self.host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
            self.host.copy_(kv, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = kv

    def get(self):
        if self.event is not None:
            self.event.synchronize()
        return self.host.to(torch.float32).numpy()


QUEUES: "weakref.WeakSet[WriteBack]" = weakref.WeakSet()  # live workers' write-back queues (metrics)


def writeback_stats() -> Optional[dict]:
    """The live workers' write-back counts summed (``connector.merged``), None when none writes back."""
    queues = list(QUEUES)
    return merged(q.stats() for q in queues) if queues else None


class KVCodecWorker(_WorkerBase):
    def __init__(self, llm_args: Any = None, config: Optional[TrtllmConfig] = None,
                 store: Optional[KVStore] = None, loads=None, handoff=None) -> None:
        from . import trtllm_connector as shared

        super().__init__(llm_args)
        self.cfg = config or load_config()
        self.loads = shared.LOADS if loads is None else loads
        self.handoff = shared.HANDOFF if handoff is None else handoff
        self.pages: Optional[KVPages] = None
        self._started: Set[int] = set()
        self.queue: Optional[WriteBack] = None
        self.store: Optional[KVStore] = None
        if self.cfg.writeback:
            self.store = store or open_store(self.cfg.store)
            self.saver = ChunkSaver(self.store, self.cfg.card.model_id,
                                    parse_ladder(list(self.cfg.writeback), self.cfg.card), self.cfg.chunk_tokens,
                                    auth=self.cfg.auth())
            self.queue = WriteBack(self._save, max_pending=self.cfg.max_pending, name="kv-writeback")
            QUEUES.add(self.queue)
        self.counters = {"loads": 0, "loaded_tokens": 0, "short_loads": 0, "saved_chunks": 0, "dropped_chunks": 0,
                         "save_copy_s": 0.0}

    # -- TensorRT-LLM's calls ----------------------------------------------------------------------
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        card, args, t = self.cfg.card, self._llm_args, kv_cache_tensor
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if int(getattr(args, name, 1) or 1) != 1:
                raise Unsupported(f"{name} {getattr(args, name)}: the connector needs every layer and head on one rank")
        backend = str(getattr(args, "attn_backend", "TRTLLM") or "TRTLLM")
        if backend.upper() != "TRTLLM":
            raise Unsupported(f"attention backend {backend}: the connector writes the TRTLLM backend's block layout")
        per_token = card.kv_heads * card.head_dim
        if t.dim() != 4 or t.shape[1] != card.layers or t.shape[2] != 2 or t.shape[3] % per_token:
            raise Unsupported(f"TensorRT-LLM KV pool {tuple(t.shape)} does not fit model {card.name} "
                              f"([num_blocks, {card.layers}, 2, {card.kv_heads}*tokens_per_block*{card.head_dim}])")
        tokens_per_block = t.shape[3] // per_token
        expected = compat.tokens_per_block(args)
        if expected is not None and expected != tokens_per_block:
            raise Unsupported(f"TensorRT-LLM KV pool {tuple(t.shape)} has {tokens_per_block} tokens a block, "
                              f"kv_cache_config says {expected}")
        if t.dtype not in POOL_DTYPES:
            raise Unsupported(f"TensorRT-LLM KV cache dtype {t.dtype}: the connector writes float16, bfloat16 "
                              "or float32 (not quantized KV)")
        self.pages = KVPages.from_trtllm(t, card.layers, card.kv_heads, tokens_per_block, card.head_dim)
        self.handoff.pages = self.pages
        if str(t.dtype).removeprefix("torch.") != card.kv_dtype:
            log.warning("KV pool is %s, the model card's kv_dtype %s: the raw rung is not bit-exact here",
                        t.dtype, card.kv_dtype)
        log.info("kvcodec connector: %d layers, %d blocks of %d tokens, %s", self.pages.layers, self.pages.num_blocks,
                 self.pages.block_size, self.pages.dtype)

    def start_load_kv(self, stream: Any = None) -> None:
        return  # a load is copied when its blocks are allocated (the scheduler's update_state_after_alloc)

    def wait_for_layer_load(self, layer_idx: int, stream: Any = None) -> None:
        return

    def save_kv_layer(self, layer_idx: int, stream: Any = None) -> None:
        return  # whole chunks are copied out after the forward, in wait_for_save

    def wait_for_save(self, stream: Any = None) -> None:
        meta = self.get_connector_meta()
        saves = getattr(meta, "saves", ())
        if not saves or self.queue is None:
            return
        for job in saves:
            keys, replace = job.extra["keys"], job.extra.get("replace", frozenset())
            for (index, start, end), chunk_keys in zip(job.chunks, keys, strict=True):
                t0 = time.perf_counter()
                copy = _HostCopy(self.pages.read(job.block_ids, start, end - start))  # on the step's stream
                self.counters["save_copy_s"] += time.perf_counter() - t0
                if self.queue.offer((chunk_keys, index, start, copy, replace)):
                    self.counters["saved_chunks"] += 1
                else:
                    self.counters["dropped_chunks"] += 1
                    log.warning("request %s: write-back queue full, chunk %d dropped", job.request_id, index)

    def get_finished(self, finished_gen_req_ids: Sequence[int],
                     started_loading_req_ids: Sequence[int]) -> Tuple[List[int], List[int]]:
        self._started.update(int(r) for r in started_loading_req_ids)
        loaded = []
        for rid in sorted(self._started):
            session = self.loads.get(rid)
            if session is not None and not session.loaded:
                continue  # the copy is still running
            self._started.discard(rid)
            loaded.append(rid)
            if session is None:
                continue
            self.loads.pop(rid)
            start, end = session.span
            self.counters["loads"] += 1
            self.counters["loaded_tokens"] += session.loaded_tokens - start
            if session.loaded_tokens < end:
                self.counters["short_loads"] += 1
                log.error("request %s: loaded %d of %d promised tokens (%s): TensorRT-LLM cannot be told",
                          rid, session.loaded_tokens - start, end - start, session.reason or "copy failed")
        return [], loaded

    # -- helpers -----------------------------------------------------------------------------------
    def _save(self, job) -> None:
        keys, index, start, copy, replace = job
        self.saver.save(keys, index, start, copy.get(), replace)

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close(timeout_s=30)
        if self.store is not None:
            self.store.close()
