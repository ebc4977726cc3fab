"""Fetcher -> DecodeStep -> RestoreStep -> Assembler, end to end below Triton on a MemoryStore.

Chunks are ingested by hand with ``ChunkEncoder`` under the keys the fetcher looks up. Between
steps the ``ChunkInfo`` goes through its JSON form, as it does over Triton.
"""
from __future__ import annotations

import itertools
import threading
import time
import types
from typing import Optional

import numpy as np
import pytest

from kvcodec.encode import ChunkEncoder
from kvcodec.errors import StoreUnavailable
from kvcodec.format.codecs import get_scheme
from kvcodec.format.geometry import Geometry
from kvcodec.format.keys import chunk_keys
from kvcodec.layout import get_layout
from kvcodec.serving.assemble import Assembled, Assembler
from kvcodec.serving.chunkinfo import ChunkInfo
from kvcodec.serving.decode import DecodeStep
from kvcodec.serving.fetch import Fetcher
from kvcodec.serving.restore import RestoreStep, descriptor
from kvcodec.store import KVStore

from .conftest import AUTH

MODEL = "org/tiny@abc123"
CHUNK = 256
N_CHUNKS = 3
ALL_CODECS = ["lossless8", "video", "int8-zstd", "raw"]


@pytest.fixture(scope="module")
def context(make_kv):
    """Token ids and the KV of a 3-chunk context (2 layers, 3 heads, head_dim 64)."""
    ids = np.random.default_rng(11).integers(0, 32_000, N_CHUNKS * CHUNK + 40).tolist()
    kv = make_kv(11, layers=2, tokens=N_CHUNKS * CHUNK)
    return ids, kv


@pytest.fixture(scope="module")
def encoded(context):
    """scheme -> the bytes of each chunk of the context, under its key (encoded once)."""
    ids, kv = context
    out = {}
    for name in ("lossless8", "int8-zstd", "raw"):
        scheme = get_scheme(name)
        enc = ChunkEncoder(scheme, MODEL, auth=AUTH)
        keys = chunk_keys(ids, MODEL, scheme.identity, CHUNK)[:N_CHUNKS]
        out[name] = [(key, enc.encode(kv[:, :, :, i * CHUNK:(i + 1) * CHUNK], key, i, i * CHUNK))
                     for i, key in enumerate(keys)]
    return out


def ingest(store: KVStore, encoded, scheme: str, chunks=range(N_CHUNKS)) -> list:
    keys = []
    for i in chunks:
        key, data = encoded[scheme][i]
        store.put(key, data)
        keys.append(key)
    return keys


def q8_round_trip(kv: np.ndarray) -> np.ndarray:
    layout = get_layout("q8")
    planes, side = layout.to_planes(kv)
    return layout.from_planes(planes, side, Geometry.of(kv))


def wire(info: ChunkInfo) -> ChunkInfo:
    return ChunkInfo.from_json(info.to_json())


def through_steps(fetched, decode: Optional[DecodeStep] = None, restore: Optional[RestoreStep] = None):
    decode = decode or DecodeStep(MODEL, auth=AUTH)
    restore = restore or RestoreStep()
    out = []
    for info, data in fetched:
        info = wire(info)
        decoded = decode.run(info, np.frombuffer(data, np.uint8))
        header, side = descriptor(decoded)  # as kv_decode sends it
        info = wire(info)
        kv = restore.run_described(info, header.encode(), side, decoded.planes)
        out.append((wire(info), kv))
    return out


def assemble(restored, assembler: Optional[Assembler] = None) -> Assembled:
    assembler = assembler or Assembler()
    results = [assembler.add(info, kv) for info, kv in restored]
    assert all(r is None for r in results[:-1]), "assembled before the last chunk arrived"
    assert results[-1] is not None, "not assembled after the last chunk"
    assert len(assembler) == 0
    return results[-1]


def fetcher(store, codecs=ALL_CODECS) -> Fetcher:
    return Fetcher(store, MODEL, codecs, CHUNK)


class ScriptedStore(KVStore):
    """A store over a dict whose get/exists misbehave for chosen keys."""

    def __init__(self, data, vanish=(), fail_get=(), fail_exists=False):
        self.data, self.vanish, self.fail_get, self.fail_exists = dict(data), set(vanish), set(fail_get), fail_exists

    def exists(self, key):
        if self.fail_exists:
            raise StoreUnavailable("connection refused")
        return key in self.data

    def get(self, key):
        if key in self.fail_get:
            raise StoreUnavailable("connection reset")
        return None if key in self.vanish else self.data.get(key)


