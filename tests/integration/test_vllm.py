"""The ensemble with ``--engine vllm`` on a real tritonserver: restored KV into vLLM's paged cache
through our KV connector, over gRPC and HTTP; fallbacks; write-back; batched concurrent requests; the
front door (text in, sampling, stop words).

vLLM lives in its own venv (``.venv-vllm``, ``make setup-vllm``); ``make test`` runs this module
there (``make test-vllm``). One server for the module; short prompts where length does not matter.
"""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is tested in its own venv: make test-vllm")

from kvcodec.format import container  # noqa: E402
from kvcodec.format.auth import ChunkAuth, load_auth  # noqa: E402
from kvcodec.settings import Settings  # noqa: E402
from kvcodec_client import KVCodecClient  # noqa: E402
from kvcodec_tools.ports import free_ports  # noqa: E402
from kvcodec_tools.tritonserver import Ports, TritonServer  # noqa: E402

from .conftest import REPO, chunk_path, cli, metric_values, post, replaced, text_of  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(1200)]

QUESTION = "\n\n# Question: what does this module do?\n# Answer:"
MAX_TOKENS = 8
LADDER = "raw,lossless8,int8-zstd"


@pytest.fixture(scope="module")
def vsettings(tmp_path_factory) -> Settings:
    home = tmp_path_factory.mktemp("kvcodec-vllm")
    return Settings.load({"home": str(home), "model_cache": str(REPO / ".cache" / "models"), "threads": "1",
                          "ladder": LADDER, "engine": "vllm", "writeback": "raw",
                          # every reuse fetches: these tests are of the engine's load path, and on a busy
                          # CPU the adaptive fetcher may rightly recompute a chunk (test_adaptive tests it);
                          # vLLM's own prefix cache off (test_vllm_local_tier tests it)
                          "adaptive": "0", "prefix_cache": "0"}, env={})


@pytest.fixture(scope="module")
def vserver(vsettings):
    http, grpc, metrics = free_ports(3)
    srv = TritonServer(REPO / "model_repository", vsettings, Ports(http, grpc, metrics))
    srv.start(timeout_s=600)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def grpc(vserver):
    return KVCodecClient(vserver.grpc_url, "grpc")


@pytest.fixture(scope="module")
def http(vserver):
    return KVCodecClient(vserver.http_url, "http")


def ingest(vsettings, tmp_path: Path, text: str, codec: str) -> dict:
    path = tmp_path / f"context-{codec}.txt"
    path.write_text(text)
    return json.loads(cli(vsettings, "ingest", "--engine", "vllm", "--text-file", str(path), "--codec", codec,
                          "--json", "--quiet").stdout)


@pytest.fixture(scope="module")
def context_raw(vsettings, tokenizer, grpc, tmp_path_factory):
    """A text ingested with raw by the vLLM engine (2 chunks), its prompt and vLLM's own prefill answer."""
    text = text_of(tokenizer, "textwrap.py", 540)
    report = ingest(vsettings, tmp_path_factory.mktemp("raw"), text, "raw")
    assert report["chunks"] == 2 and report["written"] == 2, report
    ids = tokenizer.encode(text + QUESTION)
    return ids, grpc.generate(ids, MAX_TOKENS, reuse=False)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_raw_reuse_into_paged_cache_gives_the_engines_own_tokens(vsettings, context_raw, grpc, http, protocol):
    ids, prefill = context_raw
    header = container.parse(chunk_path(vsettings, ids, 0, "raw").read_bytes(), load_auth(vsettings.key_file)).header
    assert header["layout_params"] == {"dtype": "float32"}  # vLLM CPU's own KV bytes
    client = grpc if protocol == "grpc" else http
    result = client.generate(ids, MAX_TOKENS, reuse=True)
    assert result.reused_tokens == 512 and result.stats["scheme"] == "raw"
    assert result.stats["computed_tokens"] == len(ids) - 512
    assert result.stats["engine"]["load_s"] > 0  # the connector wrote the blocks
    assert result.stats["engine"]["promised_tokens"] == 512  # the load session's count, told vLLM at once
    assert result.tokens == prefill.tokens and result.text == prefill.text


def test_lossless8_reuse(vsettings, tokenizer, grpc, tmp_path):
    text = text_of(tokenizer, "fnmatch.py", 540)
    ingest(vsettings, tmp_path, text, "lossless8")
    ids = tokenizer.encode(text + QUESTION)
    # the rung pinned: the adaptive fetcher would recompute a chunk whose decode it predicts slower
    # than prefill (the software HEVC decode on a loaded 2-core machine)
    result = grpc.generate(ids, MAX_TOKENS, reuse=True, codecs="lossless8")
    assert result.reused_tokens == 512 and result.stats["scheme"] == "lossless8"
    prefill = grpc.generate(ids, MAX_TOKENS, reuse=False)
    assert len(result.tokens) == MAX_TOKENS and result.tokens[:2] == prefill.tokens[:2]


def test_corrupt_and_foreign_chunks_fall_back_to_the_engines_prefill(vsettings, context_raw, grpc):
    ids, prefill = context_raw
    path = chunk_path(vsettings, ids, 1, "raw")
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0x40
    with replaced(path, bytes(damaged)):
        result = grpc.generate(ids, MAX_TOKENS, reuse=True)
    assert result.reused_tokens == 256 and "chunk 1: corrupt" in result.stats["miss_reason"]
    assert result.tokens == prefill.tokens
    mine = container.parse(path.read_bytes(), load_auth(vsettings.key_file))
    forged = container.Container(dict(mine.header), dict(mine.sections)).to_bytes(ChunkAuth.random())
    with replaced(chunk_path(vsettings, ids, 0, "raw"), forged):
        result = grpc.generate(ids, MAX_TOKENS, reuse=True)
    assert result.reused_tokens == 0 and "chunk 0: foreign" in result.stats["miss_reason"]
    assert result.tokens == prefill.tokens


