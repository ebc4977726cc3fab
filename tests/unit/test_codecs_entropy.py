"""nlevel-zstd and cachegen (qn / cg layouts, ans codec): round trips, exact restore, refusals."""
from __future__ import annotations

import numpy as np
import pytest

from kvcodec.bitstream import CODERS
from kvcodec.encode import PAYLOAD, ChunkEncoder
from kvcodec.errors import CorruptChunk
from kvcodec.format import container
from kvcodec.format.codecs import get_scheme
from kvcodec.format.geometry import Geometry
from kvcodec.layout import get_layout
from kvcodec.serving.decode import ChunkDecoder
from kvcodec.serving.restore import restore

from .conftest import AUTH


def _roundtrip(scheme, kv):
    blob = ChunkEncoder(scheme, "m", auth=AUTH).encode(kv, "k", 0, 0)
    d = ChunkDecoder("m", auth=AUTH).decode(blob, key="k")
    return blob, d, restore(d)


@pytest.mark.parametrize("levels", [16, 64])
def test_nlevel_restores_its_integers_exactly(kv, levels):
    layout = get_layout("qn", levels=levels)
    g = Geometry.of(kv)
    planes, side = layout.to_planes(kv)
    assert planes.max() == levels - 1 and planes.min() == 0
    out = layout.from_planes(planes, side, g).astype(np.float32)
    q = planes.reshape(g.layers, 2, g.tokens, g.kv_heads, g.head_dim).transpose(0, 1, 3, 2, 4)
    lo = np.frombuffer(side["qn_min"], np.float16).reshape(g.layers, 2, g.kv_heads, 1, g.head_dim)
    step = np.frombuffer(side["qn_step"], np.float16).reshape(lo.shape)
    assert np.array_equal(out, (q * step.astype(np.float32) + lo.astype(np.float32)).astype(np.float16))
    assert np.abs(out - kv).max() <= step.astype(np.float32).max() * 0.51 + 1e-2


def test_nlevel_quality_is_levels_and_bound_into_identity(kv):
    a, b = get_scheme("nlevel-zstd", 16), get_scheme("nlevel-zstd", 64)
    assert a.identity != b.identity and '"levels":16' in a.identity
    small, _, ra = _roundtrip(a, kv)
    big, _, rb = _roundtrip(b, kv)
    assert len(small) < len(big)
    assert np.abs(rb - kv).mean() < np.abs(ra - kv).mean()


def test_cachegen_levels_per_layer_follow_lmcache():
    c = get_layout("cg", bins=32).half_range(30)
    assert (c[:10, 0] == 15).all() and (c[10:, 0] == 7).all()
    assert (c[:2, 1] == 15).all() and (c[2:, 1] == 7).all()


def test_cachegen_round_trip_is_exact_for_its_symbols(kv):
    blob, d, out = _roundtrip(get_scheme("cachegen"), kv)
    planes, side = get_layout("cg", bins=32).to_planes(kv)
    assert np.array_equal(d.planes, planes)
    assert np.array_equal(out, get_layout("cg", bins=32).from_planes(planes, side, Geometry.of(kv)))
    assert len(blob) < kv.size * 2 / 3
    rel = np.sqrt(np.mean((out.astype(np.float32) - kv) ** 2) / np.mean(kv ** 2))
    assert rel < 0.2


def test_ans_codec_is_lossless_on_any_planes():
    rng = np.random.default_rng(1)
    planes = rng.integers(0, 9, (3, 64, 16)).astype(np.uint8)
    planes[1, :, 3] = 4  # a column with one symbol
    codec = CODERS.get("ans")()
    assert np.array_equal(codec.decode(codec.encode(planes), planes.shape), planes)


def _rewrap(blob: bytes, payload: bytes) -> bytes:
    c = container.parse(blob, AUTH)
    c.sections[PAYLOAD] = payload
    return container.Container(c.header, c.sections).to_bytes(AUTH)


def test_cachegen_refuses_corrupt_distribution_tables(kv):
    blob = ChunkEncoder(get_scheme("cachegen"), "m", auth=AUTH).encode(kv, "k", 0, 0)
    payload = bytearray(container.parse(blob, AUTH).sections[PAYLOAD])
    bad_header = bytes(payload[:4]) + (7).to_bytes(4, "little") + bytes(payload[8:])
    bad_table = bytes(payload[:20]) + bytes([payload[20] ^ 0xFF]) + bytes(payload[21:])
    bad_words = bytes(payload[:-8]) + bytes(8)
    for bad in (bad_header, bad_table, bad_words, bytes(payload[:-4])):
        with pytest.raises(CorruptChunk):
            ChunkDecoder("m", auth=AUTH).decode(_rewrap(blob, bad), key="k")


@pytest.mark.parametrize("name", ["nlevel-zstd", "cachegen"])
def test_corrupt_scales_are_refused(kv, name):
    blob, d, _ = _roundtrip(get_scheme(name), kv)
    key = next(iter(d.side))
    d.side[key] = d.side[key][:-2]
    with pytest.raises(CorruptChunk):
        restore(d)
