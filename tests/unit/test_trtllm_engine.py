"""The ensemble's TensorRT-LLM engine (``kvcodec.engines.trtllm_engine``) against a stand-in LLM API.

TensorRT-LLM does not install here. The stand-in ``tensorrt_llm`` does what 1.2's ``LLM`` does with
a KV connector, as far as the hand-off goes: it builds ``KVCodecScheduler`` and ``KVCodecWorker``
from the ``kv_connector_config`` it is given (module and class names, as TensorRT-LLM imports them)
with its llm_args, registers a KV pool, and per request asks the scheduler, parks an asynchronous
load until the worker reports it, then "generates". What is checked is ours: the engine keeps the
executor in process (``TLLM_WORKER_USE_SINGLE_PROCESS``), writes the connector's settings where the
connector reads them, stages only the settled, verified prefix of the request's chunks, and the
promise reaches the blocks and the report; a request whose chunks fail is promised nothing.
"""
from __future__ import annotations

import importlib
import sys
import time
import types
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvcodec.connector import LoadSession
from kvcodec.engines import StreamReport
from kvcodec.engines.gguf import ensure_model
from kvcodec.settings import Settings
from tests.other_model import GEOMETRY, write_model

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
L, H, D = GEOMETRY["layers"], GEOMETRY["kv_heads"], GEOMETRY["head_dim"]
BS = 32  # tokens per block


class FakeLLM:
    instances: list = []

    def __init__(self, **args) -> None:
        assert args["backend"] == "pytorch" and args["kv_cache_config"]["enable_block_reuse"]
        self.args = args
        self.single_process = __import__("os").environ.get("TLLM_WORKER_USE_SINGLE_PROCESS")
        cfg = args["kv_connector_config"]
        module = importlib.import_module(cfg.connector_module)
        llm_args = SimpleNamespace(kv_cache_config=SimpleNamespace(**args["kv_cache_config"]), tensor_parallel_size=1,
                                   pipeline_parallel_size=1, attn_backend=args["attn_backend"], cuda_graph_config=None)
        self.scheduler = getattr(module, cfg.connector_scheduler_class)(llm_args)
        self.worker = getattr(module, cfg.connector_worker_class)(llm_args)
        self.pool = torch.full((64, L, 2, H * BS * D), -100.0, dtype=torch.float16)
        self.worker.register_kv_caches(self.pool)
        self.next_id, self.blocks = 0, {}
        FakeLLM.instances.append(self)

    def generate_async(self, ids, sampling_params, streaming, cache_salt=None):
        """As 1.2's ``LLM.generate_async``: the request is submitted at once and the result carries the
        client id (``GenerationResult.request_id``), which the executor's ``LlmRequest`` holds as
        ``py_client_id``; its own ``request_id`` is the executor's (here offset, as they differ there).
        ``cache_salt``: the ``LlmRequest`` carries its id only (``cache_salt_id``, 1.2's binding)."""
        self.next_id += 1
        salt_id = None if cache_salt is None else fake_salt_id(cache_salt)
        return FakeResult(self, 500 + self.next_id, self.next_id, ids, sampling_params, salt_id)

    def _run(self, client, rid, ids, sampling_params, salt_id=None):
        request = SimpleNamespace(request_id=rid, py_client_id=client, prompt_len=len(ids),
                                  get_tokens=lambda beam: list(ids), cache_salt_id=salt_id)
        n, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
        blocks = list(range(-(-len(ids) // BS)))
        self.blocks[rid] = (blocks, n)
        self.scheduler.update_state_after_alloc(request, blocks)
        # the step: metadata to the worker, the step's loads written before its forward
        self.worker.bind_connector_meta(self.scheduler.build_connector_meta(
            SimpleNamespace(new_requests=[], cached_requests=[])))
        self.worker.start_load_kv(None)
        end = time.monotonic() + 10
        while is_async and rid not in self.worker.get_finished([], [rid])[1]:
            assert time.monotonic() < end, "the load was never reported"
            time.sleep(0.005)
        for token in range(sampling_params.max_tokens):
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids_diff=[100 + token])])

    def shutdown(self) -> None:
        self.scheduler.close()
        self.worker.close()


