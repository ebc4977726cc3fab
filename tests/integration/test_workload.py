"""LMCache's long-document QA (``kvcodec bench workload long-doc-qa``'s runner) at a tiny size against a
real ``vllm serve`` with the KVCodec connector: 2 documents of ~600 tokens, output 4, repeat 2, 2 in
flight. The warm-up round computes both documents and writes their chunks back to the store; the
server is then replaced by a new one on the same store (vLLM's own prefix cache empty), so the
query round's first request of each document can only be fast by reading the store. Every answer
equals prefill's (a reference with a fresh ``cache_salt``: nothing reused) and the query round's
mean TTFT is below the warm-up's."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is tested in its own venv: make test-vllm")

from kvcodec.engines.gguf import ensure_model  # noqa: E402
from kvcodec.settings import Settings  # noqa: E402
from kvcodec_tools.ports import free_ports  # noqa: E402
from kvcodec_tools.services.vllm_serve import VllmServe  # noqa: E402
from kvcodec_tools.tritonserver import Ports, TritonServer  # noqa: E402
from kvcodec_tools.workload import LongDocConfig, MultiRoundConfig, make_row  # noqa: E402
from kvcodec_tools.workload_run import EnsembleTarget, OpenAITarget, run_long_doc_qa, run_multi_round  # noqa: E402

from .conftest import REPO, metric_values  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(600)]

KEY = bytes(range(32)).hex()


class Servers:
    """``vllm serve`` with the connector on one store (the bit-exact ``raw`` rung); each call after the
    first replaces the server by a new one, once its write-back has drained (vLLM refreshes the
    connector's gauges at an engine step: a one-token request makes one)."""

    def __init__(self, tmp_path: Path, settings) -> None:
        self.root, self.model, self.started = tmp_path, ensure_model(settings.model_cache).path, []
        self.env = {"KVCODEC_HOME": str(tmp_path), "KVCODEC_STORE": f"file://{tmp_path / 'store'}",
                    "KVCODEC_CHUNK_KEY": KEY, "KVCODEC_LADDER": "raw", "KVCODEC_WRITEBACK": "raw",
                    "KVCODEC_THREADS": "1"}

    def __call__(self) -> OpenAITarget:
        if self.started:
            last, deadline = self.started[-1], time.monotonic() + 120
            while time.monotonic() < deadline:
                last.completion("ping", 1)
                if last.metrics().get("kvcodec_writeback_pending", 0) == 0:
                    break
                time.sleep(0.5)
            last.stop()
        [port] = free_ports(1)
        self.started.append(VllmServe(self.model, self.root, self.env, port).start())
        return OpenAITarget(self.started[-1].url)

    def stop(self) -> str:
        """Stops the last server; its log's tail."""
        tail = self.started[-1].log_tail()
        self.started[-1].stop()
        return tail


def test_long_doc_qa_query_round_reads_the_store_after_a_restart(tmp_path: Path, settings, tokenizer):
    start = Servers(tmp_path, settings)

    config = LongDocConfig(documents=2, document_tokens=600, output_tokens=4, repeat_count=2, repeat_mode="tile",
                           inflight=2)
    try:
        records, times = run_long_doc_qa(start(), tokenizer, config, restart=start, progress=False)
    finally:
        tail = start.stop()
    row = make_row("long-doc-qa", "kvcodec-vllm-serve", None, True, records, {}, **times)
    print(json.dumps({k: v for k, v in row.items() if k != "requests"}))
    assert len(start.started) == 2 and len(list((tmp_path / "store").glob("**/*.kvc"))) >= 4
    assert row["answers_equal"], [(r.doc, r.round, r.text) for r in records]
    query = [r for r in records if r.round == "query"]
    assert all((r.cached_tokens or 0) >= 512 for r in query), ([r.cached_tokens for r in query], tail)
    assert row["query_ttft_mean_s"] < row["warmup_ttft_mean_s"], row


def test_multi_round_turn_two_loads_turn_one_from_the_store_after_a_restart(tmp_path: Path, settings, tokenizer):
    """LMCache's multi-round QA at a tiny size (2 users, 3 turns, a 600-token system prompt): every
    user's turn 1 runs, its chunks are written back, the server is replaced (vLLM's prefix cache
    empty), and turn 2 of each user loads what turn 1 wrote from the store (its cached tokens cover
    the system prompt and the user's first exchange, whole chunks); every answer is prefill's."""
    start = Servers(tmp_path, settings)

    config = MultiRoundConfig(users=2, rounds=3, system_tokens=600, user_info_tokens=0, answer_tokens=4, qps=20.0)
    try:
        records, times = run_multi_round(start(), tokenizer, config, restart=start, progress=False)
    finally:
        tail = start.stop()
    row = make_row("multi-round", "kvcodec-vllm-serve", None, True, records, {}, **times)
    print(json.dumps({k: v for k, v in row.items() if k != "requests"}))
    assert len(start.started) == 2 and row["answers_equal"], [(r.user, r.turn, r.text) for r in records]
    turn2 = [r for r in records if r.turn == 2]
    for r in turn2:
        first = next(x for x in records if x.user == r.user and x.turn == 1)
        stored = len(tokenizer.encode(first.prompt)) // 256 * 256  # turn 1's whole chunks, written back
        assert stored >= 512 and (r.cached_tokens or 0) >= stored, (r.cached_tokens, stored, tail)


def test_long_doc_qa_through_the_ensembles_http_generate_stream_reads_the_store(tmp_path: Path, settings, tokenizer):
    """Triton's ensemble (a real tritonserver, vLLM engine, its prefix cache off) as the workload's
    target through HTTP ``generate_stream``: the warm-up round's misses are written back; once the
    server's ``kvcodec_writeback_pending`` is 0, the query round reads every document from the store
    (the stream's ``reused_tokens`` >= 512: vLLM keeps nothing itself), and every answer equals
    prefill's (asked with ``reuse: false``)."""
    key = tmp_path / "chunk.key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    s = Settings.load({"home": str(tmp_path / "home"), "model_cache": str(settings.model_cache), "threads": "1",
                       "ladder": "raw", "engine": "vllm", "writeback": "raw", "store": f"file://{tmp_path / 'store'}",
                       "key_file": str(key), "adaptive": "0", "prefix_cache": "0"}, env={})
    server = TritonServer(REPO / "model_repository", s, Ports(*free_ports(3)), log_path=tmp_path / "triton.log")
    metrics = f"http://127.0.0.1:{server.ports.metrics}/metrics"
    config = LongDocConfig(documents=2, document_tokens=600, output_tokens=4, repeat_count=1, repeat_mode="tile",
                           inflight=2)

    def written_back() -> EnsembleTarget:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            target.send("ping", 1)  # the gauge is brought up to date at the end of a request
            if sum(metric_values(metrics, "kvcodec_writeback_pending").values()) == 0:
                break
            time.sleep(0.5)
        return target

    server.start(timeout_s=600)
    try:
        target = EnsembleTarget(f"http://{server.http_url}")
        records, times = run_long_doc_qa(target, tokenizer, config, restart=written_back, progress=False)
        saves = metric_values(metrics, "kvcodec_writeback_total")
    finally:
        server.stop()
    row = make_row("long-doc-qa", "kvcodec-ensemble", None, False, records, {}, **times)
    print(json.dumps({k: v for k, v in row.items() if k != "requests"}), saves)
    assert row["answers_equal"], [(r.doc, r.round, r.text) for r in records]
    assert [r.cached_tokens for r in records if r.round == "warmup"] == [0, 0]
    query = [r for r in records if r.round == "query"]
    assert len(query) == 2 and all((r.cached_tokens or 0) >= 512 for r in query), [r.cached_tokens for r in query]
