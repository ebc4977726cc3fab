"""KV <-> planes layouts (kvcodec.layout): q8 per-channel quantization and ``native`` (raw: the
engine's own float16 or float32 bytes)."""
from __future__ import annotations

import numpy as np
import pytest

from kvcodec.errors import BadRequest, CorruptChunk, ForeignChunk, Unsupported
from kvcodec.format.geometry import Geometry
from kvcodec.layout import LAYOUTS, get_layout

FP16_EPS = float(np.finfo(np.float16).eps)  # 2**-10
# the layouts whose planes are checked alike: case -> (layout, its parameters)
PARAMS = {"q8": ("q8", {}), "native16": ("native", {"dtype": "float16"}), "native32": ("native", {"dtype": "float32"})}


def _layout(case: str):
    name, params = PARAMS[case]
    return get_layout(name, **params)


def _steps(side, g: Geometry):
    shape = (g.layers, 2, g.kv_heads, 1, g.head_dim)
    lo = np.frombuffer(side["q8_min"], dtype=np.float16).reshape(shape).astype(np.float32)
    step = np.frombuffer(side["q8_step"], dtype=np.float16).reshape(shape).astype(np.float32)
    return lo, step


def test_registry_lists_every_layout():
    assert LAYOUTS.names() == ["cg", "kvtc", "native", "pca", "pca10", "q8", "qn"]
    with pytest.raises(Unsupported, match="cg, kvtc, native, pca, pca10, q8, qn"):
        get_layout("q4")


def test_q8_planes_have_one_frame_per_layer_and_kv(kv):
    layout = get_layout("q8")
    g = Geometry.of(kv)
    planes, side = layout.to_planes(kv)
    assert planes.dtype == np.uint8 and planes.flags["C_CONTIGUOUS"]
    assert planes.shape == (g.layers * 2, g.tokens, g.kv_heads * g.head_dim) == layout.planes_shape(g)
    assert set(side) == {"q8_min", "q8_step"}
    assert len(side["q8_min"]) == len(side["q8_step"]) == g.layers * 2 * g.kv_heads * g.head_dim * 2
    # the full 8-bit range is used on each channel that varies
    per_channel = planes.reshape(g.layers, 2, g.tokens, g.kv_heads, g.head_dim)
    assert (per_channel.min(axis=2) == 0).all()
    assert (per_channel.max(axis=2) >= 254).all()


def test_q8_round_trip_error_is_at_most_half_a_step_per_channel(kv):
    layout = get_layout("q8")
    g = Geometry.of(kv)
    planes, side = layout.to_planes(kv)
    out = layout.from_planes(planes, side, g)
    assert out.dtype == np.float16 and out.shape == kv.shape
    lo, step = _steps(side, g)
    err = np.abs(out.astype(np.float32) - kv)
    # half a step, plus the float16 rounding of the result and of the stored minimum
    tol = step / 2 + FP16_EPS * np.maximum(np.abs(kv), np.abs(lo)) + 1e-7
    worst = float((err / tol).max())
    assert worst <= 1.0, f"q8 error exceeds step/2 on some channel (worst ratio {worst:.3f})"
    # and it is a real 8-bit quantizer, not a fluke of the tolerance
    assert float((err.max(axis=3) / step[..., 0, :]).max()) > 0.3


def test_q8_constant_channels_restore_exactly(make_kv):
    kv = make_kv(1, layers=1, kv_heads=2, tokens=64, head_dim=16)
    constants = [0.0, 1.0, -3.5, 0.1234, -17.03, 250.0]
    for j, value in enumerate(constants):
        kv[0, j % 2, j % 2, :, j] = value
    layout = get_layout("q8")
    planes, side = layout.to_planes(kv)
    out = layout.from_planes(planes, side, Geometry.of(kv))
    for j, value in enumerate(constants):
        got = out[0, j % 2, j % 2, :, j]
        assert (got == np.float16(value)).all(), f"constant {value} restored as {np.unique(got)}"
    # an all-constant chunk too
    flat = np.full((1, 2, 1, 8, 8), 2.25, dtype=np.float32)
    planes, side = layout.to_planes(flat)
    assert (layout.from_planes(planes, side, Geometry.of(flat)) == np.float16(2.25)).all()


def test_q8_restore_is_exact_for_given_planes(kv):
    """from_planes is a pure function of planes + side data: q*step + lo, rounded once."""
    layout = get_layout("q8")
    g = Geometry.of(kv)
    planes, side = layout.to_planes(kv)
    lo, step = _steps(side, g)
    q = planes.reshape(g.layers, 2, g.tokens, g.kv_heads, g.head_dim).transpose(0, 1, 3, 2, 4)
    want = (q.astype(np.float32) * step + lo).astype(np.float16)
    assert np.array_equal(layout.from_planes(planes.copy(), side, g), want)


