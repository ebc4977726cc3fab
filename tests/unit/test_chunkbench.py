"""perf/kvcodec_tools/chunkbench.py's measurement core on synthetic KV (no model): every stage is timed, and the KV that
crosses the emulated Triton wire (kv_decode's tensors -> kv_restore -> llm's gather) is the KV the library
restores directly from the chunk."""
import numpy as np
import pytest

from kvcodec.encode import ChunkEncoder
from kvcodec.format.codecs import get_scheme
from kvcodec.format.keys import chunk_keys
from kvcodec.serving.chunkinfo import ChunkInfo
from kvcodec.serving.decode import ChunkDecoder
from kvcodec.serving.restore import restore
from kvcodec_tools.chunkbench import ServingPath, measure_chunks, table

from .conftest import AUTH

MODEL_ID = "unit-model@0"
TOKENS = 256
CHUNKS = 2


CASES = [("int8-zstd", None), ("raw", "float16"), ("raw", "float32")]  # (rung, the engine's KV dtype)


def encoded(rung: str, make_kv, kv_dtype=None):
    """(blobs, keys) of ``CHUNKS`` synthetic chunks at ``rung``."""
    scheme = get_scheme(rung, kv_dtype=kv_dtype)
    ids = list(range(TOKENS * CHUNKS))
    keys = chunk_keys(ids, MODEL_ID, scheme.identity, TOKENS)
    encoder = ChunkEncoder(scheme, MODEL_ID, auth=AUTH)
    return [encoder.encode(make_kv(seed=i), keys[i], i, i * TOKENS) for i in range(CHUNKS)], keys


def direct(blobs, keys) -> list:
    """Each chunk's KV restored by the library alone, no wire."""
    decoder = ChunkDecoder(MODEL_ID, auth=AUTH)
    try:
        return [restore(decoder.decode(blob, key)) for blob, key in zip(blobs, keys, strict=True)]
    finally:
        decoder.close()


@pytest.mark.parametrize("rung, kv_dtype", CASES)
def test_measurement_times_every_stage_and_assembles_the_direct_kv(rung, kv_dtype, make_kv):
    blobs, keys = encoded(rung, make_kv, kv_dtype)
    m = measure_chunks(blobs, MODEL_ID, keys, TOKENS, AUTH, repeats=2)
    for stage in ("decode", "restore", "assemble", "kv_tensor", "inner_decode", "inner_restore"):
        assert m.figures[f"{stage}_ms"] > 0, stage
    assert m.figures["total_ms"] == pytest.approx(
        m.figures["decode_ms"] + m.figures["restore_ms"] + m.figures["assemble_ms"])
    assert m.figures["inner_decode_ms"] <= m.figures["decode_ms"]
    assert m.figures["inner_restore_ms"] <= m.figures["restore_ms"]
    assert len(m.assemble_ms_by_chunk) == CHUNKS and min(m.assemble_ms_by_chunk) > 0
    assert m.past_kv.dtype == (np.float32 if kv_dtype == "float32" else np.float16)
    assert np.array_equal(m.past_kv, np.concatenate(direct(blobs, keys), axis=3))


@pytest.mark.parametrize("rung, kv_dtype", CASES)
def test_wire_carries_each_chunk_exactly(rung, kv_dtype, make_kv):
    """kv_restore's two KV outputs: the KV in the one of its dtype (``kv32`` for float32), the other empty."""
    blobs, keys = encoded(rung, make_kv, kv_dtype)
    wide = kv_dtype == "float32"
    with ServingPath(MODEL_ID, AUTH) as path:
        for i, (blob, want) in enumerate(zip(blobs, direct(blobs, keys), strict=True)):
            info = ChunkInfo("s", i, CHUNKS, token_start=i * TOKENS, tokens=TOKENS, key=keys[i])
            wire = path.decode(info, blob)
            assert wire.chunk_header.dtype == object and isinstance(wire.chunk_header[0], bytes)
            out = path.kv_tensor(path.restore(info, wire))
            assert info.ok, info.reason
            assert out.kv.dtype == np.float16 and out.kv32.dtype == np.float32
            kv, empty = (out.kv32, out.kv) if wide else (out.kv, out.kv32)
            assert empty.shape == (0, 2, 0, 0, 0)
            assert kv.flags.c_contiguous and kv.dtype == want.dtype and np.array_equal(kv, want)


def test_measurement_stops_on_a_failed_chunk(make_kv):
    blobs, keys = encoded("raw", make_kv)
    with pytest.raises(RuntimeError, match="decode failed on chunk 0: foreign"):
        measure_chunks(blobs, "another-model@1", keys, TOKENS, AUTH, repeats=2)


def test_table_shows_before_and_after():
    row = {"decode_ms": 2.0, "restore_ms": 1.0, "assemble_ms": 0.5, "total_ms": 3.5, "mb_s": 100.0}
    old = dict(row, decode_ms=4.0, total_ms=5.5, mb_s=64.0)
    text = table({"rungs": {"raw": row}, "before": {"raw": old}, "ratio_total_before_over_after": {"raw": 1.57}})
    assert "4.00 -> 2.00" in text and "64 -> 100" in text and "1.57x" in text
