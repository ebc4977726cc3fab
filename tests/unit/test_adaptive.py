"""The adaptive fetcher below Triton: rung choice from the cost model, per-chunk fallback across
rungs, recompute when fetching is slower, the deadline policy, and the overlap report."""
from __future__ import annotations

import json

import pytest

from kvcodec.errors import ConfigError
from kvcodec.format.codecs import get_scheme
from kvcodec.format.ladder import parse_ladder, parse_rung, rung_name
from kvcodec.serving.chunkinfo import ChunkInfo
from kvcodec.serving.costs import CostModel, record_request
from kvcodec.serving.fetch import Fetcher
from kvcodec.serving.stats import RequestStats, overlap

from .test_pipeline import CHUNK, MODEL, N_CHUNKS, ScriptedStore, assemble, context, encoded, ingest, through_steps  # noqa: F401  (module fixtures)

FP16_PER_TOKEN = 2 * 2 * 3 * 64 * 2  # the synthetic context: 2 layers, 3 heads, head_dim 64
RAW, ZSTD = get_scheme("raw").identity, get_scheme("int8-zstd").identity


class LinkAsSet(CostModel):
    """Costs whose link estimate stays as set: the memory store's own speed is not the link's."""

    def observe_transfer(self, *args, **kwargs):
        pass


