"""Bitstream codecs (kvcodec.bitstream): identity, zstd and HEVC through x265 and PyAV."""
from __future__ import annotations

import av
import numpy as np
import pytest

from kvcodec.bitstream import CODERS
from kvcodec.bitstream.hevc import DECODERS, Hevc, PyAVDecoder, make_decoder
from kvcodec.encode import ChunkEncoder
from kvcodec.errors import CorruptChunk, Unsupported
from kvcodec.format import container
from kvcodec.format.codecs import get_scheme
from kvcodec.format.geometry import Geometry
from kvcodec.layout import get_layout
from kvcodec.serving.decode import ChunkDecoder

from .conftest import AUTH


@pytest.fixture(scope="module")
def q8(make_kv):
    """q8 planes of a 4-layer chunk: 8 frames of 192x256, plus what restores them."""
    kv = make_kv(3)
    planes, side = get_layout("q8").to_planes(kv)
    return kv, planes, side


@pytest.fixture(scope="module")
def lossless_stream(q8):
    codec = Hevc(lossless=True)
    return codec.encode(q8[1])


def _decode_all(data: bytes):
    ctx = av.CodecContext.create("hevc", "r")
    frames = []
    for packet in ctx.parse(data) + ctx.parse(None):
        frames.extend(ctx.decode(packet))
    frames.extend(ctx.decode(None))
    return ctx, frames


def test_registry_names_the_codecs():
    assert CODERS.names() == ["ans", "hevc", "identity", "zstd"]
    assert DECODERS.names() == ["nvdec", "pyav", "pyav-process"]
    with pytest.raises(Unsupported, match="ans, hevc, identity, zstd"):
        CODERS.get("av1")


@pytest.mark.parametrize("name", ["identity", "zstd"])
def test_byte_codecs_are_exact(name, q8):
    planes = q8[1]
    codec = CODERS.get(name)()
    data = codec.encode(planes)
    assert isinstance(data, bytes)
    out = codec.decode(data, planes.shape)
    assert out.dtype == np.uint8 and np.array_equal(out, planes)
    if name == "zstd":
        assert len(data) < planes.nbytes
    codec.close()


@pytest.mark.parametrize("name", ["identity", "zstd"])
def test_byte_codecs_reject_a_wrong_size(name, q8):
    planes = q8[1]
    codec = CODERS.get(name)()
    data = codec.encode(planes)
    f, h, w = planes.shape
    with pytest.raises(CorruptChunk, match="expected"):
        codec.decode(data, (f - 1, h, w))
    with pytest.raises(CorruptChunk):
        codec.decode(data[:-1], planes.shape)


def test_zstd_garbage_raises_corrupt():
    with pytest.raises(CorruptChunk, match="zstd"):
        CODERS.get("zstd")().decode(b"definitely not zstd" * 4, (1, 8, 8))


def test_zstd_level_is_a_recorded_parameter():
    assert CODERS.get("zstd")(level=7).params == {"level": 7}
    assert CODERS.get("zstd")().params == {"level": 3}


def test_hevc_params_hold_only_what_shapes_the_bitstream():
    codec = Hevc(lossless=False, qp=12, decoder="auto", threads=2)
    assert codec.params == {"lossless": False, "qp": 12, "preset": "ultrafast"}
    assert "qp=12" in codec.x265_params() and "lossless" not in codec.x265_params()
    assert "lossless=1" in Hevc(lossless=True).x265_params()


def test_lossless8_hevc_round_trip_is_bit_exact(q8, lossless_stream):
    kv, planes, side = q8
    out = Hevc(lossless=True).decode(lossless_stream, planes.shape)
    assert out.shape == planes.shape and out.dtype == np.uint8
    diff = np.argwhere(out != planes)
    assert diff.size == 0, f"{len(diff)} q8 values changed through HEVC lossless, first at {diff[:3].tolist()}"
    # and so the restored KV equals the layout's own round trip exactly
    g = Geometry.of(kv)
    layout = get_layout("q8")
    assert np.array_equal(layout.from_planes(out, side, g), layout.from_planes(planes, side, g))