class FakeResult:
    def __init__(self, llm, client, rid, ids, sampling_params, salt_id=None) -> None:
        self.request_id = client
        self._outputs = llm._run(client, rid, ids, sampling_params, salt_id)

    def __iter__(self):
        return self._outputs


def fake_salt_id(salt: str) -> int:
    """``tensorrt_llm.inputs.utils.get_cache_salt_id`` (1.2: 8 bytes of a hash of the salt, little-endian)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


# tensorrt_llm/sampling_params.py (1.2's LLM API): the SamplingParams fields the engine may set
TRTLLM_SAMPLING = {"max_tokens", "end_id", "pad_id", "bad", "bad_token_ids", "stop", "stop_token_ids", "top_k", "top_p",
                   "seed", "temperature", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty"}
SEEN_PARAMS: list = []


def sampling_params(**kw):
    """TensorRT-LLM's ``SamplingParams`` as far as the engine uses it: its field names only, and a
    temperature only where it is > 0 (its documented range)."""
    assert set(kw) <= TRTLLM_SAMPLING, set(kw) - TRTLLM_SAMPLING
    assert kw.get("temperature", 1.0) > 0
    SEEN_PARAMS.append(kw)
    return SimpleNamespace(**kw)


@pytest.fixture
def fake_trtllm(monkeypatch):
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llm_args = types.ModuleType("tensorrt_llm.llmapi.llm_args")
    llm_args.KvCacheConnectorConfig = lambda **kw: SimpleNamespace(**kw)
    root = types.ModuleType("tensorrt_llm")
    root.LLM = FakeLLM
    root.SamplingParams = sampling_params
    root.__path__ = []
    llmapi.__path__ = []
    inputs, utils = types.ModuleType("tensorrt_llm.inputs"), types.ModuleType("tensorrt_llm.inputs.utils")
    inputs.__path__ = []
    utils.get_cache_salt_id = fake_salt_id
    for name, module in {"tensorrt_llm": root, "tensorrt_llm.llmapi": llmapi,
                         "tensorrt_llm.llmapi.llm_args": llm_args, "tensorrt_llm.inputs": inputs,
                         "tensorrt_llm.inputs.utils": utils}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("TLLM_WORKER_USE_SINGLE_PROCESS", raising=False)
    monkeypatch.setenv("TRTLLM_KVCODEC_CHUNK_KEY", bytes(range(32)).hex())
    FakeLLM.instances.clear()
    yield


@pytest.fixture
def engine(fake_trtllm, tmp_path, monkeypatch):
    from kvcodec.engines.trtllm_engine import TrtllmEngine

    monkeypatch.setenv("TRTLLM_KVCODEC_CONFIG", "")
    folder = write_model(tmp_path / "tiny", ensure_model(REPO / ".cache" / "models").path)
    settings = Settings.load({"model": str(folder), "model_cache": str(tmp_path / "cache"),
                              "home": str(tmp_path / "home"), "store": f"memory://trt-{tmp_path.name}",
                              "ladder": "raw", "writeback": "off", "chunk_tokens": "64"}, env={})
    made = TrtllmEngine(settings)
    yield made
    made.close()


def test_the_request_is_promised_its_staged_chunks_in_process(engine):
    import os

    llm = FakeLLM.instances[-1]
    assert llm.single_process == "1" and os.environ["TRTLLM_KVCODEC_CONFIG"].endswith("kvcodec-trtllm.json")
    assert engine.card.model_id.endswith("/trtllm-float16") and engine.takes_session
    ids = list(range(1000, 1200))  # 200 tokens: three chunks of 64, one token left
    kv = (np.random.default_rng(0).integers(-512, 512, (L, 2, H, 192, D)) / 16).astype(np.float16)
    session = LoadSession(64, 3)
    session.put(2, kv[:, :, :, 128:])
    session.put(0, kv[:, :, :, :64])
    session.put(1, kv[:, :, :, 64:128])
    report = StreamReport()
    tokens = list(engine.stream(ids, 3, report=report, load=session))
    assert tokens == [100, 101, 102]
    assert report == StreamReport(staged_tokens=192, reused_tokens=192)
    blocks, promised = llm.blocks[1]
    assert promised == 192
    from kvcodec.connector import KVPages

    pages = KVPages.from_trtllm(llm.pool, L, H, BS, D)
    np.testing.assert_array_equal(pages.read(blocks, 0, 192).numpy(), kv)  # the blocks hold the restored KV


def test_the_request_is_taken_at_its_first_chunk_and_the_chunks_that_follow_are_loaded(engine):
    """``takes_session``: the llm step hands the request over with one chunk in; the engine waits for the
    rest off TensorRT-LLM's executor (nothing submitted yet), then stages and promises all of them."""
    import threading

    llm = FakeLLM.instances[-1]
    ids = list(range(3000, 3200))
    kv = (np.random.default_rng(1).integers(-512, 512, (L, 2, H, 192, D)) / 16).astype(np.float16)
    session = LoadSession(64, 3)
    session.put(0, kv[:, :, :, :64])
    report = StreamReport()
    out: list = []
    worker = threading.Thread(target=lambda: out.extend(engine.stream(ids, 2, report=report, load=session)))
    worker.start()
    time.sleep(0.3)
    assert llm.next_id == 0 and worker.is_alive()  # not yet given to TensorRT-LLM: chunks still coming
    session.put(1, kv[:, :, :, 64:128])
    session.put(2, kv[:, :, :, 128:])
    worker.join(10)
    assert out == [100, 101] and report == StreamReport(staged_tokens=192, reused_tokens=192)
    from kvcodec.connector import KVPages

    blocks, _ = llm.blocks[1]
    np.testing.assert_array_equal(KVPages.from_trtllm(llm.pool, L, H, BS, D).read(blocks, 0, 192).numpy(), kv)


