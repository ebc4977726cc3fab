"""TensorRT-LLM's KV connector (``kvcodec.engines.trtllm_connector``) on CPU, without TensorRT-LLM.

``Replay`` calls the connector as TensorRT-LLM 1.2's executor does (``KVCacheManager.prepare_resources``,
``KvCacheConnectorManager``, ``PyExecutor``): per new request ``get_num_new_matched_tokens`` then
``update_state_after_alloc``; the connector answers synchronous loads only, ``(n, False)``, so the
request is scheduled in the same step with ``computed_position`` already counting the connector's
``n`` tokens (``setPrepopulatedPromptLen(prepopulated + numConnectorMatchedTokens)`` in
``kvCacheManager.cpp``); per step
``build_connector_meta`` (pickled, as the broadcast does), ``bind_connector_meta``, ``start_load_kv``,
per layer ``wait_for_layer_load`` / the layer's forward / ``save_kv_layer``, ``wait_for_save``,
``get_finished``; at the end ``request_finished``. The step keeps 1.2's ``try`` boundaries
(``py_executor.py``): ``_kv_connector_start_batch`` (metadata, ``start_load_kv``) is outside any
``try`` in ``_executor_loop``, so what it raises leaves ``step`` (the executor thread ends there:
``_event_loop_wrapper`` logs and re-raises); the forward (the ``DecoderLayer`` hooks
``KvCacheConnectorManager.layer_pre_hook`` / ``layer_post_hook``, then ``_kv_connector_wait_for_save``)
is inside ``_forward_step``'s ``try``, whose ``except`` calls ``_handle_errors(error_msg)``: every
active request gets that error and leaves, and the loop goes on (``errors``). The fake requests and scheduler outputs have the
fields the connector reads, as TensorRT-LLM's have them. The "model" writes a fixed KV per
position; the pool is checked by raw offsets of ``[num_blocks, layers, 2, kv_heads *
tokens_per_block * head_dim]``, each block ``[heads, slots, dim]``.
"""
from __future__ import annotations

import abc
import importlib.util
import json
import pickle
import sys
import threading
import time
import types
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional

import numpy as np
import pytest
import torch

from kvcodec.connector import KVPages, LoadFailed
from kvcodec.encode import ChunkEncoder
from kvcodec.engines import ModelCard, trtllm_compat
from kvcodec.engines import trtllm_connector as tc
from kvcodec.engines.trtllm_config import CONFIG_ENV, TrtllmConfig, load_config
from kvcodec.engines.trtllm_shared import Shared, to_pool
from kvcodec.errors import ConfigError, Unsupported
from kvcodec.format.keys import chunk_keys
from kvcodec.format.ladder import parse_ladder
from kvcodec.serving.decode import ChunkDecoder
from kvcodec.serving.restore import restore
from kvcodec.settings import Settings
from kvcodec.store.memory import MemoryStore

from .conftest import AUTH, structured_kv

torch.set_num_threads(1)

L, H, D, CHUNK = 2, 3, 64, 256
CARD = ModelCard(name="tiny", model_id="tiny@test/trtllm-float32", layers=L, kv_heads=H, head_dim=D, vocab_size=5000,
                 max_context=4096, kv_dtype="float32")
SENTINEL = -100.0
DOC = [int(t) for t in np.random.default_rng(1).integers(0, 5000, 1024)]  # every prompt is a prefix of it
DOC_KV = np.concatenate([structured_kv(i, L, H, CHUNK, D, token_start=i * CHUNK) for i in range(4)], axis=3)


@pytest.fixture(autouse=True)
def chunk_key(monkeypatch):
    monkeypatch.setenv("TRTLLM_KVCODEC_CHUNK_KEY", bytes(range(32)).hex())  # the key of conftest's AUTH


@pytest.fixture
def store():
    s = MemoryStore(f"trtllm-{uuid.uuid4().hex}")
    yield s
    s.close()


def config(store, ladder=("int8-zstd",), writeback=(), tmp=Path("."), prefetch=True) -> TrtllmConfig:
    settings = Settings.load({"home": str(tmp), "store": store.url, "ladder": ",".join(ladder),
                              "chunk_tokens": str(CHUNK), "writeback": ",".join(writeback) or "off",
                              "key_file": str(tmp / "unused.key"), "threads": "1"}, env={})
    return TrtllmConfig(CARD, settings, prefetch=prefetch)


def ingest(store, rung: str, n_chunks: int = 3) -> List[str]:
    scheme = parse_ladder([rung], CARD)[0]
    encoder = ChunkEncoder(scheme, CARD.model_id, auth=AUTH)
    keys = chunk_keys(DOC, CARD.model_id, scheme.identity, CHUNK)
    for i in range(n_chunks):
        store.put(keys[i], encoder.encode(DOC_KV[:, :, :, i * CHUNK:(i + 1) * CHUNK], keys[i], i, i * CHUNK))
    return keys


def restored(store, key: str) -> np.ndarray:
    """A stored chunk read back by the library itself, not through the connector."""
    return restore(ChunkDecoder(CARD.model_id, auth=AUTH).decode(store.get(key), key=key)).astype(np.float32)


# -- TensorRT-LLM's objects, as far as the connector reads them -----------------------------------------
@dataclass
class FakeLlmRequest:  # bindings.internal.batch_manager.LlmRequest
    request_id: int
    tokens: List[int]
    cache_salt: Optional[str] = None
    is_dummy: bool = False
    cache_salt_id: Optional[int] = None  # what 1.2's binding has (nanobind ``def_prop_ro("cache_salt_id")``)
    py_client_id: Optional[int] = None  # llm_request.py: the executor request's client_id (the LLM API's id)

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)

    def get_tokens(self, beam: int) -> List[int]:
        return list(self.tokens)


@dataclass
class RequestData:  # kv_cache_connector.RequestData (1.2)
    request_id: int
    new_tokens: List[int]
    new_block_ids: List[int]
    computed_position: int
    num_scheduled_tokens: int


@dataclass
class SchedulerOutput:  # kv_cache_connector.SchedulerOutput (1.2)
    new_requests: List[RequestData] = field(default_factory=list)
    cached_requests: List[RequestData] = field(default_factory=list)