# -- plan ---------------------------------------------------------------------------------------

def test_plan_finds_the_longest_stored_prefix(memory_store, context, encoded):
    ids, _ = context
    keys = ingest(memory_store, encoded, "int8-zstd", chunks=[0, 1])
    plan = fetcher(memory_store).plan(ids)
    assert plan.scheme.name == "int8-zstd" and plan.keys == keys


def test_plan_stops_at_the_first_gap(memory_store, context, encoded):
    ids, _ = context
    keys = ingest(memory_store, encoded, "int8-zstd", chunks=[0, 2])
    plan = fetcher(memory_store).plan(ids)
    assert plan.keys == keys[:1]


def test_plan_needs_the_first_chunk(memory_store, context, encoded):
    ids, _ = context
    ingest(memory_store, encoded, "int8-zstd", chunks=[1, 2])
    assert fetcher(memory_store).plan(ids) is None


def test_plan_prefers_the_codec_with_more_chunks(memory_store, context, encoded):
    ids, _ = context
    ingest(memory_store, encoded, "raw", chunks=[0])
    ingest(memory_store, encoded, "int8-zstd", chunks=[0, 1])
    plan = fetcher(memory_store, ["raw", "int8-zstd"]).plan(ids)
    assert plan.scheme.name == "int8-zstd" and len(plan.keys) == 2


def test_plan_keeps_the_preference_order_on_a_tie(memory_store, context, encoded):
    ids, _ = context
    ingest(memory_store, encoded, "raw", chunks=[0, 1])
    ingest(memory_store, encoded, "int8-zstd", chunks=[0, 1])
    assert fetcher(memory_store, ["raw", "int8-zstd"]).plan(ids).scheme.name == "raw"
    assert fetcher(memory_store, ["int8-zstd", "raw"]).plan(ids).scheme.name == "int8-zstd"


def test_plan_ignores_codecs_it_is_not_told_to_use(memory_store, context, encoded):
    ids, _ = context
    ingest(memory_store, encoded, "raw")
    assert fetcher(memory_store, ["int8-zstd", "lossless8"]).plan(ids) is None


@pytest.mark.parametrize("n_tokens, planned", [(2 * CHUNK, 1), (2 * CHUNK + 1, 2), (CHUNK, 0), (3 * CHUNK, 2)])
def test_plan_never_covers_the_whole_prompt(memory_store, context, encoded, n_tokens, planned):
    ids, _ = context
    ingest(memory_store, encoded, "int8-zstd")
    plan = fetcher(memory_store).plan(ids[:n_tokens])
    assert (len(plan.keys) if plan else 0) == planned


def test_plan_of_another_model_finds_nothing(memory_store, context, encoded):
    ids, _ = context
    ingest(memory_store, encoded, "int8-zstd")
    assert Fetcher(memory_store, "org/other@abc123", ALL_CODECS, CHUNK).plan(ids) is None


# -- fetch --------------------------------------------------------------------------------------

def _only_none_record(fetched, reason_part: str) -> ChunkInfo:
    assert len(fetched) == 1
    info, data = fetched[0]
    assert info.count == 0 and info.index == 0 and info.status == "none" and data == b""
    assert reason_part in info.reason
    assert {"request", "sent"} <= set(info.t)
    return info


def test_nothing_stored_yields_one_none_record(memory_store, context):
    ids, _ = context
    info = _only_none_record(list(fetcher(memory_store).fetch(ids, "s1")), "no stored prefix")
    assert info.session == "s1"


def test_reuse_disabled_yields_one_none_record(memory_store, context, encoded):
    ids, _ = context
    ingest(memory_store, encoded, "int8-zstd")
    _only_none_record(list(fetcher(memory_store).fetch(ids, "s1", reuse=False)), "reuse disabled")


def test_a_none_record_passes_every_step_and_assembles_to_nothing(memory_store, context):
    ids, _ = context
    restored = through_steps(fetcher(memory_store).fetch(ids, "s1"))
    info, kv = restored[0]
    assert info.status == "none" and kv.size == 0
    done = assemble(restored)
    assert done.past_kv is None and done.reused_tokens == 0
    stats = done.stats().to_dict()
    assert stats["reused_tokens"] == 0 and stats["chunks_planned"] == 0 and stats["chunks_used"] == 0
    assert "no stored prefix" in stats["miss_reason"]


