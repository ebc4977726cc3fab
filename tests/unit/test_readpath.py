"""The ensemble's read path in one process (``serving.readpath``), as a connector that reads the
store itself runs it: chunks a real engine wrote back (a tiny random model, ``raw``: its own KV)
are planned, fetched, verified, decoded and restored into the request's ``LoadSession``, the plan
known before the chunks are in; a prompt with nothing stored reads nothing and says why; a damaged
chunk ends the usable prefix before it."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from kvcodec.compose import open_reads
from kvcodec.engines import open_engine, open_tokenizer
from kvcodec.engines.gguf import ensure_model
from kvcodec.serving.readpath import ReadPath
from kvcodec.settings import Settings
from tests.kv_close import assert_same_kv
from tests.other_model import write_model

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Settings, a prompt, and the engine's own KV of its two full chunks, written back to a memory store."""
    tmp = tmp_path_factory.mktemp("readpath")
    folder = write_model(tmp / "tiny-llama", ensure_model(REPO / ".cache" / "models").path)
    settings = Settings.load({"model": str(folder), "model_cache": str(tmp / "cache"), "home": str(tmp / "home"),
                              "threads": "1", "store": f"memory://{tmp.name}", "ladder": "raw",
                              "writeback": "first", "decoder_process": "0"}, env={})
    engine = open_engine(settings)
    ids = open_tokenizer(settings).encode("def f(x):\n    return x * 2\n" * 120)[:600]
    own = list(engine.prefill_chunks(ids, 256))
    list(engine.stream(ids, 1))
    assert engine.writeback.flush(60) and engine.writeback_stats()["written"] == 2
    card, store = engine.card, engine.writeback.saver.store
    yield settings, card, store, ids, own
    engine.close()


def test_a_stored_prefix_streams_into_the_requests_session(written):
    settings, card, store, ids, own = written
    path = ReadPath(open_reads(settings, card, store=store))
    try:
        reading = path.start(ids)
        assert reading.ready.wait(60) and reading.session is not None
        assert reading.session.n_chunks == 2  # the plan, known at the first chunk
        assert reading.done.wait(60) and reading.session.wait_settled(10)
        assert_same_kv(reading.session.past_kv(host=True), np.concatenate(own, axis=3), own)  # prefill shapes differ
        assert reading.stats().reused_tokens == 512
        assert path.counters["reads"] == 1 and path.counters["loaded_chunks"] == 2
    finally:
        path.close()


def test_nothing_stored_reads_nothing_and_says_why(written):
    settings, card, store, ids, _ = written
    path = ReadPath(open_reads(settings, card, store=store))
    try:
        reading = path.start([7] * 600)
        assert reading.ready.wait(60) and reading.done.wait(60)
        assert reading.session is None and reading.reason
    finally:
        path.close()


def test_a_damaged_chunk_ends_the_usable_prefix_before_it(written):
    from kvcodec.format.codecs import get_scheme
    from kvcodec.format.keys import chunk_keys

    settings, card, store, ids, own = written
    key = chunk_keys(ids, card.model_id, get_scheme("raw").for_card(card).identity, 256)[1]
    original = store.get(key)
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    store.put(key, bytes(damaged), overwrite=True)
    path = ReadPath(open_reads(settings, card, store=store))
    try:
        reading = path.start(ids)
        assert reading.done.wait(60) and reading.session.wait_settled(10)
        assert reading.session.staged_tokens == 256  # chunk 0 only: chunk 1 is refused, never used
        assert_same_kv(reading.session.past_kv(host=True), own[0], own)
    finally:
        store.put(key, original, overwrite=True)
        path.close()


def test_reads_at_once_each_get_the_same_exact_chunks(tmp_path):
    """Four reads side by side over one read path (int8-zstd: a stateful decompressor): every
    session complete and identical (shared decoder state once corrupted concurrent decodes)."""
    folder = write_model(tmp_path / "tiny-llama", ensure_model(REPO / ".cache" / "models").path)
    settings = Settings.load({"model": str(folder), "model_cache": str(tmp_path / "cache"),
                              "home": str(tmp_path / "home"), "threads": "1", "store": f"memory://{tmp_path.name}",
                              "ladder": "int8-zstd", "writeback": "int8-zstd", "decoder_process": "0",
                              "adaptive": "0"}, env={})
    engine = open_engine(settings)
    try:
        ids = open_tokenizer(settings).encode("def g(y):\n    return y + 1\n" * 200)[:1100]
        list(engine.stream(ids, 1))
        assert engine.writeback.flush(60) and engine.writeback_stats()["written"] == 4
        path = ReadPath(open_reads(settings, engine.card, store=engine.writeback.saver.store), workers=4)
        inside, most = [0], [0]
        real_run = path.decode.run

        def probed(info, data):  # counts the decodes running at once (the real one inside)
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            time.sleep(0.02)
            try:
                return real_run(info, data)
            finally:
                inside[0] -= 1

        path.decode.run = probed
        try:
            readings = [path.start(ids) for _ in range(4)]
            assert all(r.done.wait(120) for r in readings)
            kvs = [r.session.past_kv(host=True) for r in readings]
            assert all(r.session.staged_tokens == 1024 for r in readings), [r.reason for r in readings]
            for kv in kvs[1:]:
                np.testing.assert_array_equal(kv, kvs[0])
            assert most[0] == 1  # decodes took turns
        finally:
            path.close()
    finally:
        engine.close()