def test_hevc_stream_is_8bit_420_with_one_frame_per_plane(q8, lossless_stream):
    planes = q8[1]
    ctx, frames = _decode_all(lossless_stream)
    assert len(frames) == planes.shape[0]
    for f in frames:
        assert f.format.name == "yuv420p", f"frame format {f.format.name}"
        assert (f.width, f.height) == (planes.shape[2], planes.shape[1])
        yuv = f.to_ndarray()  # [height * 3 / 2, width]: luma rows, then the two chroma planes
        assert (yuv[planes.shape[1]:] == 128).all()


def test_hevc_stream_is_main_profile(lossless_stream):
    ctx, frames = _decode_all(lossless_stream)
    assert frames and frames[0].format.name == "yuv420p"
    assert ctx.profile == "Main", f"PyAV reports HEVC profile {ctx.profile!r}, expected 'Main'"


def test_lossy_video_decodes_to_the_right_shape_with_bounded_error(q8):
    kv, planes, side = q8
    codec = Hevc(lossless=False, qp=8)
    data = codec.encode(planes)
    out = codec.decode(data, planes.shape)
    assert out.shape == planes.shape and out.dtype == np.uint8
    err = np.abs(out.astype(np.int16) - planes.astype(np.int16))
    assert err.mean() < 2.0, f"mean error {err.mean():.2f} q8 levels at qp 8"
    assert err.max() <= 32, f"max error {err.max()} q8 levels at qp 8"
    assert (err > 0).any(), "qp 8 is lossy: some value should change"
    coarse = Hevc(lossless=False, qp=30).encode(planes)
    assert len(coarse) < len(data), f"qp 30 gave {len(coarse)} bytes, qp 8 gave {len(data)}"


def test_hevc_rejects_plane_sizes_that_are_not_multiples_of_8():
    with pytest.raises(ValueError, match="multiples of 8"):
        Hevc().encode(np.zeros((1, 12, 16), dtype=np.uint8))


@pytest.mark.parametrize("cut", [0.1, 0.5])
def test_truncated_hevc_stream_raises_corrupt(cut, q8, lossless_stream):
    """A stream cut short by whole frames: the frame count check catches it."""
    planes = q8[1]
    data = lossless_stream[: int(len(lossless_stream) * cut)]
    with pytest.raises(CorruptChunk):
        out = Hevc().decode(data, planes.shape)
        pytest.fail(f"truncated stream decoded silently (equal: {np.array_equal(out, planes)})")


@pytest.mark.parametrize("data", [b"", b"\x00" * 100, b"\x00\x00\x00\x01" + b"\xff" * 64])
def test_not_hevc_raises_corrupt(data):
    with pytest.raises(CorruptChunk):
        Hevc().decode(data, (8, 256, 192))


def test_wrong_frame_size_raises_corrupt(q8, lossless_stream):
    f, h, w = q8[1].shape
    with pytest.raises(CorruptChunk, match="decoded frame"):
        Hevc().decode(lossless_stream, (f, h, w + 8))
    with pytest.raises(CorruptChunk, match="frames"):
        Hevc().decode(lossless_stream, (f + 1, h, w))


def _rewrap(data: bytes, payload: bytes) -> bytes:
    """The same chunk with another payload, its section digests recomputed (as a store would
    serve a bitstream damaged before it was wrapped)."""
    chunk = container.parse(data, AUTH)
    chunk.sections["payload"] = payload
    return chunk.to_bytes(AUTH)


@pytest.mark.parametrize("damage", ["garble", "cut-0.9", "cut-0.99"])
def test_damaged_bitstream_that_still_decodes_is_caught_by_the_planes_digest(damage, kv):
    scheme = get_scheme("lossless8")
    data = ChunkEncoder(scheme, "model-x", auth=AUTH).encode(kv, "k0", 0, 0)
    payload = bytearray(container.parse(data, AUTH).sections["payload"])
    if damage == "garble":
        for i in range(200, len(payload), 50):
            payload[i] ^= 0xFF
    else:
        payload = payload[: int(len(payload) * float(damage.split("-")[1]))]
    with pytest.raises(CorruptChunk):
        ChunkDecoder("model-x", auth=AUTH).decode(_rewrap(data, bytes(payload)), key="k0")