def test_store_lookup_failure_is_a_none_record_not_an_exception(context, encoded):
    ids, _ = context
    store = ScriptedStore(dict(encoded["int8-zstd"]), fail_exists=True)
    _only_none_record(list(fetcher(store).fetch(ids, "s1")), "store lookup failed")


def test_fetch_yields_each_planned_chunk_with_its_place(memory_store, context, encoded):
    ids, _ = context
    ingest(memory_store, encoded, "int8-zstd")
    fetched = list(fetcher(memory_store).fetch(ids, "sess"))
    assert len(fetched) == N_CHUNKS
    for i, (info, data) in enumerate(fetched):
        key, stored = encoded["int8-zstd"][i]
        assert (info.session, info.index, info.count, info.status) == ("sess", i, N_CHUNKS, "ok")
        assert info.key == key and data == stored and info.bytes == len(stored)
        assert (info.token_start, info.tokens, info.scheme) == (i * CHUNK, CHUNK, "int8-zstd")
        assert info.s["fetch"] > 0 and info.t["sent"] >= info.t["request"]  # the read was timed


def test_a_chunk_that_vanishes_is_a_miss_from_there_on(context, encoded):
    ids, _ = context
    chunks = encoded["int8-zstd"]
    store = ScriptedStore(dict(chunks), vanish=[chunks[1][0]])
    fetched = list(fetcher(store).fetch(ids, "s"))
    assert [i.status for i, _ in fetched] == ["ok", "miss", "miss"]
    assert "vanished" in fetched[1][0].reason and "earlier chunk" in fetched[2][0].reason
    assert fetched[2][1] == b""  # not fetched after a failure
    done = assemble(through_steps(fetched))
    assert done.reused_tokens == CHUNK and "chunk 1: miss" in done.reason


def test_a_store_error_mid_way_is_a_failed_chunk(context, encoded):
    ids, _ = context
    chunks = encoded["int8-zstd"]
    store = ScriptedStore(dict(chunks), fail_get=[chunks[2][0]])
    fetched = list(fetcher(store).fetch(ids, "s"))
    assert [i.status for i, _ in fetched] == ["ok", "ok", "error"]
    assert "connection reset" in fetched[2][0].reason
    done = assemble(through_steps(fetched))
    assert done.reused_tokens == 2 * CHUNK


# -- decode, restore, assemble -------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["lossless8", "int8-zstd", "raw"])
def test_end_to_end_assembles_the_restored_chunks(memory_store, context, encoded, scheme):
    ids, kv = context
    ingest(memory_store, encoded, scheme)
    restored = through_steps(fetcher(memory_store, [scheme]).fetch(ids, "req-1"))
    assert [info.status for info, _ in restored] == ["ok"] * N_CHUNKS
    for info, chunk in restored:
        assert chunk.dtype == np.float16 and chunk.shape == (2, 2, 3, CHUNK, 64)
        assert {"fetch", "decode", "restore"} <= set(info.s)
        assert {"request", "sent", "received", "decoded", "restored"} <= set(info.t)
    done = assemble(restored)
    assert done.reused_tokens == N_CHUNKS * CHUNK and done.reason == ""
    assert np.array_equal(done.past_kv, np.concatenate([c for _, c in restored], axis=3))
    want = kv.astype(np.float16) if scheme == "raw" else np.concatenate(
        [q8_round_trip(kv[:, :, :, i * CHUNK:(i + 1) * CHUNK]) for i in range(N_CHUNKS)], axis=3)
    assert np.array_equal(done.past_kv, want)
    stats = done.stats().to_dict()
    assert stats["reused_tokens"] == 768 and stats["chunks_planned"] == 3 and stats["chunks_used"] == 3
    assert stats["scheme"] == scheme and stats["miss_reason"] == ""
    assert stats["bytes_fetched"] == sum(len(d) for _, d in encoded[scheme])
    assert [c["status"] for c in stats["chunks"]] == ["ok"] * 3


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_corrupted_chunk_is_a_miss_from_that_chunk_on(memory_store, context, encoded, where):
    ids, _ = context
    keys = ingest(memory_store, encoded, "int8-zstd")
    bad = bytearray(memory_store.get(keys[1]))
    bad[-5 if where == "payload" else 20] ^= 0x04
    memory_store.put(keys[1], bytes(bad), overwrite=True)
    restored = through_steps(fetcher(memory_store).fetch(ids, "s"))
    assert [i.status for i, _ in restored] == ["ok", "corrupt", "ok"]
    done = assemble(restored)
    assert done.reused_tokens == CHUNK
    assert np.array_equal(done.past_kv, restored[0][1])
    reason = done.stats().to_dict()["miss_reason"]
    assert "chunk 1" in reason and "corrupt" in reason, reason
    assert done.stats().to_dict()["chunks_used"] == 2  # chunk 2 was good, but comes after the hole


