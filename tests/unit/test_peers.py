"""``kvcodec bench peers``' pieces below its servers: method names, the summary, the prompts (each
a held-out text of the asked length, then the question)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcodec.engines.gguf import ensure_model
from kvcodec.engines.tokenizer import Tokenizer
from kvcodec.serving.costs import CostModel
from kvcodec_tools.peers import (
    QUESTION,
    PeersConfig,
    cost_summary,
    method_parts,
    prompts,
    rung_chunks,
    summarize,
)
from kvcodec_tools.peers_stores import resolve, settle

REPO = Path(__file__).resolve().parents[2]


def test_method_names():
    assert method_parts("lmcache-fp8") == ("lmcache-fp8", None)
    assert method_parts("kvcodec-vllm-serve:int8-zstd") == ("kvcodec-vllm-serve", "int8-zstd")
    assert method_parts("kvcodec-ensemble:raw") == ("kvcodec-ensemble", "raw")
    assert method_parts("lmcache-ram") == ("lmcache-ram", None)
    assert method_parts("kvcodec-vllm-serve-ram") == ("kvcodec-vllm-serve-ram", None)
    for local in ("lmcache-ram", "kvcodec-vllm-serve-ram"):  # asked for by name: a local tier, not the link
        assert local not in PeersConfig().methods
    for bad in ("lmcache:raw", "vllm", "prefill:raw", "lmcache-ram:raw", "kvcodec-vllm-serve-ram:raw"):
        with pytest.raises(ValueError):
            method_parts(bad)


def test_rows_say_which_rungs_were_read_and_what_the_cost_model_held(tmp_path):
    text = ('# HELP kvcodec_rung_chunks_total Chunks reused, by rung\n'
            'kvcodec_rung_chunks_total{engine="0",model_name="m",rung="kvtc-w"} 12.0\n'
            'kvcodec_rung_chunks_total{engine="0",model_name="m",rung="int8-zstd"} 4.0\n'
            'kvcodec_rung_bytes_total{engine="0",model_name="m",rung="kvtc-w"} 9e6\n')
    assert rung_chunks(text) == {"kvtc-w": 12, "int8-zstd": 4}
    costs = CostModel(tmp_path / "costs.json")
    costs.observe_rung("int8-zstd/v1/q8/zstd{}", 256, nbytes=2_560_000, decode_s=0.01, restore_s=0.03)
    costs.observe_transfer("redis://x", 10_000_000, 0.05)
    s = cost_summary(tmp_path / "costs.json", 256)
    assert s["per_chunk"] == {"int8-zstd": {"mb": 2.56, "decode_s": 0.01, "restore_s": 0.03}}
    assert s["link_mb_per_s"] == [200.0]
    assert cost_summary(tmp_path / "absent.json", 256) is None


def test_the_s3_bucket_name_is_added_to_the_hosts_file_once(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    for _ in range(2):
        resolve("kvpeers.s3.peers.test", "127.0.0.1", hosts)
    assert hosts.read_text() == "127.0.0.1 localhost\n127.0.0.1 kvpeers.s3.peers.test\n"


def test_settle_waits_until_the_count_stops_changing():
    counts = iter([1, 2, 3, 3, 3, 3])
    assert settle(lambda: next(counts), quiet_s=1.5) == 3


def test_summary_percentiles():
    s = summarize([0.4, 0.1, 0.3, 0.2, 1.0])
    assert (s["ttft_p50_s"], s["ttft_p90_s"]) == (0.3, 1.0)


def test_prompts_are_distinct_texts_of_the_asked_length():
    tok = Tokenizer(ensure_model(REPO / ".cache" / "models"))
    texts = prompts(tok, PeersConfig(context_tokens=600, contexts=3))
    assert len(set(texts)) == 3 and all(t.endswith(QUESTION) for t in texts)
    for t in texts:
        assert 600 <= len(tok.encode(t[:-len(QUESTION)])) < 700


def test_served_gate_kl_and_top1():
    """KL over the reference's tokens (a token the tested list lacks takes its lowest
    log-probability), top-1 agreement, and the gate's verdict."""
    import math

    from kvcodec_tools.quality.served_gate import kl, verdict

    ref = {1: math.log(0.7), 2: math.log(0.2), 3: math.log(0.1)}
    assert kl(ref, dict(ref)) == 0.0
    near = {1: math.log(0.69), 2: math.log(0.21), 3: math.log(0.1)}
    assert 0 < kl(ref, near) < 0.001
    flipped = {2: math.log(0.6), 1: math.log(0.3), 4: math.log(0.1)}  # token 3 missing: takes log 0.1
    expected = 0.7 * math.log(0.7 / 0.3) + 0.2 * math.log(0.2 / 0.6) + 0.1 * math.log(0.1 / 0.1)
    assert kl(ref, flipped) == pytest.approx(expected)
    same = verdict([[ref, ref]], [[near, ref]])
    assert same["passes"] and same["top1_agreement"] == 1.0 and same["positions"] == 2
    assert same["reference_mass_min"] == pytest.approx(1.0)
    off = verdict([[ref, ref]], [[flipped, ref]])
    assert not off["passes"] and off["top1_agreement"] == 0.5