def test_a_request_whose_first_chunk_failed_is_promised_nothing(engine):
    session = LoadSession(64, 3)
    session.fail(0, "corrupt: bad tag")
    session.put(1, np.zeros((L, 2, H, 64, D), np.float16))
    session.put(2, np.zeros((L, 2, H, 64, D), np.float16))
    report = StreamReport()
    assert list(engine.stream(list(range(2000, 2200)), 2, report=report, load=session)) == [100, 101]
    assert report == StreamReport(staged_tokens=0, reused_tokens=0)
    assert FakeLLM.instances[-1].blocks[1][1] == 0


def test_without_tensorrt_llm_the_engine_says_what_it_needs(monkeypatch, tmp_path):
    from kvcodec.engines.trtllm_engine import TrtllmEngine
    from kvcodec.errors import Unsupported

    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    with pytest.raises(Unsupported, match="TensorRT-LLM 1.2"):
        TrtllmEngine(Settings.load({"home": str(tmp_path)}, env={}))


def test_sampling_reaches_tensorrt_llm_under_its_own_names(engine):
    from kvcodec.serving.sampling import Sampling

    session = LoadSession(64, 1)
    session.fail(0, "missing")
    SEEN_PARAMS.clear()
    list(engine.stream(list(range(10)), 2, load=session))
    assert SEEN_PARAMS[-1] == {"max_tokens": 2, "top_k": 1}  # greedy, as its LLM API defines it
    asked = Sampling(temperature=0.7, top_p=0.9, top_k=40, seed=7, min_tokens=2, end_id=5, bad_words=("no",),
                     repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3, stop_words=("x",))
    list(engine.stream(list(range(10)), 2, load=session, sampling=asked))
    assert SEEN_PARAMS[-1] == {"max_tokens": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 7,
                               "min_tokens": 2, "end_id": 5, "bad": ["no"], "repetition_penalty": 1.1,
                               "presence_penalty": 0.2, "frequency_penalty": 0.3}  # stop words: serving.generate's
    greedy_penalised = Sampling(repetition_penalty=1.2, seed=3)
    list(engine.stream(list(range(10)), 2, load=session, sampling=greedy_penalised))
    assert SEEN_PARAMS[-1] == {"max_tokens": 2, "top_k": 1, "repetition_penalty": 1.2}