def llm_args(tokens_per_block: int, **extra) -> SimpleNamespace:
    """The fields of ``TorchLlmArgs`` the connector reads."""
    kv = SimpleNamespace(tokens_per_block=tokens_per_block, enable_block_reuse=True)
    fields = dict(kv_cache_config=kv, tensor_parallel_size=1, pipeline_parallel_size=1, attn_backend="TRTLLM")
    return SimpleNamespace(**dict(fields, **extra))


# -- raw offsets of the primary pool -------------------------------------------------------------------------
def _flat_index(blocks, start: int, n: int, bs: int, layer: int) -> np.ndarray:
    """Flat offsets [2, H, n, D] of positions [start, start+n) of one layer."""
    p = np.arange(start, start + n)[None, None, :, None]
    b = np.asarray(blocks)[p // bs]
    k, h, d = np.arange(2)[:, None, None, None], np.arange(H)[None, :, None, None], np.arange(D)[None, None, None, :]
    return (((b * L + layer) * 2 + k) * H * bs * D) + (h * bs + p % bs) * D + d


def raw_write(pool: torch.Tensor, blocks, start: int, kv: np.ndarray, layer: int) -> None:
    flat, bs = pool.view(-1), pool.shape[3] // (H * D)
    flat[torch.from_numpy(_flat_index(blocks, start, kv.shape[3], bs, layer))] = torch.from_numpy(kv[layer].copy())


def raw_read(pool: torch.Tensor, blocks, start: int, n: int) -> np.ndarray:
    flat, bs = pool.reshape(-1).numpy(), pool.shape[3] // (H * D)
    return np.stack([flat[_flat_index(blocks, start, n, bs, layer)] for layer in range(L)])


class Replay:
    """TensorRT-LLM 1.2's calls into a connector, for one engine with ``num_blocks`` blocks; its own
    shared state (stage, pool, loads: one process, rank 0)."""

    def __init__(self, cfg: TrtllmConfig, store, tokens_per_block: int, num_blocks: int = 160,
                 context_chunk: Optional[int] = None) -> None:
        args = llm_args(tokens_per_block)
        self.shared = Shared()
        self.stage = self.shared.stage
        self.scheduler = tc.KVCodecScheduler(args, cfg, store=store, shared=self.shared)
        self.worker = tc.KVCodecWorker(args, cfg, store=store, shared=self.shared)
        self.bs, self.context_chunk = tokens_per_block, context_chunk
        self.pool = torch.full((num_blocks, L, 2, H * tokens_per_block * D), SENTINEL)
        self.worker.register_kv_caches(self.pool)  # once, at executor start
        self.free = np.random.default_rng(tokens_per_block).permutation(num_blocks).tolist()
        self.active: dict = {}
        self.parked: dict = {}  # answered (n, True): out of the scheduler output until reported loaded
        self.metas: list = []
        self.reported: list = []
        self.errors: dict = {}  # request id -> the error _handle_errors answered it with
        self.errors_expected = False

    def add(self, request: FakeLlmRequest, device_tokens: int = 0) -> int:
        """``addSequence`` with a device prefix-cache hit of ``device_tokens`` (``get_num_new_matched_tokens``,
        ``setPrepopulatedPromptLen(prepopulated + numConnectorMatchedTokens)``), then ``update_state_after_alloc``."""
        t0 = time.perf_counter()
        n, is_async = self.scheduler.get_num_new_matched_tokens(request, device_tokens)
        self.answer_s = time.perf_counter() - t0
        assert device_tokens + n < request.prompt_len and not (is_async and n == 0)  # (0, True) raises there
        blocks = [self.free.pop() for _ in range(-(-request.prompt_len // self.bs))]
        for layer in range(L):  # what the device cache already held
            raw_write(self.pool, blocks, 0, DOC_KV[:, :, :, :device_tokens], layer)
        self.scheduler.update_state_after_alloc(request, blocks)
        # context_current_position counts the device's and the connector's tokens from here on
        entry = dict(request=request, blocks=blocks, position=device_tokens + n, new=True,
                     external=0 if is_async else n)  # build_scheduler_output's external_loads: this step only
        (self.parked if is_async else self.active)[request.request_id] = entry
        return n

    def step(self, forward: bool = True) -> tc.KVCodecMeta:
        """One executor step (``_kv_connector_start_batch``, the forward, ``wait_for_save``, ``get_finished``);
        ``forward=False``: the model computes nothing (to look at the pool right after the loads).

        ``RequestData`` as ``update_and_build_data`` / ``build_scheduler_output`` make it: a parked request
        is left out; a new one reports ``computed_position = context_current_position`` less the tokens
        matched synchronously in this very step (``external_loads``, reset every step), so after an
        asynchronous load it already counts the connector's tokens; ``num_scheduled_tokens`` is
        ``min(context_remaining_length, context_chunk_size)``, from the position after the connector's."""
        out, work = SchedulerOutput(), []
        for rid, r in self.active.items():
            prompt = r["request"].prompt_len
            external, r["external"] = r["external"], 0
            if r["position"] >= prompt or not forward:
                continue
            n = prompt - r["position"] if self.context_chunk is None else min(self.context_chunk, prompt - r["position"])
            data = RequestData(rid, r["request"].tokens if r["new"] else [], r["blocks"] if r["new"] else [],
                               r["position"] - (external if r["new"] else 0), n)
            (out.new_requests if r["new"] else out.cached_requests).append(data)
            work.append((r, n))
            r["new"] = False
        # _kv_connector_start_batch: outside any try in _executor_loop / _executor_loop_overlap
        meta = pickle.loads(pickle.dumps(self.scheduler.build_connector_meta(out)))  # broadcast to the ranks
        self.metas.append(meta)
        self.worker.bind_connector_meta(meta)
        self.worker.start_load_kv(None)
        try:  # _forward_step
            for layer in range(L):
                self.worker.wait_for_layer_load(layer, None)  # layer_pre_hook
                for r, n in work:  # the layer's forward writes the KV of the positions it computes
                    raw_write(self.pool, r["blocks"], r["position"], DOC_KV[:, :, :, r["position"]:r["position"] + n],
                              layer)
                self.worker.save_kv_layer(layer, None)  # layer_post_hook
            self.worker.wait_for_save(None)  # _kv_connector_wait_for_save, inside the same try
        except Exception as exc:  # _handle_errors(str(exc)): every active request fails and is terminated
            for rid in list(self.active):
                self.errors[rid] = str(exc)
                self.free.extend(self.active.pop(rid)["blocks"])
            work = []
        saving, loaded = self.worker.get_finished([], list(self.parked))
        assert saving == [] and set(loaded) <= set(self.parked)  # an id never passed in: KeyError there
        for rid in loaded:  # CONTEXT_INIT again; should_add_sequence is False: nothing re-matched
            self.active[rid] = self.parked.pop(rid)
            self.reported.append(rid)
        for r, n in work:
            r["position"] += n
        return meta

    def finish(self, request: FakeLlmRequest) -> None:
        r = self.active.pop(request.request_id)
        assert self.scheduler.request_finished(request, r["blocks"]) is False
        self.free.extend(r["blocks"])

    def close(self) -> None:
        self.worker.close()
        self.scheduler.close()


@pytest.fixture
def replays():
    made = []
    yield lambda *a, **k: made.append(Replay(*a, **k)) or made[-1]
    for r in made:
        r.close()
        assert r.errors_expected or not r.errors, r.errors  # no forward failed unless the test meant it


def staged(replay, prompt: int, chunks: int, salt: str = "") -> None:
    """What the ensemble's llm step does before it gives the request to the LLM API."""
    replay.stage.put(DOC[:prompt], to_pool(DOC_KV[:, :, :, :chunks * CHUNK], replay.shared.pages), salt, CHUNK)


def wait_prefetch(scheduler, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while scheduler.prefetcher.busy:
        assert time.monotonic() < end, "the prefetch never ended"
        time.sleep(0.01)


# -- import ---------------------------------------------------------------------------------------------------
SCHEDULER_ABSTRACT = ("build_connector_meta", "get_num_new_matched_tokens", "request_finished",
                      "update_state_after_alloc")
WORKER_ABSTRACT = ("register_kv_caches", "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                   "get_finished")


def _fake_trtllm(path: str) -> dict:
    """A ``tensorrt_llm`` whose connector module at ``path`` holds 1.2's two abstract bases."""

    def init(self, llm_args):
        self._llm_args, self._metadata = llm_args, None

    def bind(self, metadata):
        self._metadata = metadata

    def base(name, abstract, **methods):
        namespace = {m: abc.abstractmethod(lambda self, *a: None) for m in abstract}
        return abc.ABCMeta(name, (abc.ABC,), dict(namespace, __init__=init, **methods))

    module = types.ModuleType(path)
    module.KvCacheConnectorScheduler = base("KvCacheConnectorScheduler", SCHEDULER_ABSTRACT)
    module.KvCacheConnectorWorker = base("KvCacheConnectorWorker", WORKER_ABSTRACT, bind_connector_meta=bind,
                                         get_connector_meta=lambda self: self._metadata)
    parts = path.split(".")
    modules = {".".join(parts[:i]): types.ModuleType(".".join(parts[:i])) for i in range(1, len(parts))}
    for m in modules.values():
        m.__path__ = []
    modules[path] = module
    return modules


CONNECTOR_MODULES = ("kvcodec.engines.trtllm_connector", "kvcodec.engines.trtllm_compat",
                     "kvcodec.engines.trtllm_scheduler", "kvcodec.engines.trtllm_worker",
                     "kvcodec.engines.trtllm_prefetch", "kvcodec.engines.trtllm_shared")


def _load_probe(monkeypatch, fake_modules: dict):
    """The connector imported afresh with ``fake_modules`` in ``sys.modules`` (restored afterwards)."""
    for name, module in fake_modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    for name in CONNECTOR_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    import kvcodec.engines as engines

    monkeypatch.setattr(engines, "trtllm_connector", None, raising=False)
    return importlib.import_module("kvcodec.engines.trtllm_connector")


def test_imports_without_tensorrt_llm_and_subclasses_it_where_present(monkeypatch, store):
    assert "tensorrt_llm" not in sys.modules and tc.HAVE_TRTLLM is False  # not installable here
    probe = _load_probe(monkeypatch, {"tensorrt_llm": None})
    assert probe.HAVE_TRTLLM is False and probe.KVCodecScheduler.__mro__[1].__name__ == "SchedulerStandIn"
    cfg = config(store)
    for path in trtllm_compat.BASE_MODULES:  # 1.2's path, and the later one alone
        fake = _fake_trtllm(path)
        if path != trtllm_compat.BASE_MODULES[0]:
            fake[trtllm_compat.BASE_MODULES[0]] = None
        probe = _load_probe(monkeypatch, fake)
        assert probe.TRTLLM_MODULE == path
        assert issubclass(probe.KVCodecScheduler, fake[path].KvCacheConnectorScheduler)
        assert fake[path].KvCacheConnectorWorker.__abstractmethods__ == frozenset(WORKER_ABSTRACT)
        assert not probe.KVCodecScheduler.__abstractmethods__ and not probe.KVCodecWorker.__abstractmethods__
        scheduler = probe.KVCodecScheduler(llm_args(32), cfg, store=store)  # no abstract method left
        worker = probe.KVCodecWorker(llm_args(32), cfg, store=store)
        worker.bind_connector_meta(probe.KVCodecMeta())
        assert worker.get_connector_meta() == probe.KVCodecMeta() and scheduler._llm_args.kv_cache_config
        scheduler.close()
        worker.close()


def test_a_dependency_tensorrt_llm_lacks_is_not_taken_for_its_absence(monkeypatch):
    class LacksMpi4py:  # finds the connector module, whose import then needs a missing package
        def find_spec(self, name, path=None, target=None):
            if name == trtllm_compat.BASE_MODULES[0]:
                raise ModuleNotFoundError("No module named 'mpi4py'", name="mpi4py")
            return None

    parents = {k: v for k, v in _fake_trtllm(trtllm_compat.BASE_MODULES[0]).items()
               if k != trtllm_compat.BASE_MODULES[0]}
    monkeypatch.setattr(sys, "meta_path", [LacksMpi4py(), *sys.meta_path])
    with pytest.raises(ModuleNotFoundError, match="mpi4py"):
        _load_probe(monkeypatch, parents)


# -- the match: only what is staged, never blocking ----------------------------------------------------------
@pytest.mark.parametrize("tokens_per_block", [16, 32, 64, 128])
def test_matched_tokens_are_staged_whole_blocks_leaving_a_prompt_token(store, replays, tokens_per_block):
    replay = replays(config(store, prefetch=False), store, tokens_per_block)
    staged(replay, 1024, 3)  # the first 768 tokens of DOC
    scheduler, rid = replay.scheduler, 0
    for prompt in (1, 100, 256, 257, 511, 600, 768, 769, 1000):
        for computed in (0, tokens_per_block, 3 * tokens_per_block, 5):
            if computed >= prompt:
                continue
            rid += 1
            request = FakeLlmRequest(rid, DOC[:prompt])
            n, is_async = scheduler.get_num_new_matched_tokens(request, computed)
            stored = CHUNK * min(3, max(0, prompt - 1) // CHUNK)
            want = 0 if computed % tokens_per_block else max(0, stored - computed)
            want -= want % tokens_per_block if (computed + want) % tokens_per_block else 0
            assert (n, is_async) == (want, False), (prompt, computed)  # synchronous: never parked
            assert n == 0 or ((computed + n) % tokens_per_block == 0 and computed + n <= prompt - 1)
            assert scheduler.request_finished(request, []) is False
    assert scheduler.core.pending["matches"] == 0  # nothing a finished request was promised is left behind


def test_the_scheduler_never_waits_for_the_store(store, replays):
    """A store that hangs: the executor's call returns at once, the prompt is computed, and the
    stored prefix is read in the background for the prompts that follow."""
    keys = ingest(store, "int8-zstd", n_chunks=3)
    release = threading.Event()
    real_get = store.get

    def hung_get(key):
        release.wait(30)
        return real_get(key)

    store.get = hung_get
    replay = replays(config(store), store, 32)
    assert replay.add(FakeLlmRequest(1, DOC[:900])) == 0
    assert replay.answer_s < 0.5  # the store has not answered: nothing was awaited
    release.set()
    wait_prefetch(replay.scheduler)
    assert replay.add(FakeLlmRequest(2, DOC[:900])) == 768
    replay.step(forward=False)
    want = np.concatenate([restored(store, k) for k in keys[:3]], axis=3)
    np.testing.assert_array_equal(raw_read(replay.pool, replay.active[2]["blocks"], 0, 768), want)


# -- the load -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens_per_block,device", [(16, 0), (128, 0), (16, 96), (128, 128), (32, 288)])
def test_load_writes_exactly_the_staged_kv_and_nothing_else(store, replays, tokens_per_block, device):
    keys = ingest(store, "int8-zstd", n_chunks=3)
    replay = replays(config(store), store, tokens_per_block)
    first = FakeLlmRequest(6, DOC[:700])
    assert replay.add(first) == 0  # nothing staged: computed, read in the background
    replay.finish(first)
    wait_prefetch(replay.scheduler)
    request = FakeLlmRequest(7, DOC[:700])
    n = replay.add(request, device_tokens=device)
    assert n == 512 - device
    replay.step(forward=False)  # the load is written in the step's start_load_kv
    blocks = replay.active[7]["blocks"]
    want = np.concatenate([restored(store, keys[0]), restored(store, keys[1])], axis=3)
    pool = replay.pool
    np.testing.assert_array_equal(raw_read(pool, blocks, device, n), want[:, :, :, device:512])
    pages = KVPages.from_trtllm(pool, L, H, tokens_per_block, D)
    np.testing.assert_array_equal(pages.read(blocks, device, n).numpy(), want[:, :, :, device:512])
    np.testing.assert_array_equal(raw_read(pool, blocks, 0, device), DOC_KV[:, :, :, :device])  # the device's own
    # one block by hand: block of position p, layer 1, V, head 2, its slot, dim 7
    p = device + n - tokens_per_block + 5
    b, slot = blocks[p // tokens_per_block], p % tokens_per_block
    offset = ((b * L + 1) * 2 + 1) * H * tokens_per_block * D + (2 * tokens_per_block + slot) * D + 7
    assert pool.view(-1)[offset].item() == want[1, 1, 2, p, 7]
    assert int((pool != SENTINEL).sum()) == L * 2 * H * 512 * D  # nothing past the load was written
    assert replay.worker.counters["loaded_tokens"] == n and replay.worker.counters["short_loads"] == 0
    replay.finish(request)


def test_a_load_is_written_in_the_step_that_schedules_it_and_leaves_the_stage(store, replays):
    """(n, False): nothing parked, nothing to report; start_load_kv writes it before the forward and its
    staged KV leaves the stage (TensorRT-LLM's reuse tree holds those blocks from then on)."""
    replay = replays(config(store, prefetch=False), store, 32)
    staged(replay, 900, 2)
    assert replay.stage.stats()["entries"] == 1
    assert replay.add(FakeLlmRequest(3, DOC[:900])) == 512 and not replay.parked
    blocks = replay.active[3]["blocks"]
    assert (raw_read(replay.pool, blocks, 0, 512) == SENTINEL).all()  # nothing before the step
    meta = replay.step(forward=False)
    assert [(j.request_id, j.start, j.tokens) for j in meta.loads] == [(3, 0, 512)]
    np.testing.assert_array_equal(raw_read(replay.pool, blocks, 0, 512), DOC_KV[:, :, :, :512])
    assert replay.stage.stats()["entries"] == 0 and replay.stage.stats()["dropped"] == 1
    assert replay.reported == [] and replay.worker.counters["loads"] == 1


def test_a_failed_load_fails_the_forwards_requests_and_the_executor_loop_goes_on(store, replays, monkeypatch):
    """After the promise TensorRT-LLM cannot be told of a failed load. A write that fails (a device error)
    must neither let it compute over stale blocks nor end its executor thread: ``start_load_kv`` (called
    outside any try) does not raise; the forward's first layer hook does, inside ``_forward_step``'s try,
    so ``_handle_errors`` answers the active requests with the error, the step's other loads are written,
    and the next step serves the next request (Replay.step keeps 1.2's try boundaries)."""
    replay = replays(config(store, prefetch=False), store, 32)
    replay.errors_expected = True
    staged(replay, 900, 2)
    assert replay.add(FakeLlmRequest(5, DOC[:900])) == 512
    other = DOC[:256] + DOC[600:900]
    replay.stage.put(other, to_pool(DOC_KV[:, :, :, :256], replay.shared.pages), "", CHUNK)
    assert replay.add(FakeLlmRequest(6, other)) == 256
    write, calls = replay.worker.pages.write, []

    def broken(block_ids, start, kv):  # request 5's blocks only
        calls.append(block_ids[0])
        if list(block_ids) == replay.active[5]["blocks"][:len(block_ids)]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return write(block_ids, start, kv)

    monkeypatch.setattr(replay.worker.pages, "write", broken)
    replay.step()  # the executor loop's iteration ends normally
    assert "request 5" in replay.errors[5] and set(replay.errors) == {5, 6}  # _handle_errors: every active one
    np.testing.assert_array_equal(raw_read(replay.pool, replay.metas[-1].loads[1].block_ids, 0, 256),
                                  DOC_KV[:, :, :, :256])  # the other load was still written
    assert replay.worker.counters["short_loads"] == 1 and replay.reported == [] and not replay.parked
    monkeypatch.setattr(replay.worker.pages, "write", write)
    staged(replay, 900, 2)
    assert replay.add(FakeLlmRequest(7, DOC[:900])) == 512  # the loop lives on: the next request is served
    replay.step(forward=False)
    np.testing.assert_array_equal(raw_read(replay.pool, replay.active[7]["blocks"], 0, 512), DOC_KV[:, :, :, :512])
    assert 7 not in replay.errors and replay.worker.get_finished([], []) == ([], [])


def test_a_failure_with_no_layer_hook_is_raised_from_wait_for_save(store, replays, monkeypatch):
    """A forward whose layers ran no pre-hook still fails inside ``_forward_step``'s try: ``wait_for_save``
    (``_kv_connector_wait_for_save``, in the same try in 1.2) raises what ``start_load_kv`` kept."""
    replay = replays(config(store, prefetch=False), store, 32)
    staged(replay, 900, 2)
    assert replay.add(FakeLlmRequest(5, DOC[:900])) == 512
    monkeypatch.setattr(replay.worker.pages, "write", lambda *a: (_ for _ in ()).throw(RuntimeError("device")))
    replay.worker.bind_connector_meta(replay.scheduler.build_connector_meta(SchedulerOutput()))
    replay.worker.start_load_kv(None)  # never raises
    with pytest.raises(LoadFailed, match="request 5"):
        replay.worker.wait_for_save(None)
    replay.worker.wait_for_layer_load(0, None)  # raised once: the next forward is not failed for it


class LaggingStream:
    """A device stream that runs behind the host, as TensorRT-LLM's may by a whole forward. Stand-in for
    CUDA: nothing here runs on a GPU; ``done`` is set by the test when "the device" got there."""

    def __init__(self) -> None:
        self.done = False


class EventOn:
    """``torch.cuda.Event`` on a ``LaggingStream``: ``query()`` is True once the stream is past it."""

    def __init__(self, stream: LaggingStream) -> None:
        self.stream, self.recorded = stream, False

    def record(self, stream=None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded and self.stream.done


def test_staged_kv_outlives_the_copy_queued_from_it(store, replays):
    """``start_load_kv`` queues the reads of the staged KV on TensorRT-LLM's stream and the entry leaves
    the stage: the tensor must stay alive until an event recorded on that stream after the copy says it
    ran, or the caching allocator hands its memory to the next ``to_pool`` (another prompt's bytes in
    this request's blocks). The stream is a stand-in (``LaggingStream``: on CPU every copy is done at once)."""
    import gc
    import weakref

    from kvcodec.connector.worker import InFlight

    replay = replays(config(store, prefetch=False), store, 32)
    stream = LaggingStream()
    replay.worker.core.inflight = InFlight(make_event=lambda: EventOn(stream))
    kv = to_pool(DOC_KV[:, :, :, :512], replay.shared.pages)
    alive = weakref.ref(kv)
    replay.stage.put(DOC[:900], kv, "", CHUNK)
    del kv
    assert replay.add(FakeLlmRequest(3, DOC[:900])) == 512
    replay.step(forward=False)
    gc.collect()
    assert replay.stage.stats()["entries"] == 0  # left the stage
    assert alive() is not None and len(replay.worker.core.inflight) == 1  # the queued copy still reads it
    replay.worker.get_finished([], [])
    gc.collect()
    assert alive() is not None  # not yet: the stream is behind
    stream.done = True
    replay.worker.get_finished([], [])
    gc.collect()
    assert alive() is None and len(replay.worker.core.inflight) == 0  # released once the stream is past it


def test_a_device_chunk_is_copied_before_put_returns(monkeypatch):
    """A chunk from a DLPack GPU input is cloned on the device; Triton may reuse the input's buffer once
    ``execute`` returns, so ``put`` waits for the clone (an event recorded after it, synchronized). CUDA is
    modelled: ``clone`` only queues the copy on the current stream; ``Event.synchronize`` runs what was
    queued before the event's record; nothing here runs on a GPU."""
    from kvcodec.connector import LoadSession

    queued: list = []

    class DeviceTensor:
        is_cuda, device, shape = True, "cuda:0", (L, 2, H, CHUNK, D)

        def __init__(self) -> None:
            self.copied = True

        def clone(self):
            out = DeviceTensor()
            out.copied = False
            queued.append(out)  # queued on the current stream, not yet run
            return out

    class Event:
        def record(self, stream=None) -> None:
            self.upto = len(queued)

        def synchronize(self) -> None:
            for t in queued[:self.upto]:
                t.copied = True

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    session = LoadSession(CHUNK, 2)
    session.put(0, DeviceTensor())
    assert all(t.copied for t in session.sources())  # the input's buffer is no longer read


def test_promises_are_recorded_per_request_and_bounded(store, replays):
    """Two requests of one prompt (another device prefix hit each) get their own count, by the LLM API's
    client id (``LlmRequest.py_client_id``); records nobody takes (a request that failed before its
    first output) are bounded."""
    from kvcodec.engines.trtllm_engine import promised_tokens
    from kvcodec.engines.trtllm_shared import Promised

    replay = replays(config(store, prefetch=False), store, 32)
    staged(replay, 900, 2)
    scheduler = replay.scheduler
    assert scheduler.get_num_new_matched_tokens(FakeLlmRequest(1, DOC[:900], py_client_id=11), 0) == (512, False)
    assert scheduler.get_num_new_matched_tokens(FakeLlmRequest(2, DOC[:900], py_client_id=12), 256) == (256, False)
    assert promised_tokens(DOC[:900], shared=replay.shared, client=11) == 512
    assert promised_tokens(DOC[:900], shared=replay.shared, client=12) == 256
    assert scheduler.get_num_new_matched_tokens(FakeLlmRequest(3, DOC[:900]), 0) == (512, False)
    assert promised_tokens(DOC[:900], shared=replay.shared) == 512  # no client id: by prompt, as before
    replay.shared.promised = Promised(max_entries=8)
    for rid in range(100, 150):  # never taken
        scheduler.get_num_new_matched_tokens(FakeLlmRequest(rid, DOC[:900], py_client_id=rid), 0)
    assert len(replay.shared.promised) == 8 and replay.shared.promised.dropped == 42
    assert promised_tokens(DOC[:900], shared=replay.shared, client=149) == 512


def test_only_kv_in_the_pools_dtype_shape_and_device_is_promised(store, replays):
    """What could still fail in the copy is not promised: host numpy, another dtype, another shape."""
    replay = replays(config(store, prefetch=False), store, 32)  # a float32 pool on the CPU
    scheduler = replay.scheduler
    cases = [DOC_KV[:, :, :, :512],  # numpy, as restored
             torch.from_numpy(DOC_KV[:, :, :, :512]).to(torch.float16),  # not the pool's dtype
             torch.from_numpy(DOC_KV[:1, :, :, :512].copy())]  # not the model's layers
    for rid, kv in enumerate(cases):
        replay.stage.put(DOC[:900], kv, "", CHUNK)
        assert scheduler.get_num_new_matched_tokens(FakeLlmRequest(rid, DOC[:900]), 0) == (0, False), rid
    staged(replay, 900, 2)  # through to_pool: float32 on the pool's device
    assert scheduler.get_num_new_matched_tokens(FakeLlmRequest(9, DOC[:900]), 0) == (512, False)


def test_restored_kv_is_staged_from_wherever_kv_restore_left_it(monkeypatch):
    """The trtllm engine stages what kv_restore gave: numpy or a torch tensor on any device (a CUDA one on
    a GPU: numpy cannot take it), in the pool's dtype on the pool's device."""
    from kvcodec.connector import LoadSession
    from kvcodec.engines.trtllm_engine import promised_tokens, stage_restored

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    shared = Shared()
    shared.pages = KVPages.from_trtllm(torch.zeros(40, L, 2, H * 32 * D), L, H, 32, D)
    kv = torch.from_numpy(DOC_KV[:, :, :, :512]).to(torch.bfloat16)  # np.ascontiguousarray raises on it
    assert stage_restored(DOC[:900], None, kv, CHUNK, 1.0, shared=shared) == 512
    found = shared.stage.longest(DOC[:900], CHUNK, limit=899)
    assert found.tokens == 512 and found.kv.dtype == torch.float32
    torch.testing.assert_close(found.kv, kv.float())
    session = LoadSession(CHUNK, 3)  # chunks as the ensemble delivers them: torch, one failed
    session.put(0, torch.from_numpy(DOC_KV[:, :, :, :256]))
    session.fail(1, "corrupt")
    other = DOC[:256] + DOC[300:900]
    assert stage_restored(other, session, None, CHUNK, 1.0, shared=shared) == 256
    assert shared.stage.longest(other, CHUNK).tokens == 256
    assert promised_tokens(DOC[:900], shared=shared) == 0  # nothing promised yet


def test_the_stage_is_bounded_in_bytes_counts_evictions_and_drops():
    from kvcodec.connector.stage import Stage, nbytes

    chunk = torch.zeros(L, 2, H, 2 * CHUNK, D)
    stage = Stage(max_bytes=2 * nbytes(chunk) + 100)
    prompts = [[p] * 1024 for p in (1, 2, 3)]
    for p in prompts:
        assert stage.put(p, chunk.clone(), "", CHUNK)
    stats = stage.stats()
    assert (stats["entries"], stats["evicted"], stats["bytes"]) == (2, 1, 2 * nbytes(chunk))  # prefixes count once
    assert stage.longest(prompts[0], CHUNK) is None  # the least recently used went first
    found = stage.longest(prompts[1] + [7], CHUNK)
    assert found.tokens == 512 and stage.longest(prompts[1][:300], CHUNK).tokens == 256
    stage.drop(found.entry)
    assert stage.longest(prompts[1], CHUNK) is None and stage.stats()["dropped"] == 1
    assert not stage.put([9] * 4096, torch.zeros(L, 2, H, 4096, D), "", CHUNK)  # alone larger than the bound
    assert stage.stats()["refused"] == 1 and stage.bytes <= stage.max_bytes
    cfg = json.dumps({"store": "memory://x", "stage_bytes": 0, "model": dict(name="t", model_id="t@x", layers=2,
                      kv_heads=3, head_dim=64, vocab_size=10, max_context=512)})
    with pytest.raises(ConfigError, match="stage_bytes"):
        from kvcodec.engines.trtllm_config import from_mapping

        from_mapping(json.loads(cfg))


def test_a_staged_lookup_hashes_each_prompt_token_once(monkeypatch):
    """The executor thread's look-up is one pass over the prompt, not a hash of every prefix."""
    import hashlib

    real, hashed = hashlib.blake2b, [0]

    class Counting:
        def __init__(self, data=b"", **kwargs):
            hashed[0] += len(data)
            self._h = real(data, **kwargs)

        def update(self, data):
            hashed[0] += len(data)
            self._h.update(data)

        def digest(self):
            return self._h.digest()

        def hexdigest(self):
            return self._h.hexdigest()

    shared = Shared()
    ids = list(range(32768))
    shared.stage.put(ids[:512], torch.zeros(L, 2, H, 512, D), "", CHUNK)
    monkeypatch.setattr(hashlib, "blake2b", Counting)
    found = shared.stage.longest(ids, CHUNK, limit=len(ids) - 1)
    assert found.tokens == 512
    assert hashed[0] <= 2 * 8 * len(ids)  # every prefix hashed from the start would be ~64x this


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
@pytest.mark.parametrize("tokens_per_block", [32, 128])
def test_a_bad_middle_chunk_is_never_promised(store, replays, damage, tokens_per_block):
    keys = ingest(store, "int8-zstd", n_chunks=3)
    if damage == "corrupt":
        data = bytearray(store.get(keys[1]))
        data[-100] ^= 0x40  # in the payload: its digest no longer matches
        store.put(keys[1], bytes(data), overwrite=True)
    else:
        store.delete(keys[1])
    replay = replays(config(store), store, tokens_per_block)
    first = FakeLlmRequest(1, DOC[:900])
    assert replay.add(first) == 0
    replay.finish(first)
    wait_prefetch(replay.scheduler)
    request = FakeLlmRequest(2, DOC[:900])
    assert replay.add(request) == 256  # the staged run ends before the bad chunk
    replay.step(forward=False)
    blocks = replay.active[2]["blocks"]
    np.testing.assert_array_equal(raw_read(replay.pool, blocks, 0, 256), restored(store, keys[0]))
    assert (raw_read(replay.pool, blocks, 256, 900 - 256) == SENTINEL).all()
    assert replay.worker.counters["short_loads"] == 0
    assert bool(len(replay.shared.corrupt)) == (damage == "corrupt")


def test_warm_up_dummies_cache_salt_and_the_count_commitment(store, replays):
    replay = replays(config(store, prefetch=False), store, 32)
    staged(replay, 900, 3, salt=trtllm_compat.cache_salt(FakeLlmRequest(0, [], cache_salt="tenant-a")))
    scheduler = replay.scheduler
    assert scheduler.get_num_new_matched_tokens(FakeLlmRequest(1, DOC[:900], is_dummy=True), 0) == (0, False)
    assert scheduler.counters["dummies"] == 1 and not scheduler.core.pending["matches"]
    assert scheduler.get_num_new_matched_tokens(FakeLlmRequest(2, DOC[:900], cache_salt="tenant-b"), 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(FakeLlmRequest(3, DOC[:900]), 0) == (0, False)  # unsalted
    request = FakeLlmRequest(4, DOC[:900], cache_salt="tenant-a")
    assert scheduler.get_num_new_matched_tokens(request, 0) == (768, False)
    salted_12 = FakeLlmRequest(5, DOC[:900], cache_salt_id=77)  # 1.2: the salt's id only
    assert scheduler.get_num_new_matched_tokens(salted_12, 0) == (0, False)
    replay.stage.put(DOC[:900], to_pool(DOC_KV[:, :, :, :512], replay.shared.pages), trtllm_compat.cache_salt(salted_12),
                     CHUNK)
    assert scheduler.get_num_new_matched_tokens(FakeLlmRequest(6, DOC[:900], cache_salt_id=78), 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(salted_12, 0) == (512, False)
    scheduler.commit_new_matched_tokens(request, 256)  # 1.3+: the runtime took fewer than offered
    blocks = list(range(29))
    scheduler.update_state_after_alloc(request, blocks)
    meta = scheduler.build_connector_meta(SchedulerOutput())
    assert [(j.request_id, j.start, j.tokens) for j in meta.loads] == [(4, 0, 256)]
    replay.worker.bind_connector_meta(meta)
    replay.worker.start_load_kv(None)
    np.testing.assert_array_equal(raw_read(replay.pool, blocks, 0, 256), DOC_KV[:, :, :, :256])
    assert (raw_read(replay.pool, blocks, 256, 512) == SENTINEL).all()


def test_cuda_graphs_are_refused_with_the_fix_on_releases_before_the_connector_supported_them():
    args = llm_args(32, cuda_graph_config=SimpleNamespace(max_batch_size=8))
    with pytest.raises(Unsupported, match="cuda_graph_config: null") as refused:
        trtllm_compat.check_cuda_graphs(args, (1, 2, 0, 1))
    assert "leaves CUDA graphs on" in str(refused.value)  # kvcodec repository never writes the line
    trtllm_compat.check_cuda_graphs(args, (1, 2, 0, 1 << 30))  # 1.2.0: supported
    trtllm_compat.check_cuda_graphs(llm_args(32, cuda_graph_config=None), (1, 1, 0, 1 << 30))


# -- the save -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("context_chunk", [None, 256])
@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_save_after_a_miss_stores_the_chunks_the_pool_holds(store, replays, tmp_path, damage, context_chunk):
    lossy = ingest(store, "int8-zstd", n_chunks=3)
    before = {k: store.get(k) for k in lossy[:3]}
    if damage == "missing":
        store.delete(lossy[1])
    else:
        store.put(lossy[1], before[lossy[1]][:-1] + bytes([before[lossy[1]][-1] ^ 1]), overwrite=True)
    cfg = config(store, writeback=("int8-zstd", "raw"), tmp=tmp_path)
    replay = replays(cfg, store, 32, context_chunk=context_chunk)
    assert replay.add(FakeLlmRequest(8, DOC[:900])) == 0
    wait_prefetch(replay.scheduler)
    replay.finish_all = None
    request = FakeLlmRequest(9, DOC[:900])
    assert replay.add(request) == 256
    start = len(replay.metas)
    while replay.active[9]["position"] < 900:
        replay.step()
    assert replay.worker.sink.flush(timeout_s=30)
    saved = [s for m in replay.metas[start:] for s in m.saves if s.request_id == 9]
    assert [[c[0] for c in s.chunks] for s in saved] == [[1, 2]]
    assert len(replay.metas) - start == (1 if context_chunk is None else 3)
    blocks = replay.active[9]["blocks"]
    raw_keys = chunk_keys(DOC[:900], CARD.model_id, parse_ladder(["raw"], CARD)[0].identity, CHUNK)
    for i in (1, 2):
        in_pool = raw_read(replay.pool, blocks, i * CHUNK, CHUNK)
        np.testing.assert_array_equal(restored(store, raw_keys[i]), in_pool)  # raw: exactly the pool's KV
        np.testing.assert_allclose(restored(store, lossy[i]), in_pool, atol=0.1)  # int8: stored again
    assert store.get(lossy[2]) == before[lossy[2]]  # present and sound: left as it was
    assert replay.worker.counters["saved_chunks"] == 2 + 3  # request 8 (a miss) saved its three too
    from kvcodec.engines.trtllm_worker import SINKS, writeback_stats

    assert replay.worker.sink in SINKS  # what the engine exports as kvcodec_writeback_total
    own = replay.worker.sink.stats()
    assert own["stored"] >= 1 and writeback_stats()["stored"] >= own["stored"]
    replay.finish(request)


# -- registration and configuration -------------------------------------------------------------------------
def test_register_kv_caches_refuses_what_it_cannot_write(store):
    cfg = config(store)

    def register(tensor, **args):
        worker = tc.KVCodecWorker(llm_args(32, **args) if args else llm_args(32), cfg, store=store)
        try:
            worker.register_kv_caches(tensor)
        finally:
            worker.close()

    register(torch.zeros(4, L, 2, H * 32 * D))
    register(torch.zeros(4, L, 2, H * 32 * D, dtype=torch.bfloat16))
    bad = [
        (torch.zeros(4, L + 1, 2, H * 32 * D), {}, "does not fit"),
        (torch.zeros(4, L, 2, (H + 1) * 32 * D), {}, "does not fit"),
        (torch.zeros(4, L, 2, H * 32 * D + 1), {}, "does not fit"),
        (torch.zeros(4, L, H * 32 * D), {}, "does not fit"),
        (torch.zeros(4, L, 2, H * 16 * D), {}, "16 tokens a block"),
        (torch.zeros(4, L, 2, H * 32 * D), {"tensor_parallel_size": 2}, "tensor_parallel_size 2"),
        (torch.zeros(4, L, 2, H * 32 * D), {"attn_backend": "FLASHINFER"}, "FLASHINFER"),
        (torch.zeros(4, L, 2, H * 32 * D, dtype=torch.float8_e4m3fn), {}, "float8"),
        (torch.zeros(4, L, 2, H * 32 * D), {"kv_cache_config": SimpleNamespace(  # a secondary (host) pool
            tokens_per_block=32, enable_block_reuse=True, host_cache_size=1 << 30)}, "host_cache_size"),
    ]
    for tensor, args, match in bad:
        with pytest.raises(Unsupported, match=match):
            register(tensor, **args)


def test_config_from_the_file_trtllm_names(tmp_path):
    model = dict(name="tiny", model_id="tiny@x/trtllm-float16", layers=2, kv_heads=3, head_dim=64, vocab_size=10,
                 max_context=512)
    path = tmp_path / "kvcodec.json"
    path.write_text(json.dumps({"store": "memory://cfg", "ladder": ["int8-zstd", "raw"], "writeback": "off",
                                "chunk_tokens": 128, "key_file": str(tmp_path / "k"), "model": model}))
    cfg = load_config({CONFIG_ENV: str(path)})
    s = cfg.settings  # the deployment's Settings: every setting defined once
    assert (s.store, tuple(s.ladder), cfg.writeback, cfg.chunk_tokens, cfg.card.kv_dtype, s.decoder) == (
        "memory://cfg", ("int8-zstd", "raw"), (), 128, "float16", "pyav")
    assert load_config({CONFIG_ENV: str(path)}).key_file == tmp_path / "k"
    assert cfg.auth({"TRTLLM_KVCODEC_CHUNK_KEY": bytes(range(32)).hex()}).key_id == AUTH.key_id
    cases = [
        ({"store": "memory://x", "model": model, "ladder": "int8-zstd", "colour": 1}, "unknown key.*colour"),
        ({"store": "memory://x", "model": model, "chunk_tokens": 100}, "chunk_tokens must be a multiple of 8"),
        ({"store": "memory://x", "model": model, "ladder": "no-such-codec"}, "ladder"),
        ({"store": "memory://x", "model": dict(model, layers=0)}, "model.layers"),
        ({"store": "memory://x", "model": dict(model, heads=3)}, "unknown field.*heads"),
        ({"model": model}, "store is required"),
    ]
    for data, match in cases:
        path.write_text(json.dumps(data))
        with pytest.raises(ConfigError, match=match):
            load_config({CONFIG_ENV: str(path)})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config({CONFIG_ENV: str(tmp_path / "absent.json")})


# -- tenants (issue 42) ---------------------------------------------------------------------------------------
def test_a_salted_request_reads_and_writes_its_tenants_chunks_only(store, replays, tmp_path):
    """The llmapi model (prefetch): a request TensorRT-LLM salted (1.2: ``cache_salt_id`` only) never
    stages the unsalted chunks of its prompt, and its write-back stores under its salt: under the
    tenant's own salt where the ensemble's engine posted it (``Shared.salts``: the salt kv_fetch reads
    with), else under the stage salt. Models ``LlmRequest.cache_salt_id`` (PR #7106)."""
    ingest(store, "int8-zstd", n_chunks=3)  # unsalted chunks of DOC: shared, not the tenant's
    cfg = config(store, writeback=("int8-zstd",), tmp=tmp_path)
    replay = replays(cfg, store, 32)
    salted = FakeLlmRequest(1, DOC[:900], cache_salt_id=77)
    assert replay.add(salted) == 0
    wait_prefetch(replay.scheduler)
    assert replay.add(FakeLlmRequest(2, DOC[:900], cache_salt_id=77)) == 0  # still nothing staged for it
    unsalted = FakeLlmRequest(3, DOC[:900])
    assert replay.add(unsalted) == 0
    wait_prefetch(replay.scheduler)
    assert replay.add(FakeLlmRequest(4, DOC[:900])) == 256 * 3  # the unsalted prompt does read them
    for _ in range(3):
        replay.step()
    assert replay.worker.sink.flush(timeout_s=30)
    rung = parse_ladder(["int8-zstd"], CARD)[0].identity
    stage_keys = chunk_keys(DOC[:900], CARD.model_id, rung, CHUNK, salt="cache_salt_id=77")
    assert all(store.exists(k) for k in stage_keys)  # written back under the stage salt (no engine here)
    # the ensemble's engine posts the tenant's salt for the stage salt TensorRT-LLM will carry
    replay.shared.salts.post("cache_salt_id=78", "tenant-b")
    replay.add(FakeLlmRequest(5, DOC[:900], cache_salt_id=78))
    for _ in range(3):
        replay.step()
    assert replay.worker.sink.flush(timeout_s=30)
    tenant_keys = chunk_keys(DOC[:900], CARD.model_id, rung, CHUNK, salt="tenant-b")
    assert all(store.exists(k) for k in tenant_keys)
    assert not any(store.exists(k) for k in chunk_keys(DOC[:900], CARD.model_id, rung, CHUNK,
                                                       salt="cache_salt_id=78"))