def test_a_chunk_under_the_wrong_key_is_foreign(memory_store, context, encoded):
    ids, _ = context
    keys = ingest(memory_store, encoded, "int8-zstd")
    memory_store.put(keys[1], memory_store.get(keys[0]), overwrite=True)
    restored = through_steps(fetcher(memory_store).fetch(ids, "s"))
    assert [i.status for i, _ in restored] == ["ok", "foreign", "ok"]
    assert "key" in restored[1][0].reason
    done = assemble(restored)
    assert done.reused_tokens == CHUNK and "chunk 1: foreign" in done.reason


def test_a_chunk_of_the_wrong_length_is_foreign(memory_store, context, encoded):
    ids, kv = context
    keys = ingest(memory_store, encoded, "int8-zstd")
    short = ChunkEncoder(get_scheme("int8-zstd"), MODEL, auth=AUTH).encode(kv[:, :, :, CHUNK:CHUNK + 128], keys[1], 1, CHUNK)
    memory_store.put(keys[1], short, overwrite=True)
    restored = through_steps(fetcher(memory_store).fetch(ids, "s"))
    assert restored[1][0].status == "foreign" and "128 tokens" in restored[1][0].reason
    assert assemble(restored).reused_tokens == CHUNK


def test_decode_step_uses_the_model_it_was_made_for(memory_store, context, encoded):
    ids, _ = context
    ingest(memory_store, encoded, "int8-zstd")
    restored = through_steps(fetcher(memory_store).fetch(ids, "s"), decode=DecodeStep("org/other@abc123", auth=AUTH))
    assert [i.status for i, _ in restored] == ["foreign"] * N_CHUNKS
    assert assemble(restored).past_kv is None


def test_steps_pass_a_failed_chunk_through_untouched():
    info = ChunkInfo("s", 1, 3, key="k").fail("miss", "gone")
    decoded = DecodeStep(MODEL, auth=AUTH).run(info, b"whatever")
    assert info.status == "miss" and decoded.planes.size == 0 and decoded.header is None
    kv = RestoreStep().run(info, decoded)
    assert info.status == "miss" and info.reason == "gone" and kv.size == 0 and kv.ndim == 5


def test_restore_step_marks_bad_header_bytes_corrupt():
    info = ChunkInfo("s", 0, 1, tokens=CHUNK)
    kv = RestoreStep().run_described(info, b"not a chunk header", np.zeros(0, np.uint8), np.zeros((1, 1, 10), np.uint8))
    assert info.status == "corrupt" and kv.size == 0


def test_chunks_arriving_out_of_order_assemble_in_order(memory_store, context, encoded):
    ids, _ = context
    ingest(memory_store, encoded, "int8-zstd")
    restored = through_steps(fetcher(memory_store).fetch(ids, "s"))
    want = np.concatenate([c for _, c in restored], axis=3)
    for order in itertools.permutations(range(N_CHUNKS)):
        done = assemble([restored[i] for i in order])
        assert [i.index for i in done.infos] == [0, 1, 2]
        assert np.array_equal(done.past_kv, want), f"order {order}"


def test_sessions_are_kept_apart(memory_store, context, encoded):
    ids, kv = context
    ingest(memory_store, encoded, "int8-zstd")
    ingest(memory_store, encoded, "raw")
    a = through_steps(fetcher(memory_store, ["int8-zstd"]).fetch(ids, "A"))
    b = through_steps(fetcher(memory_store, ["raw"]).fetch(ids[: 2 * CHUNK + 1], "B"))
    assembler = Assembler()
    results = {}
    for info, chunk in [a[0], b[0], a[1], b[1], a[2]]:
        done = assembler.add(info, chunk)
        if done is not None:
            results[info.session] = done
    assert len(assembler) == 0
    assert results["B"].reused_tokens == 2 * CHUNK and results["A"].reused_tokens == 3 * CHUNK
    assert np.array_equal(results["B"].past_kv, kv[:, :, :, : 2 * CHUNK].astype(np.float16))
    assert np.array_equal(results["A"].past_kv, np.concatenate([c for _, c in a], axis=3))
    assert {i.session for i in results["A"].infos} == {"A"}