@pytest.mark.parametrize("dtype, bits", [("float16", np.uint16), ("float32", np.uint32)])
def test_native_layout_restores_its_dtype_exactly(dtype, bits, kv):
    layout = get_layout("native", dtype=dtype)
    g = Geometry.of(kv)
    planes, side = layout.to_planes(kv)
    assert side == {}
    size = np.dtype(dtype).itemsize
    assert planes.dtype == np.uint8 and planes.shape == layout.planes_shape(g) == (8, 256, 3 * 64 * size)
    out = layout.from_planes(planes, side, g)
    assert out.dtype == np.dtype(dtype) and out.shape == kv.shape
    assert np.array_equal(out.view(bits), kv.astype(dtype).view(bits))


def test_native_planes_are_little_endian_values_side_by_side(kv):
    planes, _ = get_layout("native", dtype="float32").to_planes(kv)
    first = planes[0, 0, :8].tobytes()  # layer 0, K, token 0, head 0: channels 0 and 1
    assert first == kv[0, 0, 0, 0, :2].astype("<f4").tobytes()


@pytest.mark.parametrize("dtype, bits", [("float16", np.uint16), ("float32", np.uint32)])
def test_native_layout_keeps_special_values(dtype, bits):
    kv = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 6e-8, np.nan, 1.0], dtype=dtype)
    kv = np.resize(kv, (1, 2, 1, 8, 8))
    layout = get_layout("native", dtype=dtype)
    out = layout.from_planes(*layout.to_planes(kv), Geometry.of(kv))
    assert np.array_equal(out.view(bits), kv.view(bits))


@pytest.mark.parametrize("dtype", ["bfloat16", "float64", "<f4", None])
def test_native_layout_refuses_a_dtype_it_does_not_read(dtype):
    with pytest.raises(ForeignChunk, match="dtype"):
        get_layout("native", dtype=dtype)


def test_native_planes_of_the_other_dtype_do_not_fit(kv):
    """float16 planes read as float32 (or back) are the wrong width: corrupt, never reinterpreted."""
    g = Geometry.of(kv)
    planes16, side = get_layout("native", dtype="float16").to_planes(kv)
    planes32, _ = get_layout("native", dtype="float32").to_planes(kv)
    with pytest.raises(CorruptChunk, match="float32 planes"):
        get_layout("native", dtype="float32").from_planes(planes16, side, g)
    with pytest.raises(CorruptChunk, match="float16 planes"):
        get_layout("native", dtype="float16").from_planes(planes32, side, g)


@pytest.mark.parametrize("name", list(PARAMS))
def test_from_planes_rejects_wrong_shape_or_dtype(name, kv):
    layout = _layout(name)
    g = Geometry.of(kv)
    planes, side = layout.to_planes(kv)
    with pytest.raises(CorruptChunk, match="planes"):
        layout.from_planes(planes[:-1], side, g)
    with pytest.raises(CorruptChunk, match="planes"):
        layout.from_planes(planes.reshape(-1), side, g)
    with pytest.raises(CorruptChunk, match="planes"):
        layout.from_planes(planes.astype(np.int16), side, g)
    other = Geometry(g.layers, g.kv_heads, g.head_dim, g.tokens - 8)
    with pytest.raises(CorruptChunk, match="planes"):
        layout.from_planes(planes, side, other)


@pytest.mark.parametrize("drop", ["q8_min", "q8_step"])
def test_q8_missing_side_data_raises_corrupt(drop, kv):
    layout = get_layout("q8")
    planes, side = layout.to_planes(kv)
    side = {k: v for k, v in side.items() if k != drop}
    with pytest.raises(CorruptChunk, match="side data"):
        layout.from_planes(planes, side, Geometry.of(kv))


def test_q8_short_side_data_raises_corrupt(kv):
    layout = get_layout("q8")
    planes, side = layout.to_planes(kv)
    side["q8_step"] = side["q8_step"][:-2]
    with pytest.raises(CorruptChunk, match="side data"):
        layout.from_planes(planes, side, Geometry.of(kv))


@pytest.mark.parametrize("shape", [(4, 3, 256, 64), (4, 3, 2, 256, 64), (4, 1, 3, 256, 64, 1)])
@pytest.mark.parametrize("name", list(PARAMS))
def test_to_planes_rejects_a_non_kv_shape(name, shape):
    with pytest.raises(BadRequest, match="KV must be"):
        _layout(name).to_planes(np.zeros(shape, dtype=np.float32))