def test_writeback_serves_the_second_ask_from_the_store(vsettings, tokenizer, grpc, vserver):
    """No ingest: the first ask is a miss and its 2 full chunks are stored in the background; the
    second ask reuses them (raw: the engine's own KV, the same tokens); the metrics endpoint counts them."""
    ids = tokenizer.encode(text_of(tokenizer, "shlex.py", 540) + QUESTION)
    first = grpc.generate(ids, MAX_TOKENS, reuse=True)
    assert first.reused_tokens == 0 and first.stats["miss_reason"] == "no stored prefix"
    assert first.stats["engine"]["saved_chunks"] == 2
    deadline = time.monotonic() + 60
    while not chunk_path(vsettings, ids, 1, "raw").exists():  # the write-back thread stores it
        assert time.monotonic() < deadline, "write-back did not store the chunks within 60 s"
        time.sleep(0.2)
    second = grpc.generate(ids, MAX_TOKENS, reuse=True)
    assert second.reused_tokens == 512 and second.stats["scheme"] == "raw"
    assert second.tokens == first.tokens
    saves = metric_values(f"http://127.0.0.1:{vserver.ports.metrics}/metrics", "kvcodec_writeback_total")
    assert saves['kvcodec_writeback_total{state="stored"}'] >= 1, saves  # exported at the end of a request
    assert saves['kvcodec_writeback_total{state="failed"}'] == 0, saves


def test_concurrent_requests_are_batched_and_each_answer_is_its_own(context_raw, grpc, tokenizer):
    ids, prefill = context_raw
    others = [tokenizer.encode(text_of(tokenizer, name, 120) + QUESTION) for name in ("glob.py", "bisect.py")]
    alone = [grpc.generate(o, MAX_TOKENS, reuse=False).tokens for o in others]
    jobs = [(ids, True), (others[0], False), (ids, True), (others[1], False)]

    def timed(job):
        start = time.monotonic()
        result = grpc.generate(job[0], MAX_TOKENS, reuse=job[1])
        return result, (start + result.ttft_s, start + result.total_s)  # when its tokens came

    with ThreadPoolExecutor(len(jobs)) as pool:
        results, spans = zip(*pool.map(timed, jobs), strict=True)
    assert [r.tokens for r in results] == [prefill.tokens, alone[0], prefill.tokens, alone[1]]
    assert results[0].reused_tokens == 512 and results[1].reused_tokens == 0
    # batched: the two prefill requests' tokens came in the same stretch of time. An engine that ran
    # requests one after another would finish one before the other's first token.
    (first_a, last_a), (first_b, last_b) = spans[1], spans[3]
    assert first_a < last_b and first_b < last_a, spans


def test_eval_scores_a_codec_on_vllms_own_logits(vsettings, tokenizer, tmp_path):
    """``kvcodec eval --engine vllm``: vLLM's KV through a codec, scored on vLLM's own next-token
    distributions (one batched request per continuation position)."""
    path = tmp_path / "text.txt"
    path.write_text(text_of(tokenizer, "heapq.py", 600))
    report = json.loads(cli(vsettings, "eval", "--engine", "vllm", "--text-file", str(path), "--prefix-tokens", "512",
                            "--continuation-tokens", "16", "--codec", "int8-zstd", "--json").stdout)
    assert report["prefix_tokens"] == 512 and 1.9 < report["ratio_vs_fp16"] < 2.3
    assert 0 < report["mean_kl"] < 0.01 and report["top1_agreement"] >= 0.9


def test_the_front_door_on_vllm(vsettings, context_raw, tokenizer, vserver):
    """TensorRT-LLM's interface over Triton's HTTP generate endpoints, vLLM answering: the prompt as
    text reuses the chunks ingested from it, answered as vLLM's own prefill; sampling answers with and
    without reuse, and a seed is refused by name on the CPU build (``vllm_engine.CPU_UNSEEDED``); stop
    words stop; the deltas add up to the whole answer."""
    ids, prefill = context_raw
    body = {"text_input": tokenizer.decode(ids), "max_tokens": MAX_TOKENS, "exclude_input_in_output": True,
            "codecs": "raw"}
    status, greedy = post(vserver, "generate", body)
    assert status == 200 and greedy["reused_tokens"] == 512, greedy
    assert greedy["text_output"] == tokenizer.decode(prefill.tokens)  # the engine's own answer
    sampled = dict(body, temperature=1.0, top_p=0.95)
    draws = [post(vserver, "generate", dict(sampled, reuse=r)) for r in (True, False)]
    assert [s for s, _ in draws] == [200, 200] and [a["reused_tokens"] for _, a in draws] == [512, 0], draws
    status, refused = post(vserver, "generate", dict(sampled, seed=7))  # the CPU build: vllm_engine.CPU_UNSEEDED
    assert status == 400 and "seed" in refused["error"], refused
    word = greedy["text_output"].strip()[:3]
    assert post(vserver, "generate", dict(body, stop_words=[word]))[1]["text_output"] == \
        greedy["text_output"][:greedy["text_output"].index(word)]
    status, events = post(vserver, "generate_stream", dict(body, stream=True))
    assert status == 200 and "".join(e.get("text_output", "") for e in events) == greedy["text_output"]