def test_the_kv_pool_takes_the_share_of_free_gpu_memory_the_setting_gives(engine, fake_trtllm, tmp_path):
    """TensorRT-LLM's own ``free_gpu_memory_fraction`` (0.9) leaves too little beside its pool for the
    stage, ``to_pool``'s transit copies and kv_decode / kv_restore on the same GPU: the engine passes
    ``trtllm_kv_fraction`` (default 0.6); a value outside (0, 1) is refused where it is read."""
    from kvcodec.engines.trtllm_engine import TrtllmEngine, llm_arguments
    from kvcodec.errors import ConfigError

    assert FakeLLM.instances[-1].args["kv_cache_config"]["free_gpu_memory_fraction"] == 0.6
    assert engine.settings.trtllm_kv_fraction == 0.6
    settings = Settings.load({"home": str(tmp_path / "h2"), "model": str(engine.settings.model),
                              "model_cache": str(tmp_path / "c2"), "store": "memory://frac", "ladder": "raw",
                              "chunk_tokens": "64"}, env={"KVCODEC_TRTLLM_KV_FRACTION": "0.45"})
    TrtllmEngine(settings).close()
    assert FakeLLM.instances[-1].args["kv_cache_config"]["free_gpu_memory_fraction"] == 0.45
    for bad in ("1", "1.5", "0", "x"):
        with pytest.raises(ConfigError, match="trtllm_kv_fraction"):
            Settings.load({"trtllm_kv_fraction": bad}, env={})
    with pytest.raises(ValueError, match="free_gpu_memory_fraction"):
        llm_arguments("m", 32, 1.0)



def test_a_salted_request_is_staged_under_the_salt_tensorrt_llm_carries(engine):
    """The ensemble's engine passes the request's cache salt to ``generate_async`` (TensorRT-LLM's own
    block reuse keeps tenants apart) and stages its restored KV under the salt id the connector reads
    off TensorRT-LLM's request, so it is promised; its write-back is told the tenant's own salt."""
    from kvcodec.engines.trtllm_shared import SHARED

    llm = FakeLLM.instances[-1]
    ids = list(range(2000, 2200))
    kv = (np.random.default_rng(1).integers(-512, 512, (L, 2, H, 192, D)) / 16).astype(np.float16)
    report = StreamReport()
    assert list(engine.stream(ids, 2, past_kv=kv, report=report, salt="tenant-a")) == [100, 101]
    assert report.reused_tokens == 192 and llm.blocks[max(llm.blocks)][1] == 192
    stage = f"cache_salt_id={fake_salt_id('tenant-a')}"
    assert SHARED.salts.store_salt(stage) == "tenant-a"
    report = StreamReport()
    list(engine.stream(ids, 2, report=report))  # unsalted: nothing of tenant a's was left for it
    assert report.reused_tokens == 0


def test_tensorrt_llm_runs_without_the_overlap_scheduler_unless_asked(engine, fake_trtllm, tmp_path):
    """1.2's ``_executor_loop_overlap`` ends after a failed forward (``assert sample_state is not None``,
    outside any ``try``; TensorRT-LLM #17913), ``_executor_loop`` goes on: the engine and the llmapi
    model.yaml disable the overlap scheduler unless ``trtllm_overlap_scheduler`` says otherwise."""
    from kvcodec.engines.trtllm_engine import TrtllmEngine, llm_arguments

    assert FakeLLM.instances[-1].args["disable_overlap_scheduler"] is True
    assert llm_arguments("m")["disable_overlap_scheduler"] is True
    settings = replace(engine.settings, trtllm_overlap_scheduler=True, home=tmp_path / "overlap")
    other = TrtllmEngine(settings)
    try:
        assert FakeLLM.instances[-1].args["disable_overlap_scheduler"] is False
    finally:
        other.close()
