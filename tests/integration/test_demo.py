"""README's main command, ``make demo`` (``kvcodec_tools.demo.run_demo``), passes every time it runs
on the same checkout: run twice in one home, with chunks of another rung stored between the runs
for the same prompt (as a server's write-back at the ladder's first rung, kvtc-w, leaves them), the
second run reuses the rung it ingested, fetches the same bytes and gives the prefill run's tokens.
A short context (one chunk) keeps it cheap; the code path is the demo's own, server included.

The vLLM variant (``make demo ENGINE=vllm``, whose engine really writes back) runs in the vLLM
venv (``make test-vllm``)."""
from __future__ import annotations

import json

import pytest

from kvcodec.engines import open_engine
from kvcodec.format.ladder import DEFAULT_LADDER
from kvcodec.ingest import ingest_rungs
from kvcodec.settings import Settings
from kvcodec_tools.demo import demo_texts, run_demo

from .conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
CONTEXT_TOKENS = 300  # one 256-token chunk


def _demo_home(tmp_path, engine: str, **more: str) -> Settings:
    """A home of the demo's own with the user's defaults (default ladder, write-back ``first``)."""
    return Settings.load({"home": str(tmp_path / "home"), "model_cache": str(REPO / ".cache" / "models"),
                          "threads": "1", "engine": engine, **more}, env={})


def _run(settings, tmp_path, name: str, rung: str) -> dict:
    path = tmp_path / f"{name}.json"
    code = run_demo(settings, path, REPO / "model_repository", rung, context_tokens=CONTEXT_TOKENS)
    doc = json.loads(path.read_text())
    assert code == 0 and doc["tokens_match"] and doc["reused_tokens"] == 256, (name, doc)
    return doc


def test_the_demo_passes_twice_in_one_home_and_reuses_the_rung_it_ingested(tmp_path):
    # adaptive off (KVCODEC_ADAPTIVE=0): a server takes the first rung of its ladder that is stored,
    # so a demo that served with the user's ladder would take kvtc-w whatever the cost model learnt
    settings = _demo_home(tmp_path, "transformers", adaptive="0")
    assert settings.writeback == (DEFAULT_LADDER[0],)  # what a user's server writes back after a miss
    first = _run(settings, tmp_path, "first", "int8-zstd")
    engine = open_engine(settings)  # another rung of the same prompt's chunk, as a write-back leaves it
    _, prompt = demo_texts(engine.tokenizer, CONTEXT_TOKENS)
    other = ingest_rungs(settings, engine, engine.tokenize(prompt), DEFAULT_LADDER[0])
    assert other.written == 1
    del engine
    second = _run(settings, tmp_path, "second", "int8-zstd")
    assert second["bytes_fetched"] == first["bytes_fetched"] > 0  # the int8-zstd chunk again, not kvtc-w's
    assert second["reuse_tokens"] == first["reuse_tokens"] == first["prefill_tokens"]


@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_the_vllm_demo_passes_twice_in_one_home(tmp_path):
    """``make demo ENGINE=vllm`` ran twice once failed: the first run's prefill wrote back kvtc-w
    chunks and the second run's reuse chose them over the raw chunks the demo ingests."""
    pytest.importorskip("vllm", reason="vLLM is tested in its own venv: make test-vllm")
    settings = _demo_home(tmp_path, "vllm", adaptive="0")  # as above: kvtc-w, once written back, comes first
    assert settings.writeback == (DEFAULT_LADDER[0],)
    first = _run(settings, tmp_path, "first", "raw")
    second = _run(settings, tmp_path, "second", "raw")
    # raw: the engine's float32 KV, twice the fp16 bytes (plus the container), both times
    assert second["bytes_fetched"] == first["bytes_fetched"] > 2 * first["kv_fp16_bytes"]
    assert second["reuse_tokens"] == first["reuse_tokens"]
