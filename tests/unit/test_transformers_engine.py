"""The transformers engine calls the model the way the installed transformers wants: no deprecation
warning (``make demo`` once printed transformers' FutureWarning about ``past_key_values``) on any
path that runs the model: prefill by chunks, streaming with and without a restored prefix, and the
teacher-forced log-probabilities of the quality harness."""
from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import numpy as np
import pytest

from kvcodec.engines import StreamReport, open_engine, open_tokenizer
from kvcodec.engines.gguf import ensure_model
from kvcodec.settings import Settings
from tests.kv_close import assert_same_kv
from tests.other_model import write_model

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]


def test_no_deprecation_warning_on_any_path_that_runs_the_model(tmp_path):
    folder = write_model(tmp_path / "tiny-llama", ensure_model(REPO / ".cache" / "models").path)
    settings = Settings.load({"model": str(folder), "model_cache": str(tmp_path / "cache"),
                              "home": str(tmp_path / "home"), "threads": "1"}, env={})
    engine = open_engine(settings)
    ids = open_tokenizer(settings).encode("def f(x):\n    return x * 2\n" * 60)[:300]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning or DeprecationWarning fails the test
        kv = next(engine.prefill_chunks(ids, 256))
        prefill = list(engine.stream(ids, 3))
        reuse = list(engine.stream(ids, 3, past_kv=kv))
        logprobs = engine.continuation_logprobs(kv, ids[256:260])
    assert reuse == prefill and logprobs.shape[0] == 4 and np.isfinite(logprobs).all()
    # the argument name the model's forward declares, not the deprecated alias
    assert engine._cache_arg in inspect.signature(engine.model.forward).parameters
    engine.close()


def test_a_miss_writes_its_chunks_back_and_a_reuse_only_those_past_the_restored_kv(tmp_path):
    """The default engine saves after a miss, as every engine does: the prompt's full chunks, its
    own KV (``raw``: stored bit-exact; equal to a chunk-by-chunk prefill up to rounding), stored by the write-back sink; a reuse hands over only the chunks
    past the restored prefix (already stored: counted present, not written twice); ``off`` saves
    nothing."""
    from kvcodec.format.auth import load_auth
    from kvcodec.serving.decode import ChunkDecoder
    from kvcodec.serving.restore import restore

    folder = write_model(tmp_path / "tiny-llama", ensure_model(REPO / ".cache" / "models").path)
    base = {"model": str(folder), "model_cache": str(tmp_path / "cache"), "home": str(tmp_path / "home"),
            "threads": "1", "store": f"memory://{tmp_path.name}", "ladder": "raw", "writeback": "first"}
    settings = Settings.load(base, env={})
    engine = open_engine(settings)
    try:
        ids = open_tokenizer(settings).encode("def f(x):\n    return x * 2\n" * 120)[:600]
        own = list(engine.prefill_chunks(ids, 256))
        report = StreamReport()
        prefill = list(engine.stream(ids, 3, report=report))
        assert report.saved_chunks == 2 and engine.writeback.flush(60)
        assert engine.writeback_stats()["written"] == 2
        saver, auth = engine.writeback.saver, load_auth(settings.key_file)
        for i in range(2):
            (key,) = saver.keys(ids, i)
            stored = restore(ChunkDecoder(engine.model_id, auth=auth).decode(saver.store.get(key), key=key))
            assert_same_kv(stored, own[i], own)  # the engine's own KV (stored bit-exact; prefill shapes round apart)
        report = StreamReport()
        assert list(engine.stream(ids, 3, past_kv=own[0], report=report)) == prefill
        assert report.saved_chunks == 1 and engine.writeback.flush(60)  # chunk 1 only: chunk 0 came in
        assert engine.writeback_stats()["present"] == 1 and engine.writeback_stats()["written"] == 2
    finally:
        engine.close()
    quiet = open_engine(Settings.load(dict(base, writeback="off"), env={}))
    report = StreamReport()
    list(quiet.stream(ids, 1, report=report))
    assert report.saved_chunks is None and quiet.writeback_stats() is None
    quiet.close()