def test_raw_on_a_float32_engine_assembles_its_own_kv_exactly(memory_store, context):
    """Ingest and the fetcher bound to the same float32 card: the request's KV is the engine's
    float32, bit for bit; a fetcher bound to a float16 card looks under other keys (a miss)."""
    from kvcodec.engines import ModelCard

    ids, kv = context
    cards = {dtype: ModelCard(name="tiny", model_id=MODEL, layers=2, kv_heads=3, head_dim=64, vocab_size=32_000,
                              max_context=4096, kv_dtype=dtype) for dtype in ("float32", "float16")}
    scheme = get_scheme("raw").for_card(cards["float32"])
    enc = ChunkEncoder(scheme, MODEL, auth=AUTH)
    for i, key in enumerate(chunk_keys(ids, MODEL, scheme.identity, CHUNK)[:N_CHUNKS]):
        memory_store.put(key, enc.encode(kv[:, :, :, i * CHUNK:(i + 1) * CHUNK], key, i, i * CHUNK))
    restored = through_steps(Fetcher(memory_store, MODEL, ["raw"], CHUNK, card=cards["float32"]).fetch(ids, "s"))
    assert [info.status for info, _ in restored] == ["ok"] * N_CHUNKS
    done = assemble(restored)
    assert done.past_kv.dtype == np.float32 and done.reused_tokens == N_CHUNKS * CHUNK
    assert np.array_equal(done.past_kv.view(np.uint32), kv.view(np.uint32))
    assert Fetcher(memory_store, MODEL, ["raw"], CHUNK, card=cards["float16"]).plan(ids) is None


@pytest.mark.parametrize("first, other", [(np.float32, np.float16), (np.float16, np.float32)])
def test_assembler_widens_a_mix_of_float16_and_float32_chunks_exactly(first, other):
    """The adaptive fetcher may pick raw (float32) for one chunk and an 8-bit rung (float16) for
    the next: the request is gathered in float32 and every chunk is its restored value, exactly."""
    kv = np.arange(2 * 2 * 1 * 8 * 8, dtype=np.float32).reshape(2, 2, 1, 8, 8) / 8
    assembler = Assembler()
    assert assembler.add(ChunkInfo("s", 0, 3, tokens=8), kv.astype(first)) is None
    assert assembler.add(ChunkInfo("s", 1, 3, tokens=8), kv.astype(other)) is None
    done = assembler.add(ChunkInfo("s", 2, 3, tokens=8), kv.astype(first))
    assert done.past_kv.dtype == np.float32 and done.reused_tokens == 24 and done.reason == ""
    for i, dtype in enumerate((first, other, first)):
        assert np.array_equal(done.past_kv[:, :, :, 8 * i:8 * (i + 1)], kv.astype(dtype).astype(np.float32))


def test_assembler_takes_the_dtype_of_the_first_good_chunk_not_of_a_failed_one():
    """A failed chunk arrives first with kv_restore's empty float16 KV: it sets no dtype."""
    kv32 = np.ones((2, 2, 1, 8, 8), np.float32)
    assembler = Assembler()
    failed = ChunkInfo("s", 1, 2, tokens=8).fail("corrupt", "bad")
    assert assembler.add(failed, np.zeros((0, 2, 0, 0, 0), np.float16)) is None
    done = assembler.add(ChunkInfo("s", 0, 2, tokens=8), kv32)
    assert done.past_kv.dtype == np.float32 and np.array_equal(done.past_kv, kv32)
    assert done.reused_tokens == 8 and "chunk 1: corrupt" in done.reason


class PastRecorder:
    """An engine that records the past KV it is handed (the contract's ``geometry``, ``detokenizer``, ``stream``)."""

    name, sampling_fields = "recorder", frozenset()

    def __init__(self):
        self.past = "not called"

    def geometry(self, tokens):
        return Geometry(layers=2, kv_heads=1, head_dim=8, tokens=tokens)

    def detokenizer(self):
        return types.SimpleNamespace(push=lambda token: "", flush=lambda: "")

    def stream(self, ids, max_tokens, past_kv=None, **kwargs):
        self.past = past_kv
        yield 1


