"""TensorRT-LLM's KV connector (``kvcodec.engines.trtllm_connector``) on CPU, without TensorRT-LLM.

``Replay`` calls the connector as TensorRT-LLM 1.2's executor does (``KVCacheManager.prepare_resources``,
``KvCacheConnectorManager``, ``PyExecutor``): per new request ``get_num_new_matched_tokens`` then
``update_state_after_alloc``; a request answered ``(n, True)`` is parked (left out of the scheduler
output) and named in ``started_loading_req_ids`` until ``get_finished`` reports it loaded; per step
``build_connector_meta`` (pickled, as the broadcast does), ``bind_connector_meta``, ``start_load_kv``,
per layer ``wait_for_layer_load`` / the layer's forward / ``save_kv_layer``, ``wait_for_save``,
``get_finished``; at the end ``request_finished``. The fake requests and scheduler outputs have the
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

from kvcodec.connector import KVPages
from kvcodec.encode import ChunkEncoder
from kvcodec.engines import ModelCard, trtllm_compat
from kvcodec.engines import trtllm_connector as tc
from kvcodec.engines.trtllm_config import CONFIG_ENV, TrtllmConfig, load_config
from kvcodec.engines.trtllm_stage import Loads, Stage
from kvcodec.errors import ConfigError, Unsupported
from kvcodec.format.keys import chunk_keys
from kvcodec.format.ladder import parse_ladder
from kvcodec.serving.decode import ChunkDecoder
from kvcodec.serving.restore import restore
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
    return TrtllmConfig(card=CARD, store=store.url, ladder=tuple(ladder), chunk_tokens=CHUNK, writeback=tuple(writeback),
                        key_file=tmp / "unused.key", prefetch=prefetch)


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
    stage, loads and hand-off (one process: rank 0)."""

    def __init__(self, cfg: TrtllmConfig, store, tokens_per_block: int, num_blocks: int = 160,
                 context_chunk: Optional[int] = None) -> None:
        from kvcodec.connector import HandOff

        args = llm_args(tokens_per_block)
        self.stage, loads, handoff = Stage(), Loads(), HandOff()
        self.scheduler = tc.KVCodecScheduler(args, cfg, store=store, stage=self.stage, loads=loads,
                                             pages_of=lambda: handoff.pages)
        self.worker = tc.KVCodecWorker(args, cfg, store=store, loads=loads, handoff=handoff)
        self.bs, self.context_chunk = tokens_per_block, context_chunk
        self.pool = torch.full((num_blocks, L, 2, H * tokens_per_block * D), SENTINEL)
        self.worker.register_kv_caches(self.pool)  # once, at executor start
        self.free = np.random.default_rng(tokens_per_block).permutation(num_blocks).tolist()
        self.active: dict = {}
        self.parked: dict = {}
        self.metas: list = []
        self.reported: list = []

    def add(self, request: FakeLlmRequest, device_tokens: int = 0) -> int:
        """``addSequence`` with a device prefix-cache hit of ``device_tokens``, then ``update_state_after_alloc``."""
        t0 = time.perf_counter()
        n, is_async = self.scheduler.get_num_new_matched_tokens(request, device_tokens)
        self.answer_s = time.perf_counter() - t0
        assert is_async is (n > 0) and device_tokens + n < request.prompt_len
        blocks = [self.free.pop() for _ in range(-(-request.prompt_len // self.bs))]
        for layer in range(L):  # what the device cache already held
            raw_write(self.pool, blocks, 0, DOC_KV[:, :, :, :device_tokens], layer)
        self.scheduler.update_state_after_alloc(request, blocks)
        entry = dict(request=request, blocks=blocks, position=device_tokens + n, external=n, new=True)
        (self.parked if is_async else self.active)[request.request_id] = entry
        return n

    def wait_loaded(self, timeout_s: float = 10.0) -> None:
        """Steps with nothing scheduled until every parked request is reported loaded."""
        end = time.monotonic() + timeout_s
        while self.parked:
            assert time.monotonic() < end, f"requests {list(self.parked)} never reported loaded"
            self.step()
            time.sleep(0.005)

    def step(self) -> tc.KVCodecMeta:
        out, work = SchedulerOutput(), []
        for rid, r in self.active.items():
            prompt = r["request"].prompt_len
            if r["position"] >= prompt:
                continue
            n = prompt - r["position"] if self.context_chunk is None else min(self.context_chunk, prompt - r["position"])
            data = RequestData(rid, r["request"].tokens if r["new"] else [], r["blocks"] if r["new"] else [],
                               r["position"] - (r["external"] if r["new"] else 0), n)
            (out.new_requests if r["new"] else out.cached_requests).append(data)
            work.append((r, n))
            r["new"] = False
        meta = pickle.loads(pickle.dumps(self.scheduler.build_connector_meta(out)))  # broadcast to the ranks
        self.metas.append(meta)
        self.worker.bind_connector_meta(meta)
        self.worker.start_load_kv(None)
        for layer in range(L):
            self.worker.wait_for_layer_load(layer, None)
            for r, n in work:  # the layer's forward writes the KV of the positions it computes
                raw_write(self.pool, r["blocks"], r["position"], DOC_KV[:, :, :, r["position"]:r["position"] + n], layer)
            self.worker.save_kv_layer(layer, None)
        self.worker.wait_for_save(None)
        saving, loaded = self.worker.get_finished([], list(self.parked))
        assert saving == [] and set(loaded) <= set(self.parked)
        for rid in loaded:
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


def staged(replay, prompt: int, chunks: int, salt: str = "") -> None:
    """What the ensemble's llm step does before it gives the request to the LLM API."""
    replay.stage.put(DOC[:prompt], DOC_KV[:, :, :, :chunks * CHUNK], salt, CHUNK)


def wait_prefetch(scheduler, count: int = 1, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while scheduler.prefetcher.counters["prefetches"] + scheduler.prefetcher.counters["failed"] < count:
        assert time.monotonic() < end, "the prefetch never ended"
        time.sleep(0.01)
    while scheduler.prefetcher._inflight:
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
                     "kvcodec.engines.trtllm_scheduler", "kvcodec.engines.trtllm_worker")


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
            assert (n, is_async) == (want, want > 0), (prompt, computed)
            assert n == 0 or ((computed + n) % tokens_per_block == 0 and computed + n <= prompt - 1)
            assert scheduler.request_finished(request, []) is False
    assert len(scheduler._matched) == 0  # nothing a finished request was promised is left behind


def test_the_scheduler_never_waits_for_the_store(store, replays):
    """A store that hangs: the executor's call returns at once, the prompt is computed, and the
    stored prefix is read in the background for the prompts that follow."""
    ingest(store, "int8-zstd", n_chunks=3)
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
    replay.wait_loaded()
    assert replay.reported == [2]


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
    replay.wait_loaded()
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


def test_a_load_is_reported_only_after_tensorrt_llm_named_it_started(store, replays):
    replay = replays(config(store, prefetch=False), store, 32)
    staged(replay, 900, 2)
    request = FakeLlmRequest(3, DOC[:900])
    assert replay.add(request) == 512
    loads = replay.worker.loads
    end = time.monotonic() + 10
    while not loads.get(3).loaded:
        assert time.monotonic() < end
        time.sleep(0.005)
    assert replay.worker.get_finished([], []) == ([], [])  # loaded, but not yet named started
    assert replay.worker.get_finished([], [3]) == ([], [3])
    assert replay.worker.get_finished([], []) == ([], [])  # reported once


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
@pytest.mark.parametrize("tokens_per_block", [32, 128])
def test_a_bad_middle_chunk_is_never_promised(store, replays, damage, tokens_per_block):
    keys = ingest(store, "int8-zstd", n_chunks=3)
    if damage == "corrupt":
        data = bytearray(store.get(keys[1]))
        data[-100] ^= 0x40  # in the payload: its digest no longer matches
        store.put(keys[1], bytes(data))
    else:
        store.delete(keys[1])
    replay = replays(config(store), store, tokens_per_block)
    first = FakeLlmRequest(1, DOC[:900])
    assert replay.add(first) == 0
    replay.finish(first)
    wait_prefetch(replay.scheduler)
    request = FakeLlmRequest(2, DOC[:900])
    assert replay.add(request) == 256  # the staged run ends before the bad chunk
    replay.wait_loaded()
    blocks = replay.active[2]["blocks"]
    np.testing.assert_array_equal(raw_read(replay.pool, blocks, 0, 256), restored(store, keys[0]))
    assert (raw_read(replay.pool, blocks, 256, 900 - 256) == SENTINEL).all()
    assert replay.worker.counters["short_loads"] == 0
    assert bool(replay.scheduler.prefetcher.corrupt) == (damage == "corrupt")


def test_warm_up_dummies_cache_salt_and_the_count_commitment(store, replays):
    replay = replays(config(store, prefetch=False), store, 32)
    staged(replay, 900, 3, salt="tenant-a")
    scheduler = replay.scheduler
    assert scheduler.get_num_new_matched_tokens(FakeLlmRequest(1, DOC[:900], is_dummy=True), 0) == (0, False)
    assert scheduler.counters["dummies"] == 1 and not scheduler._matched
    assert scheduler.get_num_new_matched_tokens(FakeLlmRequest(2, DOC[:900], cache_salt="tenant-b"), 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(FakeLlmRequest(3, DOC[:900]), 0) == (0, False)  # unsalted
    request = FakeLlmRequest(4, DOC[:900], cache_salt="tenant-a")
    assert scheduler.get_num_new_matched_tokens(request, 0) == (768, True)
    scheduler.commit_new_matched_tokens(request, 256)  # 1.3+: the runtime took fewer than offered
    blocks = list(range(29))
    scheduler.update_state_after_alloc(request, blocks)
    end = time.monotonic() + 10
    while not replay.worker.loads.get(4).loaded:
        assert time.monotonic() < end
        time.sleep(0.005)
    assert replay.worker.loads.get(4).span == (0, 256)
    assert (raw_read(replay.pool, blocks, 256, 512) == SENTINEL).all()


def test_cuda_graphs_are_refused_with_the_fix_on_releases_before_the_connector_supported_them():
    args = llm_args(32, cuda_graph_config=SimpleNamespace(max_batch_size=8))
    with pytest.raises(Unsupported, match="cuda_graph_config: null"):
        trtllm_compat.check_cuda_graphs(args, (1, 2, 0, 1))
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
        store.put(lossy[1], before[lossy[1]][:-1] + bytes([before[lossy[1]][-1] ^ 1]))
    cfg = config(store, writeback=("int8-zstd", "raw"), tmp=tmp_path)
    replay = replays(cfg, store, 32, context_chunk=context_chunk)
    assert replay.add(FakeLlmRequest(8, DOC[:900])) == 0
    wait_prefetch(replay.scheduler)
    replay.finish_all = None
    request = FakeLlmRequest(9, DOC[:900])
    assert replay.add(request) == 256
    replay.wait_loaded()
    start = len(replay.metas)
    while replay.active[9]["position"] < 900:
        replay.step()
    assert replay.worker.queue.flush(timeout_s=30)
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
    from kvcodec.engines.trtllm_worker import QUEUES, writeback_stats

    assert replay.worker.queue in QUEUES  # what the engine exports as kvcodec_writeback_total
    own = replay.worker.queue.stats()
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
    assert (cfg.store, cfg.ladder, cfg.writeback, cfg.chunk_tokens, cfg.card.kv_dtype, cfg.decoder) == (
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
