"""The connector in ``vllm serve``: vLLM's own OpenAI-compatible server (``python -m
vllm.entrypoints.openai.api_server``, real, on its CPU build) with ``--kv-transfer-config`` naming
``KVCodecConnector``, its settings from ``KVCODEC_*`` as a user sets them. A first server computes
completion and a chat and writes their full chunks back to the store; asked again, it answers from
its own prefix cache (vLLM's metrics: local hits, no external ones: nothing read); a second server
(a new process: an empty local cache) reads the chat's chunks from the store (external hits) and
gives the same greedy tokens; the completion's chunks, damaged, are refused and computed: the same
answer, nothing loaded. With a local tier (``KVCODEC_LOCAL_STORE``) a restarted server reads what
the first wrote back from this machine, the remote copies gone."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is tested in its own venv: make test-vllm")

from kvcodec.engines.gguf import ensure_model  # noqa: E402
from kvcodec_tools.ports import free_ports  # noqa: E402
from kvcodec_tools.services.vllm_serve import VllmServe  # noqa: E402

from .conftest import text_of  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(1500)]

KEY = bytes(range(32)).hex()
QUESTION = "\n\n# Question: what does this module do?\n# Answer:"


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-serve")


@pytest.fixture(scope="module")
def env(home) -> dict:
    return {"KVCODEC_HOME": str(home), "KVCODEC_STORE": f"file://{home / 'store'}", "KVCODEC_CHUNK_KEY": KEY,
            "KVCODEC_LADDER": "raw", "KVCODEC_WRITEBACK": "raw", "KVCODEC_THREADS": "1"}


@pytest.fixture(scope="module")
def model(settings) -> Path:
    return ensure_model(settings.model_cache).path


def _chunks(home: Path) -> list:
    return sorted((home / "store").glob("**/*.kvc"))


def _wait_for_chunks(home: Path, n: int, timeout_s: float = 60) -> list:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = _chunks(home)
        if len(found) >= n:
            return found
        time.sleep(0.5)
    return _chunks(home)


def _text(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def _cached(answer: dict) -> int:
    return int(((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _settled(server, ok, wait_s: float = 10.0) -> dict:
    """The server's metrics once ``ok`` holds (a read's counts are added as it ends, just after the
    answer can have gone)."""
    deadline = time.monotonic() + wait_s
    while True:
        m = server.metrics()
        if ok(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_vllm_serve_writes_back_reuses_locally_then_from_the_store(home, env, model, tokenizer):
    prompt = text_of(tokenizer, "fnmatch.py", 540) + QUESTION
    chat = [{"role": "system", "content": text_of(tokenizer, "shlex.py", 560)},
            {"role": "user", "content": "What does split() do?"}]
    [port] = free_ports(1)
    with VllmServe(model, home, env, port) as first:
        cold = first.completion(prompt, 8)
        completion_chunks = _wait_for_chunks(home, 2)  # its two full chunks, written back after its prefill
        cold_chat = first.chat(chat, 8)
        stored = _wait_for_chunks(home, 4)
        assert len(completion_chunks) == 2 and len(stored) == 4, (stored, first.log_tail())
        before = first.metrics()
        hot = first.completion(prompt, 8)
        after = first.metrics()
        assert _text(hot) == _text(cold)
        local = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
        external = (after.get("vllm:external_prefix_cache_hits_total", 0)
                    - before.get("vllm:external_prefix_cache_hits_total", 0))
        assert local >= 512 and external == 0  # the local tier: the store was not read
        # the connector's own families on vLLM's /metrics: the local tokens, the chunks written back
        assert after.get("kvcodec_local_tokens_total", 0) >= 512, after
        assert after.get("kvcodec_writeback_chunks_total", 0) >= 4 and after.get("kvcodec_fetched_bytes_total", 0) == 0
    for path in completion_chunks:  # the completion's stored chunks damaged: verified, refused, computed
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    [port] = free_ports(1)
    with VllmServe(model, home, env, port) as second:  # a new process: nothing cached locally
        damaged = second.completion(prompt, 8)
        m0 = second.metrics()
        warm_chat = second.chat(chat, 8)
        m1 = second.metrics()
        assert _text(damaged) == _text(cold)  # the model's own answer, by prefill
        assert m0.get("vllm:external_prefix_cache_hits_total", 0) == 0, second.log_tail()
        assert _text(warm_chat) == _text(cold_chat)  # the chat's chunks, read from the store
        assert m1.get("vllm:external_prefix_cache_hits_total", 0) >= 512, (m1, second.log_tail())
        assert _cached(warm_chat) >= 512
        m2 = _settled(second, lambda m: m.get("kvcodec_reused_tokens_total", 0) >= 512)
        assert m2.get("kvcodec_misses_total", 0) >= 1  # the damaged chunks' read (reason label: corrupt)
        assert m2.get("kvcodec_fetched_bytes_total", 0) > 0 and m2.get("kvcodec_store_breaker_state") == 0
        assert 'reason="corrupt"' in second.metrics_text(), second.log_tail()
    print(json.dumps({"cold_s": cold["elapsed_s"], "hot_s": hot["elapsed_s"], "warm_chat_s": warm_chat["elapsed_s"],
                      "cold_chat_s": cold_chat["elapsed_s"]}))


def test_a_local_tier_serves_a_restarted_server_with_the_remote_copies_gone(home, env, model, tokenizer):
    """``KVCODEC_LOCAL_STORE``: what the first server wrote back is kept on this machine too; a new
    server (vLLM's own prefix cache empty) reads it from there: the remote store's copies are deleted
    first, so nothing of it can have come from the remote store."""
    remote, local = home / "tier-remote", home / "tier-local"
    tier_env = {**env, "KVCODEC_STORE": f"file://{remote}", "KVCODEC_LOCAL_STORE": f"file://{local}",
                "KVCODEC_LOCAL_STORE_MB": "64"}
    prompt = text_of(tokenizer, "glob.py", 540) + QUESTION
    [port] = free_ports(1)
    with VllmServe(model, home, tier_env, port) as first:
        cold = first.completion(prompt, 8)
        deadline = time.monotonic() + 60
        while len(list(local.glob("**/*.kvc"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
    written = sorted(p.relative_to(remote) for p in remote.glob("**/*.kvc"))
    assert len(written) == 2 and sorted(p.relative_to(local) for p in local.glob("**/*.kvc")) == written
    for path in remote.glob("**/*.kvc"):
        path.unlink()
    [port] = free_ports(1)
    with VllmServe(model, home, tier_env, port) as second:
        warm = second.completion(prompt, 8)
        assert _text(warm) == _text(cold) and _cached(warm) >= 512, second.log_tail()
        m = _settled(second, lambda m: m.get("kvcodec_tier_chunks_total", 0) >= 2)
        text = second.metrics_text()
        assert m.get("kvcodec_reused_tokens_total", 0) >= 512 and 'tier="local"' in text, (m, second.log_tail())
        assert 'tier="remote"' not in text
    print(json.dumps({"cold_s": cold["elapsed_s"], "local_tier_s": warm["elapsed_s"]}))


def test_a_tenant_never_reuses_another_tenants_prefix_in_vllm_serve(home, env, model, tokenizer):
    """vLLM's ``cache_salt`` (issue 42): tenant a's document, written back encrypted by a first server,
    is read from the store by a new server for tenant a only. Tenant b sending the same document
    reuses nothing (0 cached tokens: neither vLLM's cache nor the store), gets prefill's text, and its
    TTFT is not a hit's; so its latency tells it nothing of what tenant a sent."""
    store = home / "tenants-store"
    tenant_env = {**env, "KVCODEC_STORE": f"file://{store}", "KVCODEC_ENCRYPT_CHUNKS": "1"}
    document = text_of(tokenizer, "textwrap.py", 1050) + QUESTION
    [port] = free_ports(1)
    with VllmServe(model, home, tenant_env, port) as first:
        cold = first.streamed(document, 8, cache_salt="tenant-a")
        deadline = time.monotonic() + 60
        while len(list(store.glob("**/*.kvc"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.5)
        stored = sorted(store.glob("**/*.kvc"))
        assert len(stored) == 4, first.log_tail()
        ids = np.asarray(tokenizer.encode(document)[:64], "<i4").tobytes()
        assert not any(ids in p.read_bytes() for p in stored)  # encrypted: not even the token ids show
    [port] = free_ports(1)
    with VllmServe(model, home, tenant_env, port) as second:  # a new process: only the store holds it
        second.streamed("Hello there.", 2)  # the first request of a server pays for its warm-up
        stranger = second.streamed(document, 8, cache_salt="tenant-b")
        unsalted = second.streamed(document, 8)
        own = second.streamed(document, 8, cache_salt="tenant-a")
        assert stranger["cached_tokens"] in (0, None) and unsalted["cached_tokens"] in (0, None), second.log_tail()
        assert own["cached_tokens"] >= 1024, (own, second.log_tail())
        assert stranger["text"] == unsalted["text"] == own["text"] == cold["text"]
        assert stranger["ttft_s"] > 1.5 * own["ttft_s"], (stranger["ttft_s"], own["ttft_s"])
    print(json.dumps({"cold_ttft_s": cold["ttft_s"], "stranger_ttft_s": stranger["ttft_s"],
                      "own_ttft_s": own["ttft_s"]}))