def test_make_decoder_names():
    assert isinstance(make_decoder("pyav"), PyAVDecoder)
    # "auto" falls back to software here when NVDEC cannot be opened
    assert make_decoder("auto").name in ("pyav", "nvdec")
    with pytest.raises(Unsupported) as err:
        make_decoder("vaapi")
    assert "nvdec" in str(err.value) and "pyav" in str(err.value)  # the names it knows, in any order


def test_hevc_decoder_is_made_once_and_released_by_close(q8, lossless_stream):
    codec = Hevc(decoder="pyav")
    first = codec.decoder
    codec.decode(lossless_stream, q8[1].shape)
    assert codec.decoder is first
    codec.close()
    assert codec._decoder is None


@pytest.fixture(scope="module")
def planes10():
    """10-bit planes with structure along both axes (smooth rows and columns plus noise)."""
    rng = np.random.default_rng(4)
    rows, cols = np.meshgrid(np.arange(64), np.arange(128), indexing="ij")
    base = 512 + 300 * np.sin(rows / 9.0)[None] * np.cos(cols / 17.0)[None]
    return np.clip(base + rng.normal(0, 20, (3, 64, 128)), 0, 1023).astype(np.uint16)


def test_10bit_hevc_is_main10_and_lossless_mode_is_bit_exact(planes10):
    codec = Hevc(lossless=True, bit_depth=10)
    assert codec.params == {"lossless": True, "qp": 0, "preset": "ultrafast", "bit_depth": 10}
    data = codec.encode(planes10)
    out = codec.decode(data, planes10.shape)
    assert out.dtype == np.uint16 and np.array_equal(out, planes10)
    ctx, frames = _decode_all(data)
    assert len(frames) == 3 and frames[0].format.name == "yuv420p10le"
    assert ctx.profile == "Main 10", f"PyAV reports HEVC profile {ctx.profile!r}, expected 'Main 10'"
    assert (frames[0].to_ndarray()[64:] == 512).all()  # chroma held at mid-grey


def test_10bit_lossy_hevc_error_grows_with_qp_and_bytes_shrink(planes10):
    sizes, errors = {}, {}
    for qp in (4, 16):
        codec = Hevc(lossless=False, qp=qp, bit_depth=10, preset="medium", tune="mse")
        data = codec.encode(planes10)
        out = codec.decode(data, planes10.shape)
        sizes[qp] = len(data)
        errors[qp] = np.abs(out.astype(np.int32) - planes10).mean()
    assert errors[4] < errors[16] and sizes[4] > sizes[16]
    assert errors[4] < 4, f"mean error {errors[4]:.2f} of 1024 levels at qp 4"


def test_hevc_tune_mse_turns_psycho_visual_tuning_off():
    plain, mse = Hevc(lossless=False, qp=7), Hevc(lossless=False, qp=7, tune="mse")
    assert "tune" not in plain.params and mse.params["tune"] == "mse"
    assert "psy-rd=0" in mse.x265_params() and "psy-rd" not in plain.x265_params()


def test_hevc_sample_type_must_match_the_bit_depth(planes10):
    with pytest.raises(ValueError, match="uint16"):
        Hevc(bit_depth=10).encode(planes10.astype(np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        Hevc().encode(planes10)
    with pytest.raises(ValueError, match="bit_depth"):
        Hevc(bit_depth=12)


def test_an_8bit_stream_read_as_10bit_is_corrupt(q8, lossless_stream):
    with pytest.raises(CorruptChunk, match="yuv420p10le"):
        Hevc(lossless=True, bit_depth=10).decode(lossless_stream, q8[1].shape)
