"""``kvcodec bench peers``' pieces below its servers: method names, the summary, the prompts (each
a held-out text of the asked length, then the question)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcodec.engines.gguf import ensure_model
from kvcodec.engines.tokenizer import Tokenizer
from kvcodec_tools.peers import QUESTION, PeersConfig, method_parts, prompts, summarize

REPO = Path(__file__).resolve().parents[2]


def test_method_names():
    assert method_parts("lmcache-fp8") == ("lmcache-fp8", None)
    assert method_parts("kvcodec-vllm-serve:int8-zstd") == ("kvcodec-vllm-serve", "int8-zstd")
    for bad in ("lmcache:raw", "vllm", "prefill:raw"):
        with pytest.raises(ValueError):
            method_parts(bad)


def test_summary_percentiles():
    s = summarize([0.4, 0.1, 0.3, 0.2, 1.0])
    assert (s["ttft_p50_s"], s["ttft_p90_s"]) == (0.3, 1.0)


def test_prompts_are_distinct_texts_of_the_asked_length():
    tok = Tokenizer(ensure_model(REPO / ".cache" / "models"))
    texts = prompts(tok, PeersConfig(context_tokens=600, contexts=3))
    assert len(set(texts)) == 3 and all(t.endswith(QUESTION) for t in texts)
    for t in texts:
        assert 600 <= len(tok.encode(t[:-len(QUESTION)])) < 700