@pytest.mark.parametrize("dtype, used", [(np.float32, True), (np.float16, True), (np.float64, False)])
def test_generate_hands_float16_or_float32_kv_to_the_engine_as_it_is(dtype, used):
    from kvcodec.serving.generate import generate

    past = np.ones((2, 2, 1, 8, 8), dtype)
    info = ChunkInfo("s", 0, 1, tokens=8)
    engine = PastRecorder()
    events = list(generate(engine, list(range(10)), 1, Assembled(past, [info], 8)))
    assert events[-1].final
    if used:
        assert engine.past is past and events[-1].stats.reused_tokens == 8
    else:
        assert engine.past is None and "float64" in events[-1].stats.miss_reason


def test_assembler_drops_sessions_older_than_ttl():
    kv = np.zeros((1, 2, 1, 8, 8), np.float16)
    assembler = Assembler(ttl_s=0.0)
    assert assembler.add(ChunkInfo("old", 0, 2, tokens=8), kv) is None
    assert len(assembler) == 1
    assert assembler.add(ChunkInfo("new", 0, 2, tokens=8), kv) is None
    assert len(assembler) == 1  # "old" expired when "new" arrived
    # the rest of "old" starts over: one chunk of two is not complete
    assert assembler.add(ChunkInfo("old", 1, 2, tokens=8), kv) is None


def test_assembler_keeps_sessions_within_ttl(monkeypatch):
    from kvcodec.serving import assemble as assembler_module

    now = [100.0]
    monkeypatch.setattr(assembler_module.time, "monotonic", lambda: now[0])
    kv = np.zeros((1, 2, 1, 8, 8), np.float16)
    assembler = Assembler(ttl_s=10.0)
    assert assembler.add(ChunkInfo("a", 0, 3, tokens=8), kv) is None  # started at 100
    now[0] = 105.0
    assert assembler.add(ChunkInfo("a", 1, 3, tokens=8), kv) is None  # 105: kept
    assert len(assembler) == 1
    now[0] = 111.0
    assert assembler.add(ChunkInfo("b", 0, 2, tokens=8), kv) is None  # 111: "a" is 11 s old
    assert len(assembler) == 1
    assert list(assembler._pending) == ["b"]


# -- the fetch deadline -------------------------------------------------------------------------

class HungStore(ScriptedStore):
    """A store whose calls for chosen keys (or every look-up) block until released: a hung server."""

    def __init__(self, data, hang_get=(), hang_exists=False):
        super().__init__(data)
        self.hang_get, self.hang_exists = set(hang_get), hang_exists
        self.release = threading.Event()

    def exists(self, key):
        if self.hang_exists:
            self.release.wait(30)
        return super().exists(key)

    def get(self, key):
        if key in self.hang_get:
            self.release.wait(30)
        return super().get(key)


def test_a_hung_chunk_read_ends_reuse_at_the_deadline(context, encoded):
    ids, _ = context
    data = dict(encoded["int8-zstd"])
    keys = [k for k, _ in encoded["int8-zstd"]]
    store = HungStore(data, hang_get=[keys[1]])
    f = Fetcher(store, MODEL, ["int8-zstd"], CHUNK, timeout_s=0.5)
    t0 = time.monotonic()
    fetched = list(f.fetch(ids, "s"))
    took = time.monotonic() - t0
    store.release.set()
    f.close()
    assert [i.status for i, _ in fetched] == ["ok", "timeout", "miss"]
    assert "within the fetch deadline of 0.5s" in fetched[1][0].reason
    assert 0.4 < took < 2.0, took  # the request waits for the deadline, not for the hung call
    assert assemble(through_steps(fetched)).reused_tokens == CHUNK


def test_a_hung_lookup_is_a_timed_out_prefill(context, encoded):
    ids, _ = context
    store = HungStore(dict(encoded["int8-zstd"]), hang_exists=True)
    f = Fetcher(store, MODEL, ["int8-zstd"], CHUNK, timeout_s=0.3)
    t0 = time.monotonic()
    (info, data), = list(f.fetch(ids, "s"))
    took = time.monotonic() - t0
    store.release.set()
    f.close()
    assert info.count == 0 and data == b"" and "store lookup timed out" in info.reason
    assert took < 1.5, took
