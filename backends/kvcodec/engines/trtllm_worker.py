"""TensorRT-LLM's connector, worker half (every rank; the connector supports one): translates its calls
to ``connector.WorkerCore``.

- ``register_kv_caches(pool)``: the primary pool ``[num_blocks, num_layers, 2, kv_heads *
  tokens_per_block * head_dim]`` (``KVPages.from_trtllm``), checked against the model card and
  shared with the scheduler half (``trtllm_shared``). Refused (``Unsupported``): a pool that does
  not fit the card, tensor or pipeline parallelism, an attention backend other than TRTLLM
  (FlashInfer and vanilla view blocks token-major), a KV dtype other than float16, bfloat16 or
  float32 (FP8 needs its scales), a host (secondary) pool (``kv_cache_config.host_cache_size``:
  block ids may then name blocks outside the primary pool this connector writes).
- ``start_load_kv(stream)``: the step's loads (``KVCodecMeta.loads``, promised synchronously) are
  written into their blocks on ``stream`` before the forward (``WorkerCore.load_now``), and their
  staged KV leaves the stage; the staged tensors stay alive until an event on ``stream`` says the
  copies ran (``WorkerCore.inflight``). It never raises: TensorRT-LLM 1.2 calls it from
  ``_kv_connector_start_batch`` outside any ``try`` in ``_executor_loop`` and
  ``_executor_loop_overlap``, so a raise there ends the executor thread (``_event_loop_wrapper``
  logs and re-raises) and every request in flight and after it hangs. A load that cannot write every
  promised token (only a device error gets there: only KV already in the pool's dtype, shape and
  device is promised) is remembered, the step's other loads are written, and
  ``wait_for_layer_load`` raises ``LoadFailed`` at the forward's first layer: the layer pre-hook
  runs inside ``_forward_step``'s ``try``, whose ``_handle_errors`` fails the active requests with
  that message instead of computing over stale blocks (TensorRT-LLM cannot be told of one failed
  load, nor recompute it). ``wait_for_save`` raises it too if no layer hook ran.
  What TensorRT-LLM does next is its own: ``_executor_loop`` (``disable_overlap_scheduler: true``)
  goes on with the next step; ``_executor_loop_overlap`` (its default) and ``_executor_loop_pp``
  then reach ``assert sample_state is not None, "Sampling failed"`` outside any ``try`` (1.2 and
  main as read; TensorRT-LLM issue #17913), which ends the loop after the failed requests were
  answered.
- ``wait_for_save(stream)``: the step's saves are gathered out of the blocks on the step's stream and
  copied to host memory without a synchronize (``connector.HostCopy``); the write-back sink
  (``connector.WriteBackSink``) encodes, signs and stores them off the executor's path.
- ``get_finished``: nothing is ever loaded asynchronously; ``([], [])``. Releases the staged
  tensors whose copies the device has done (never waits).
- ``save_kv_layer``: nothing (saves are whole chunks after the forward).
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..compose import open_writes
from ..connector import KVPages, LoadFailed, WorkerCore, WriteBackSink, merged
from ..errors import Unsupported
from ..store import KVStore
from . import trtllm_compat as compat
from .trtllm_config import TrtllmConfig, load_config
from .trtllm_shared import SHARED, Shared

log = logging.getLogger("kvcodec.trtllm")

_, _WorkerBase, _ = compat.bases()
POOL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

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
        self._failed: List[str] = []  # loads that failed in start_load_kv, raised at the forward's first layer

    @property
    def counters(self) -> dict:
        return self.core.counters

    @property
    def pages(self) -> Optional[KVPages]:
        return self.core.pages

    # -- TensorRT-LLM's calls ----------------------------------------------------------------------
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        card, args, t = self.cfg.card, self._llm_args, kv_cache_tensor
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if int(getattr(args, name, 1) or 1) != 1:
                raise Unsupported(f"{name} {getattr(args, name)}: the connector needs every layer and head on one rank")
        host_cache = getattr(getattr(args, "kv_cache_config", None), "host_cache_size", None)
        if host_cache:
            raise Unsupported(f"kv_cache_config.host_cache_size {host_cache}: with a host (secondary) KV pool "
                              "block ids may name blocks outside the primary pool the connector writes; "
                              "leave host_cache_size unset (0) with this connector")
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
        pages = KVPages.from_trtllm(t, card.layers, card.kv_heads, tokens_per_block, card.head_dim)
        self.core.register(pages)
        self.shared.pages = pages
        if str(t.dtype).removeprefix("torch.") != card.kv_dtype:
            log.warning("KV pool is %s, the model card's kv_dtype %s: the raw rung is not bit-exact here",
                        t.dtype, card.kv_dtype)
        log.info("kvcodec connector: %d layers, %d blocks of %d tokens, %s", pages.layers, pages.num_blocks,
                 pages.block_size, pages.dtype)

    def start_load_kv(self, stream: Any = None) -> None:
        # never raises (see the module's docstring): a failure is raised from the forward instead
        meta = self.get_connector_meta()
        for job in getattr(meta, "loads", ()):
            load = self.shared.loads.pop(job.request_id)
            if load is None:
                self._fail(f"request {job.request_id}: promised {job.tokens} tokens whose KV is gone")
                continue
            try:
                self.core.load_now(load, stream)
            except Exception as exc:  # LoadFailed, or anything else a write raised
                self._fail(str(exc) if isinstance(exc, LoadFailed) else
                           f"request {job.request_id}: loading its promised tokens failed: {exc}")
            finally:
                if load.extra.get("entry") is not None:
                    self.shared.stage.drop(load.extra["entry"])  # in the blocks now: TensorRT-LLM's reuse tree has it

    def _fail(self, message: str) -> None:
        log.error("kvcodec connector: %s; the forward's requests are failed rather than computed over stale "
                  "blocks", message)
        self._failed.append(message)

    def _raise_failed(self) -> None:
        if self._failed:
            failed, self._failed = self._failed, []
            raise LoadFailed("; ".join(failed))

    def wait_for_layer_load(self, layer_idx: int, stream: Any = None) -> None:
        # the layer pre-hook, inside _forward_step's try: a raise here fails the active requests
        self._raise_failed()

    def save_kv_layer(self, layer_idx: int, stream: Any = None) -> None:
        return  # whole chunks are copied out after the forward, in wait_for_save

    def wait_for_save(self, stream: Any = None) -> None:
        self._raise_failed()  # a forward whose layers ran no hook (1.2 calls this inside _forward_step's try)
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
