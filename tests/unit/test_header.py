"""``format.header.ChunkHeader``: every field a reader relies on is checked once, before any
allocation; a header that does not fit is a CorruptChunk naming the field."""
from __future__ import annotations

import numpy as np
import pytest

from kvcodec.errors import CorruptChunk
from kvcodec.format.header import ChunkHeader

GOOD = {
    "model_id": "m@1", "key": "aa/bb/cc", "chunk_index": 1, "token_start": 256, "scheme": "int8-zstd",
    "scheme_id": "int8-zstd/v1/q8/zstd{}", "layout": "q8", "layout_version": 1, "layout_params": {},
    "codec": "zstd", "codec_params": {"level": 3},
    "geometry": {"layers": 30, "kv_heads": 3, "head_dim": 64, "tokens": 256},
    "planes_shape": [60, 256, 192], "planes_digest": "00" * 16,
}


def test_a_good_header_round_trips_through_json():
    h = ChunkHeader.from_dict(dict(GOOD, note="kept"))
    assert h.planes_dtype == np.uint8 and h.planes_shape == (60, 256, 192)
    assert h.planes_nbytes == 60 * 256 * 192 and h.extra == {"note": "kept"}
    assert ChunkHeader.from_json(h.to_json()) == h
    wide = ChunkHeader.from_dict(dict(GOOD, planes_dtype="uint16"))
    assert wide.planes_dtype == np.dtype("<u2") and wide.to_dict()["planes_dtype"] == "uint16"


@pytest.mark.parametrize("change, field", [
    ({"planes_shape": [64, 65536, 65536]}, "planes shape"),  # 256 GiB of planes: refused, not allocated
    ({"planes_shape": [1 << 20, 256, 192]}, "larger than geometry"),
    ({"planes_shape": [60, 256]}, "planes shape"),
    ({"planes_shape": [60, -256, 192]}, "planes shape"),
    ({"planes_dtype": "float64"}, "planes dtype"),
    ({"geometry": {"layers": 30, "kv_heads": 3, "head_dim": 64}}, "geometry"),
    ({"geometry": {"layers": 1 << 30, "kv_heads": 3, "head_dim": 64, "tokens": 256}}, "geometry"),
    ({"geometry": {"layers": 30, "kv_heads": 3, "head_dim": 64, "tokens": 0}}, "geometry"),
    ({"geometry": "30x3x64"}, "geometry"),
    ({"token_start": -1}, "token_start"),
    ({"token_start": "0"}, "token_start"),
    ({"chunk_index": True}, "chunk_index"),
    ({"layout_version": None}, "layout_version"),
    ({"layout_params": [1]}, "layout_params"),
    ({"codec_params": "level=3"}, "codec_params"),
    ({"model_id": 7}, "model_id"),
    ({"planes_digest": None}, "planes_digest"),
])
def test_a_header_that_does_not_fit_is_corrupt(change, field):
    with pytest.raises(CorruptChunk, match=field):
        ChunkHeader.from_dict(dict(GOOD, **change))


@pytest.mark.parametrize("text", [b"", b"{", b"[]", b"null", b"\xff\xfe"])
def test_unreadable_header_text_is_corrupt(text):
    with pytest.raises(CorruptChunk):
        ChunkHeader.from_json(text)