def costs(rate_mbps=1000.0, prefill_s_per_token=1.0, raw_decode=0.0, zstd_decode=0.0, frozen=True) -> CostModel:
    c = (LinkAsSet if frozen else CostModel)(None, rate_mbps, FP16_PER_TOKEN)
    c.observe_rung(RAW, CHUNK, FP16_PER_TOKEN * CHUNK, raw_decode * CHUNK, 0.0)
    c.observe_rung(ZSTD, CHUNK, FP16_PER_TOKEN * CHUNK // 2, zstd_decode * CHUNK, 0.0)
    c.observe_prefill(CHUNK, prefill_s_per_token * CHUNK)
    return c


def adaptive(store, c: CostModel, codecs=("int8-zstd", "raw"), deadline_s=0.0) -> Fetcher:
    return Fetcher(store, MODEL, list(codecs), CHUNK, costs=c, adaptive=True, deadline_s=deadline_s)


def both(memory_store, encoded):  # noqa: F811
    ingest(memory_store, encoded, "raw")
    ingest(memory_store, encoded, "int8-zstd")


# -- rung specs ---------------------------------------------------------------------------------

def test_rung_specs_name_a_codec_and_its_quality():
    assert parse_rung("video:12").codec_params["qp"] == 12
    assert parse_rung("raw") == get_scheme("raw")
    assert rung_name(parse_rung("video:12")) == "video:12" and rung_name(get_scheme("video")) == "video"
    assert [s.name for s in parse_ladder("video, int8-zstd,raw")] == ["video", "int8-zstd", "raw"]


@pytest.mark.parametrize("spec, match", [("h266", "unknown"), ("raw:3", "no quality"), ("video:x", "integer"),
                                         ("raw,raw", "twice"), ("", "no codec")])
def test_bad_rung_specs_are_config_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_ladder(spec)


# -- choice ---------------------------------------------------------------------------------------

def test_a_slow_link_picks_the_smaller_rung(memory_store, context, encoded):  # noqa: F811
    ids, _ = context
    both(memory_store, encoded)
    fetched = list(adaptive(memory_store, costs(rate_mbps=10, zstd_decode=1e-5)).fetch(ids, "s"))
    assert [i.scheme for i, _ in fetched] == ["int8-zstd"] * N_CHUNKS
    assert all(i.ok and i.choice.startswith("int8-zstd") and "raw" in i.choice for i, _ in fetched)


def test_a_fast_link_and_a_slow_decoder_pick_raw(memory_store, context, encoded):  # noqa: F811
    ids, _ = context
    both(memory_store, encoded)
    c = costs(rate_mbps=100_000, zstd_decode=1e-3, raw_decode=1e-6)
    fetched = list(adaptive(memory_store, c).fetch(ids, "s"))
    assert [i.scheme for i, _ in fetched] == ["raw"] * N_CHUNKS
    done = assemble(through_steps(fetched))
    assert done.reused_tokens == N_CHUNKS * CHUNK and done.stats().to_dict()["schemes"] == {"raw": N_CHUNKS}


def test_the_choice_follows_the_measured_rate(memory_store, context, encoded):  # noqa: F811
    """Fetches update the link estimate; a store that turns slow moves the choice."""
    ids, _ = context
    both(memory_store, encoded)
    c = costs(rate_mbps=100_000, zstd_decode=2e-5, raw_decode=1e-6, frozen=False)
    f = adaptive(memory_store, c)
    assert list(f.fetch(ids, "a"))[0][0].scheme == "raw"
    assert c.link(memory_store.url)[0] > 1e6  # measured on the fetches
    for _ in range(6):
        c.observe_transfer(memory_store.url, 1 << 20, 1.0)  # 1 MB/s from now on
    assert next(iter(f.fetch(ids, "b")))[0].scheme == "int8-zstd"


def test_a_missing_rung_falls_back_to_the_next_for_that_chunk(context, encoded):  # noqa: F811
    ids, _ = context
    data = dict(encoded["raw"]) | dict(encoded["int8-zstd"])
    store = ScriptedStore(data, vanish=[encoded["int8-zstd"][1][0]])
    fetched = list(adaptive(store, costs(rate_mbps=10)).fetch(ids, "s"))
    assert [i.scheme for i, _ in fetched] == ["int8-zstd", "raw", "int8-zstd"]
    assert all(i.ok for i, _ in fetched)
    done = assemble(through_steps(fetched))
    assert done.reused_tokens == N_CHUNKS * CHUNK and done.stats().to_dict()["schemes"] == {"int8-zstd": 2, "raw": 1}


def test_recompute_when_fetching_is_slower(memory_store, context, encoded):  # noqa: F811
    ids, _ = context
    both(memory_store, encoded)
    # 0.01 Mbit/s: a 98 kB chunk takes ~80 s; computing 256 tokens takes 0.26 s.
    fetched = list(adaptive(memory_store, costs(rate_mbps=0.01, prefill_s_per_token=1e-3)).fetch(ids, "s"))
    assert [i.status for i, _ in fetched] == ["recompute"] + ["miss"] * (N_CHUNKS - 1)
    assert "recompute" in fetched[0][0].reason and all(d == b"" for _, d in fetched)
    done = assemble(through_steps(fetched))
    assert done.reused_tokens == 0 and "recompute: fetching" in done.reason


def test_no_recompute_when_fetching_is_faster(memory_store, context, encoded):  # noqa: F811
    ids, _ = context
    both(memory_store, encoded)
    fetched = list(adaptive(memory_store, costs(rate_mbps=1000, prefill_s_per_token=1e-2)).fetch(ids, "s"))
    assert all(i.ok for i, _ in fetched)


def test_static_requests_never_recompute(memory_store, context, encoded):  # noqa: F811
    ids, _ = context
    both(memory_store, encoded)
    f = adaptive(memory_store, costs(rate_mbps=0.01, prefill_s_per_token=1e-3))
    fetched = list(f.fetch(ids, "s", codecs=["raw"]))
    assert [(i.status, i.scheme) for i, _ in fetched] == [("ok", "raw")] * N_CHUNKS


def test_a_deadline_picks_the_best_quality_that_meets_it(memory_store, context, encoded):  # noqa: F811
    ids, _ = context
    both(memory_store, encoded)
    c = costs(rate_mbps=1000, zstd_decode=1e-3, raw_decode=1e-6)  # raw is fastest here
    # ladder order raw-first means "best quality first"; a generous deadline keeps the first rung
    # that fits even when another is faster
    slow_first = ["int8-zstd", "raw"]
    assert list(adaptive(memory_store, c, slow_first, deadline_s=100).fetch(ids, "s"))[0][0].scheme == "int8-zstd"
    assert list(adaptive(memory_store, c, slow_first, deadline_s=0).fetch(ids, "s"))[0][0].scheme == "raw"


# -- the cost model -------------------------------------------------------------------------------

def test_costs_are_shared_through_their_file(tmp_path):
    path = tmp_path / "costs.json"
    a, b = CostModel(path, 100.0, 1000.0), CostModel(path, 100.0, 1000.0)
    assert b.rung(RAW).bytes_per_token == 1000.0 and b.link("u") == (100e6 / 8, 0.0)
    a.observe_rung(RAW, 256, 256_000, 0.256, 0.0256)
    a.observe_transfer("u", 1_000_000, 0.5)
    b.reload()
    assert b.rung(RAW).bytes_per_token == pytest.approx(1000.0)
    assert b.rung(RAW).decode_s_per_token == pytest.approx(1e-3)
    assert b.link("u")[0] == pytest.approx(2e6)
    b.observe_prefill(100, 1.0)
    a.reload()
    assert a.prefill_s_per_token == pytest.approx(0.01) and a.known(RAW) and not a.known(ZSTD)


def test_a_corrupt_cost_file_is_ignored(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text("{not json")
    c = CostModel(path, 10.0, 5.0)
    assert c.rung(RAW).bytes_per_token == 5.0
    c.observe_prefill(100, 1.0)
    assert json.loads(path.read_text())["prefill"]["s_per_token"] == pytest.approx(0.01)


def test_record_request_learns_from_the_llm_steps_stats():
    c = CostModel(None, 100.0, 1.0)
    stats = RequestStats(reused_tokens=512, chunks=[
        {"status": "ok", "scheme_id": RAW, "bytes": 2560, "s": {"decode": 0.0256, "restore": 0.00256}},
        {"status": "corrupt", "scheme_id": ZSTD, "bytes": 10, "s": {"decode": 9.0}}])
    record_request(c, stats, 256)
    assert c.rung(RAW).bytes_per_token == 10 and c.rung(RAW).decode_s_per_token == pytest.approx(1e-4)
    assert not c.known(ZSTD)
    record_request(c, RequestStats(reused_tokens=0, computed_tokens=1000, compute_first_token_s=5.0), 256)
    assert c.prefill_s_per_token == pytest.approx(5e-3)


# -- overlap --------------------------------------------------------------------------------------

def _info(i, fetch, decode, restore):
    info = ChunkInfo("s", i, 2)
    info.t.update(fetch_start=fetch[0], sent=fetch[1], decoded=decode[1], restored=restore[1])
    info.s.update(fetch=fetch[1] - fetch[0], decode=decode[1] - decode[0], restore=restore[1] - restore[0])
    return info


def test_overlap_counts_work_done_while_a_transfer_ran():
    # transfer 0-1, 1-2; decode of chunk 0 at 1-1.5 (hidden), of chunk 1 at 2-2.5 (not)
    infos = [_info(0, (0, 1), (1, 1.5), (1.5, 1.6)), _info(1, (1, 2), (2, 2.5), (2.5, 2.6))]
    o = overlap(infos)
    assert o.transfer_s == pytest.approx(2.0) and o.decode_s == pytest.approx(1.0)
    assert o.hidden_s == pytest.approx(0.6) and o.hidden_fraction == pytest.approx(0.6 / 1.2, abs=1e-3)
    assert o.bound_s == pytest.approx(2.0) and o.slowest_stage == "fetch"


def test_overlap_of_nothing_is_zero():
    assert overlap([ChunkInfo("s", 0, 0, status="none")]).bound_s == 0.0


def test_miss_status_names_why_reuse_stopped():
    assert RequestStats(reused_tokens=512, chunks_used=2, chunks=[{"status": "ok"}] * 2).miss_status == ""
    partial = RequestStats(reused_tokens=256, chunks_used=1, miss_reason="chunk 1: timeout: late",
                           chunks=[{"status": "ok"}, {"status": "timeout"}, {"status": "miss"}])
    assert partial.miss_status == "timeout" and partial.outcome == "partial"
    assert RequestStats(miss_reason="no stored prefix", chunks=[{"status": "none"}]).miss_status == "none"
    refused = RequestStats(chunks_used=2, miss_reason="restored KV does not fit this model", chunks=[{"status": "ok"}])
    assert refused.miss_status == "unusable" and refused.outcome == "prefill"
