"""TensorRT-LLM's KV cache connector over the engine-neutral core (``kvcodec.connector``).

Enabled with ``LLM(model, backend="pytorch", kv_connector_config=kv_connector_config())``: the config
names this module, ``KVCodecScheduler`` and ``KVCodecWorker``; the connector's own settings come from
``trtllm_config`` (a JSON file named by ``TRTLLM_KVCODEC_CONFIG``).

The API, as read in NVIDIA/TensorRT-LLM 1.2 (``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py``;
``.../pyexecutor/connectors/kv_cache_connector.py`` in later releases; the example
``examples/llm-api/llm_kv_cache_connector.py``; the call sites in ``_torch/pyexecutor/py_executor_creator.py``,
``py_executor.py``, ``resource_manager.py`` and ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``;
``docs/source/features/kv-cache-connector.md``). Both halves are made with ``cls(llm_args: TorchLlmArgs)``,
the scheduler on rank 0 only, a worker on every rank; on rank 0 both sit in one
``KvCacheConnectorManager``, in one process. Per executor step, in this order:

1. ``KVCacheManager.prepare_resources`` adds each new context request: C++ ``addSequence`` (only with
   block reuse on) matches the device prefix cache, then calls scheduler
   ``get_num_new_matched_tokens(request: LlmRequest, num_computed_tokens: int) -> (int, bool)``
   (``num_computed_tokens``: the device's hit; the int: tokens the connector supplies after it,
   at least one prompt token left; the bool: loaded asynchronously) once per request, and sets the
   prompt's prepopulated length to the sum; then ``update_state_after_alloc(request, block_ids:
   list[int])`` with all the request's blocks (``get_cache_indices``).
2. ``build_connector_meta(scheduler_output: SchedulerOutput) -> object``: ``new_requests`` and
   ``cached_requests``, each a ``RequestData(request_id, new_tokens, new_block_ids, computed_position,
   num_scheduled_tokens)``; on a request's first step ``computed_position`` leaves out the connector's
   tokens. The result is broadcast (pickled) to every rank's worker: ``bind_connector_meta(meta)``.
3. worker ``start_load_kv(stream)`` before the forward; in it, hooks on every decoder layer call
   ``wait_for_layer_load(layer_idx, stream)`` before and ``save_kv_layer(layer_idx, stream)`` after
   it; after it ``wait_for_save(stream)``; then ``get_finished(finished_gen_req_ids: list[int],
   started_loading_req_ids: list[int]) -> (finished saving ids, finished loading ids)``.
4. When a request ends: scheduler ``request_finished(request, cache_block_ids: list[int]) -> bool``
   (True: its blocks wait for an asynchronous save that ``get_finished`` reports).

Once, before any step: worker ``register_kv_caches(kv_cache_tensor)`` with the primary pool
``[num_blocks, num_layers, 2, kv_heads * tokens_per_block * head_dim]`` (``get_unique_primary_pool``),
each block ``[kv_heads, tokens_per_block, head_dim]`` as the TRTLLM attention backend's
``KVBlockArray::getKVLocalIdx`` addresses it (``KVPages.from_trtllm``).

Decisions:

- Hand-off: the model runs in TensorRT-LLM's processes, not in the ``llm`` step's, so restored KV
  cannot be offered in process as the vLLM adapter does. The connector drives the read path itself
  (``ChunkReader``: store -> ``serving.decode.ChunkDecoder`` -> ``serving.restore.restore``); what it
  sends through the metadata is small and picklable (request, blocks, token range, each chunk's keys
  and rungs); the restored KV travels in this process only.
- Failure path: TensorRT-LLM 1.2 has none. The count from ``get_num_new_matched_tokens`` is final (the
  request's prepopulated length is set from it before any block is written; no cancel, no partial
  report; an asynchronous load that ends reports only "finished"). Checking chunk headers before
  answering is not enough either: a payload that passes its digests can still fail to decode (a
  decoder that is not bit-exact: the planes digest) or to restore (non-finite values). So the
  scheduler runs the whole read path before it answers, and promises only the leading run of
  chunks that restored (block-aligned, one prompt token left: ``matched_tokens``); a missing,
  corrupt or foreign chunk, a store error or the fetch deadline ends the run there, and the
  engine computes the rest. The restored chunks wait in ``STAGE`` (this process) for the rank-0
  worker, which writes them into the blocks chunk by chunk (``RequestLoad``). The load is
  synchronous (``(count, False)``): ``start_load_kv`` runs before the forward either way, so
  reading before answering puts nothing more on the step's path. A worker that finds nothing staged
  (another rank) reads the chunks itself from the keys in the metadata; if one fails there, the
  load is short and TensorRT-LLM cannot be told: it is logged and counted (``short_loads``).
- The device prefix cache comes first: the load starts at ``num_computed_tokens`` and never writes
  a block below it (those blocks may be shared with other requests). A device hit that ends inside
  a block gets no connector tokens, as in TensorRT-LLM's example.
- Save after a miss (``writeback`` rungs): when a request's prefill completes in a step, the
  metadata names its full chunks that the store did not give (``chunks_to_save``; a stored copy found
  corrupt is replaced); ``wait_for_save`` copies them out of the blocks (``KVPages.read``) and
  ``connector.WriteBack`` encodes and stores them on its own thread. So ``request_finished`` returns
  False: nothing needs the blocks after the step.
- Refused (``Unsupported``, at ``register_kv_caches``): a pool that does not fit the model card,
  tensor or pipeline parallelism (a rank holds part of the heads or layers), an attention backend
  other than TRTLLM (FlashInfer and vanilla view blocks token-major), a KV dtype other than
  float16/bfloat16/float32 (FP8 needs its scales). TensorRT-LLM itself requires block reuse on,
  the GUARANTEED_NO_EVICT capacity policy, no speculative decoding and beam width 1.

TensorRT-LLM is imported lazily: the classes derive from ``KvCacheConnectorScheduler`` and
``KvCacheConnectorWorker`` when ``tensorrt_llm`` is installed (the 1.2 module path first, then the
later one) and from small stand-ins with the same constructor and metadata binding when it is not,
so this module imports, and its tests run, without TensorRT-LLM.
"""
from __future__ import annotations

import importlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import numpy as np
import torch

from ..connector import KVPages, RequestLoad, WriteBack, chunks_to_save, matched_tokens
from ..errors import CorruptChunk, ForeignChunk, KVCodecError, Unsupported
from ..format.keys import chunk_keys
from ..format.ladder import parse_ladder, rung_name
from ..serving.decode import ChunkDecoder
from ..serving.fetch import Fetcher, Plan
from ..serving.restore import restore
from ..store import KVStore, open_store
from .trtllm_config import TrtllmConfig, load_config

log = logging.getLogger("kvcodec.trtllm")

BASE_MODULES = ("tensorrt_llm._torch.pyexecutor.kv_cache_connector",  # 1.1, 1.2
                "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector")  # later releases
POOL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _SchedulerStandIn:
    """``KvCacheConnectorScheduler``'s constructor, where TensorRT-LLM is not installed."""

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args


class _WorkerStandIn:
    """``KvCacheConnectorWorker``'s constructor and metadata binding, where TensorRT-LLM is not installed."""

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        self._metadata = None

    def bind_connector_meta(self, metadata: object) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None


def _bases() -> Tuple[type, type, Optional[str]]:
    for name in BASE_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                continue  # no TensorRT-LLM, or not this path of it; a dependency it lacks is raised
            raise
        return module.KvCacheConnectorScheduler, module.KvCacheConnectorWorker, name
    return _SchedulerStandIn, _WorkerStandIn, None


_SchedulerBase, _WorkerBase, TRTLLM_MODULE = _bases()
HAVE_TRTLLM = TRTLLM_MODULE is not None


def kv_connector_config():
    """TensorRT-LLM's ``KvCacheConnectorConfig`` naming this connector (``LLM(kv_connector_config=...)``)."""
    from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig

    return KvCacheConnectorConfig(connector_module=__name__, connector_scheduler_class="KVCodecScheduler",
                                  connector_worker_class="KVCodecWorker")


# -- the metadata (pickled to every rank) ---------------------------------------------------------
@dataclass
class ChunkRef:
    index: int
    keys: Tuple[str, ...]  # the rungs that hold the chunk, preferred first
    rungs: Tuple[str, ...]


@dataclass
class LoadPlan:
    request_id: int
    block_ids: List[int]
    start: int  # first position written (``num_computed_tokens``: the device's own prefix ends there)
    tokens: int  # positions [start, start + tokens)
    chunks: List[ChunkRef]  # the stored chunks that cover them, in order


@dataclass
class SavePlan:
    request_id: int
    block_ids: List[int]
    chunks: List[Tuple[int, int, Tuple[str, ...]]]  # (index, token start, its key at each write-back rung)
    replace: Tuple[str, ...] = ()  # keys whose stored copy was corrupt: written even though present


@dataclass
class KVCodecMeta:
    loads: List[LoadPlan] = field(default_factory=list)
    saves: List[SavePlan] = field(default_factory=list)


class Stage:
    """Restored chunks by request id, from the scheduler's read to the worker's copy (one process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunks: Dict[int, List[np.ndarray]] = {}

    def put(self, request_id: int, chunks: List[np.ndarray]) -> None:
        with self._lock:
            self._chunks[request_id] = chunks

    def pop(self, request_id: int) -> Optional[List[np.ndarray]]:
        with self._lock:
            return self._chunks.pop(request_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._chunks)


STAGE = Stage()


# -- the read path ---------------------------------------------------------------------------------
class ChunkReader:
    """Store -> ``ChunkDecoder`` -> ``restore`` for a run of chunks, each tried at its rungs in order.
    Fetches run on a small pool (all first choices at once); decode and restore in the caller's
    thread, in order."""

    def __init__(self, cfg: TrtllmConfig, store: KVStore, threads: int = 4) -> None:
        self.cfg = cfg
        self.store = store
        self.geometry = cfg.card.geometry(cfg.chunk_tokens)
        self.decoder = ChunkDecoder(cfg.card.model_id, auth=cfg.auth(), decoder=cfg.decoder, threads=cfg.threads,
                                    geometry=self.geometry)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kv-get")

    def restore(self, data: Any, key: str) -> np.ndarray:
        kv = restore(self.decoder.decode(data, key=key))
        g = self.geometry
        if kv.shape != (g.layers, 2, g.kv_heads, g.tokens, g.head_dim):
            raise ForeignChunk(f"chunk restored to {tuple(kv.shape)}, expected "
                               f"{(g.layers, 2, g.kv_heads, g.tokens, g.head_dim)}")
        return kv

    def read_run(self, refs: Sequence[ChunkRef], deadline: float) -> Tuple[List[np.ndarray], str, Set[str]]:
        """(restored KV of the leading run of ``refs``, why the run ended ('' if it did not), the
        keys found corrupt)."""
        first = [self._pool.submit(self.store.get, ref.keys[0]) for ref in refs]
        out: List[np.ndarray] = []
        corrupt: Set[str] = set()
        for ref, call in zip(refs, first, strict=True):
            kv, why = None, ""
            for n, (key, rung) in enumerate(zip(ref.keys, ref.rungs, strict=True)):
                call = call if n == 0 else self._pool.submit(self.store.get, key)
                try:
                    data = call.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    why = f"chunk {ref.index}: timeout, the store did not answer within {self.cfg.fetch_timeout_s:g}s"
                    break
                except KVCodecError as exc:
                    why = f"chunk {ref.index} at {rung}: store error: {exc}"
                    continue
                if not data:
                    why = f"chunk {ref.index} at {rung}: missing"
                    continue
                try:
                    kv = self.restore(data, key)
                    break
                except (KVCodecError, ValueError) as exc:
                    if isinstance(exc, CorruptChunk):
                        corrupt.add(key)
                    kind = "foreign" if isinstance(exc, ForeignChunk) else "corrupt"
                    why = f"chunk {ref.index} at {rung}: {kind}: {exc}"
            if kv is None:
                for later in first[len(out) + 1:]:
                    later.cancel()
                return out, why or f"chunk {ref.index}: no rung", corrupt
            out.append(kv)
        return out, "", corrupt

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.decoder.close()


# -- scheduler -------------------------------------------------------------------------------------
def _tokens_per_block(llm_args: Any) -> Optional[int]:
    value = getattr(getattr(llm_args, "kv_cache_config", None), "tokens_per_block", None)
    return int(value) if value else None


def _prompt(request: Any) -> List[int]:
    tokens = [int(t) for t in request.get_tokens(0)]
    n = getattr(request, "prompt_len", None)
    return tokens[:n] if isinstance(n, int) and 0 < n <= len(tokens) else tokens


@dataclass
class _Tracked:
    """A request whose new full chunks are saved once its prefill completes (scheduler side)."""

    chunks: List[Tuple[int, int, Tuple[str, ...]]]
    replace: Tuple[str, ...]
    block_ids: List[int] = field(default_factory=list)


class KVCodecScheduler(_SchedulerBase):
    def __init__(self, llm_args: Any = None, config: Optional[TrtllmConfig] = None,
                 store: Optional[KVStore] = None, stage: Optional[Stage] = None) -> None:
        super().__init__(llm_args)
        self.cfg = config or load_config()
        self.tokens_per_block = _tokens_per_block(llm_args)
        if self.tokens_per_block is None:
            raise Unsupported("llm_args.kv_cache_config.tokens_per_block not found: not TensorRT-LLM 1.2's llm_args?")
        reuse = getattr(getattr(llm_args, "kv_cache_config", None), "enable_block_reuse", True)
        if reuse is False:
            log.warning("kv_cache_config.enable_block_reuse is off: TensorRT-LLM ignores KV connectors then")
        card = self.cfg.card
        self.store = store or open_store(self.cfg.store)
        self.fetcher = Fetcher(self.store, card.model_id, self.cfg.ladder, self.cfg.chunk_tokens, card=card,
                               timeout_s=self.cfg.fetch_timeout_s)
        self.reader = ChunkReader(self.cfg, self.store)
        self.writeback = parse_ladder(list(self.cfg.writeback), card) if self.cfg.writeback else []
        self.stage = STAGE if stage is None else stage
        self._loads: Dict[int, LoadPlan] = {}  # answered, not yet in a step's metadata
        self._matched: Dict[int, int] = {}
        self._tracked: Dict[int, _Tracked] = {}
        self.counters = {"requests": 0, "matched_tokens": 0, "short_matches": 0, "read_s": 0.0}

    # -- TensorRT-LLM's calls ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        rid = request.request_id
        self._forget(rid)
        ids = _prompt(request)
        chunk, computed = self.cfg.chunk_tokens, int(num_computed_tokens)
        deadline = time.monotonic() + self.cfg.fetch_timeout_s
        try:
            plan = self.fetcher.plan(ids, deadline=deadline)
        except KVCodecError as exc:  # store down or too slow: a miss
            log.warning("request %s: store look-up failed: %s", rid, exc)
            plan = None
        stored = plan.n_chunks * chunk if plan else 0
        aligned = computed % self.tokens_per_block == 0  # a device hit ending inside a block: no load
        want = matched_tokens(stored, len(ids), self.tokens_per_block, computed) if aligned else 0
        count, reused, why, corrupt = 0, stored, "", set()
        if want:
            first, last = computed // chunk, (computed + want - 1) // chunk
            refs = [self._ref(plan, i) for i in range(first, last + 1)]
            t0 = time.perf_counter()
            restored, why, corrupt = self.reader.read_run(refs, deadline)
            self.counters["read_s"] += time.perf_counter() - t0
            if why:
                reused = (first + len(restored)) * chunk
                self.counters["short_matches"] += 1
            count = matched_tokens(reused, len(ids), self.tokens_per_block, computed)
            if count:
                n = -(-(computed + count) // chunk) - first
                self.stage.put(rid, restored[:n])
                self._loads[rid] = LoadPlan(rid, [], computed, count, refs[:n])
                self._matched[rid] = count
        if self.writeback:
            self._track(rid, ids, reused, corrupt)
        self.counters["requests"] += 1
        self.counters["matched_tokens"] += count
        log.info("request %s: %d of %d prompt tokens from the store (stored %d, on device %d)%s", rid, count,
                 len(ids), stored, computed, f"; {why}" if why else "")
        return count, False

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int]) -> None:
        rid = request.request_id
        ids = [int(b) for b in block_ids]
        if rid in self._loads:
            self._loads[rid].block_ids = ids
        if rid in self._tracked:
            self._tracked[rid].block_ids = list(ids)

    def build_connector_meta(self, scheduler_output: Any) -> KVCodecMeta:
        meta = KVCodecMeta()
        for req in scheduler_output.new_requests:
            rid = req.request_id
            matched = self._matched.pop(rid, 0)
            load = self._loads.pop(rid, None)
            if load is not None:
                load.block_ids = load.block_ids or [int(b) for b in req.new_block_ids]
                meta.loads.append(load)
            tracked = self._tracked.get(rid)
            if tracked is not None:
                tracked.block_ids = tracked.block_ids or [int(b) for b in req.new_block_ids]
                # ``computed_position`` leaves out the connector's tokens on a request's first step
                self._maybe_save(meta, rid, req.computed_position + matched + req.num_scheduled_tokens)
        for req in scheduler_output.cached_requests:
            tracked = self._tracked.get(req.request_id)
            if tracked is not None:
                tracked.block_ids.extend(int(b) for b in req.new_block_ids)
                self._maybe_save(meta, req.request_id, req.computed_position + req.num_scheduled_tokens)
        return meta

    def request_finished(self, request: Any, cache_block_ids: Sequence[int]) -> bool:
        self._forget(request.request_id)
        return False  # saves are copied out of the blocks in the step that completes the prefill

    # -- helpers -----------------------------------------------------------------------------------
    def _ref(self, plan: Plan, index: int) -> ChunkRef:
        candidates = plan.candidates(index)
        candidates.sort(key=lambda c: c[0].identity != plan.scheme.identity)  # the run's rung first
        return ChunkRef(index, tuple(k for _, k in candidates), tuple(rung_name(s) for s, _ in candidates))

    def _track(self, rid: int, ids: List[int], reused: int, corrupt: Set[str]) -> None:
        chunk = self.cfg.chunk_tokens
        todo = chunks_to_save(len(ids), reused, chunk)
        if not todo:
            return
        keys = [chunk_keys(ids, self.cfg.card.model_id, s.identity, chunk, max_chunks=todo[-1][0] + 1)
                for s in self.writeback]
        chunks = [(i, start, tuple(k[i] for k in keys)) for i, start, _ in todo]
        replace = tuple(sorted(key for _, _, ks in chunks for key in ks if key in corrupt))
        self._tracked[rid] = _Tracked(chunks, replace)

    def _maybe_save(self, meta: KVCodecMeta, rid: int, computed_after_step: int) -> None:
        tracked = self._tracked[rid]
        if computed_after_step >= tracked.chunks[-1][1] + self.cfg.chunk_tokens:
            del self._tracked[rid]
            meta.saves.append(SavePlan(rid, list(tracked.block_ids), tracked.chunks, tracked.replace))

    def _forget(self, rid: int) -> None:
        self._loads.pop(rid, None)
        self._matched.pop(rid, None)
        self._tracked.pop(rid, None)
        self.stage.pop(rid)

    def close(self) -> None:
        self.fetcher.close()
        self.reader.close()
        self.store.close()


# -- worker ----------------------------------------------------------------------------------------
def _pieces(chunks: Sequence[np.ndarray], skip: int, tokens: int, chunk: int) -> Iterator[Tuple[int, Any]]:
    """The restored chunks (the first holding the load's start, ``skip`` tokens into it) re-cut on the
    load's own grid: piece ``j`` is positions ``[start + j*chunk, start + (j+1)*chunk)`` of the load
    (the stored chunks themselves when ``skip`` is 0). None for a piece a missing chunk cuts short."""
    for j in range(-(-tokens // chunk)):
        lo, hi = skip + j * chunk, min(skip + tokens, skip + (j + 1) * chunk)  # offsets into the run
        first, last = lo // chunk, (hi - 1) // chunk
        if last >= len(chunks):
            yield j, None
            return
        parts = [chunks[c][:, :, :, max(lo, c * chunk) - c * chunk:min(hi, (c + 1) * chunk) - c * chunk]
                 for c in range(first, last + 1)]
        yield j, parts[0] if len(parts) == 1 else np.concatenate(parts, axis=3)


class KVCodecWorker(_WorkerBase):
    def __init__(self, llm_args: Any = None, config: Optional[TrtllmConfig] = None,
                 store: Optional[KVStore] = None, stage: Optional[Stage] = None) -> None:
        super().__init__(llm_args)
        self.cfg = config or load_config()
        self.stage = STAGE if stage is None else stage
        self.pages: Optional[KVPages] = None
        self.store = store or open_store(self.cfg.store)
        self._reader: Optional[ChunkReader] = None  # only a worker that finds nothing staged reads
        self.queue: Optional[WriteBack] = None
        self.encoders: List[Tuple[Any, Any]] = []
        if self.cfg.writeback:
            from ..encode import ChunkEncoder

            auth = self.cfg.auth()
            self.encoders = [(s, ChunkEncoder(s, self.cfg.card.model_id, auth=auth, threads=1))
                             for s in parse_ladder(list(self.cfg.writeback), self.cfg.card)]
            self.queue = WriteBack(self._store_job, max_pending=self.cfg.max_pending, name="kv-writeback")
        self.counters = {"loads": 0, "loaded_tokens": 0, "short_loads": 0, "load_s": 0.0, "saved_chunks": 0,
                         "dropped_chunks": 0, "save_copy_s": 0.0}

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
        expected = _tokens_per_block(args)
        if expected is not None and expected != tokens_per_block:
            raise Unsupported(f"TensorRT-LLM KV pool {tuple(t.shape)} has {tokens_per_block} tokens a block, "
                              f"kv_cache_config says {expected}")
        if t.dtype not in POOL_DTYPES:
            raise Unsupported(f"TensorRT-LLM KV cache dtype {t.dtype}: the connector writes float16, bfloat16 "
                              "or float32 (not quantized KV)")
        self.pages = KVPages.from_trtllm(t, card.layers, card.kv_heads, tokens_per_block, card.head_dim)
        if str(t.dtype).removeprefix("torch.") != card.kv_dtype:
            log.warning("KV pool is %s, the model card's kv_dtype %s: the raw rung is not bit-exact here",
                        t.dtype, card.kv_dtype)
        log.info("kvcodec connector: %d layers, %d blocks of %d tokens, %s", self.pages.layers, self.pages.num_blocks,
                 self.pages.block_size, self.pages.dtype)

    def start_load_kv(self, stream: Any = None) -> None:
        meta = self.get_connector_meta()
        for load in getattr(meta, "loads", ()):
            try:
                self._load(load)
            except (KVCodecError, ValueError, RuntimeError):  # one request's load never fails the step
                log.exception("request %s: loading its KV failed", load.request_id)
                self.counters["short_loads"] += 1

    def wait_for_layer_load(self, layer_idx: int, stream: Any = None) -> None:
        return  # every load is written in start_load_kv

    def save_kv_layer(self, layer_idx: int, stream: Any = None) -> None:
        return  # whole chunks are copied out after the forward, in wait_for_save

    def wait_for_save(self, stream: Any = None) -> None:
        meta = self.get_connector_meta()
        saves = getattr(meta, "saves", ())
        if not saves or self.queue is None:
            return
        if stream is not None and hasattr(stream, "synchronize"):
            stream.synchronize()  # the forward wrote the blocks
        chunk = self.cfg.chunk_tokens
        for save in saves:
            for index, start, keys in save.chunks:
                t0 = time.perf_counter()
                kv = self.pages.read(save.block_ids, start, chunk).to(torch.float32).cpu().numpy()
                self.counters["save_copy_s"] += time.perf_counter() - t0
                if self.queue.offer((keys, index, start, kv, frozenset(save.replace))):
                    self.counters["saved_chunks"] += 1
                else:
                    self.counters["dropped_chunks"] += 1
                    log.warning("request %s: write-back queue full, chunk %d dropped", save.request_id, index)

    def get_finished(self, finished_gen_req_ids: Sequence[int],
                     started_loading_req_ids: Sequence[int]) -> Tuple[List[int], List[int]]:
        return [], []  # no asynchronous load or save is ever started

    # -- helpers -----------------------------------------------------------------------------------
    def _load(self, load: LoadPlan) -> None:
        t0 = time.perf_counter()
        chunk, tokens_per_block = self.cfg.chunk_tokens, self.pages.block_size
        chunks, why = self.stage.pop(load.request_id), ""
        if chunks is None:  # not the scheduler's process: read the planned chunks here
            if self._reader is None:
                self._reader = ChunkReader(self.cfg, self.store)
            chunks, why, _ = self._reader.read_run(load.chunks, time.monotonic() + self.cfg.fetch_timeout_s)
        skip = load.start - load.chunks[0].index * chunk
        request = RequestLoad(self.pages, load.block_ids[load.start // tokens_per_block:], chunk, load.tokens)
        for j, kv in _pieces(chunks, skip, load.tokens, chunk):
            if kv is None:
                request.fail(j, why or "chunk not restored")
                break
            request.put(j, kv)
        loaded = request.loaded_tokens
        self.counters["loads"] += 1
        self.counters["loaded_tokens"] += loaded
        self.counters["load_s"] += time.perf_counter() - t0
        if loaded < load.tokens:  # TensorRT-LLM 1.2 cannot be told: these positions hold stale KV
            self.counters["short_loads"] += 1
            log.error("request %s: loaded %d of the %d promised tokens (%s)", load.request_id, loaded, load.tokens,
                      request.reason)

    def _store_job(self, job) -> None:
        keys, index, start, kv, replace = job
        for (scheme, encoder), key in zip(self.encoders, keys, strict=True):
            if key in replace or not self.store.exists(key):
                t0 = time.perf_counter()
                self.store.put(key, encoder.encode(kv, key, index, start))
                log.info("write-back: chunk %d at %s in %.2f s", index, rung_name(scheme), time.perf_counter() - t0)

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close(timeout_s=30)
        if self._reader is not None:
            self._reader.close()
        self.store.close()
