"""Planes tiled into few large frames (``bitstream.tiling``, ``hevc``'s ``tile``): the arrangement
within NVDEC's limits, exact round trips (numpy and torch), real x265/FFmpeg streams of fewer,
larger frames, and tiled chunks through every decode path (the coder's own decoder, a self-tested
one, a device decoder's tensors)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kvcodec.bitstream.hevc import DECODERS, Hevc, PyAVDecoder
from kvcodec.bitstream.tiling import MAX_SIDE, MIN_SIDE, Tiling
from kvcodec.encode import ChunkEncoder
from kvcodec.format.codecs import SCHEMES
from kvcodec.serving.decode import ChunkDecoder

from .conftest import AUTH, on_tiny_profile, synthetic_kv
from .test_decoder_selftest import HERE as FAKES
from .test_decoder_selftest import KEY, MODEL, DeviceDecoder, _chunk_payload

SMOLLM2_CHUNK = (60, 192, 256)  # 30 layers x K|V, 3 heads x 64 components, 256 tokens


def test_a_smollm2_chunk_is_one_frame_of_3_mpixel_instead_of_60_small_ones():
    t = Tiling.of(SMOLLM2_CHUNK, 4)
    assert t.frame_shape == (1, 1920, 1536) and (t.rows, t.cols) == (10, 6)
    assert Tiling.of(SMOLLM2_CHUNK, 1).frame_shape == (3, 960, 1024)  # at most 1 Mpixel: 3 frames of 20


@pytest.mark.parametrize("shape", [SMOLLM2_CHUNK, (64, 1024, 256), (6, 152, 184), (3, 8, 16), (7, 40, 24),
                                   (128, 4096, 512), (1, 192, 256)])
@pytest.mark.parametrize("mpx", [1, 4, 16])
def test_frames_stay_within_nvdecs_limits_and_hold_every_plane(shape, mpx):
    t = Tiling.of(shape, mpx)
    frames, height, width = t.frame_shape
    assert MIN_SIDE <= height <= MAX_SIDE and MIN_SIDE <= width <= MAX_SIDE
    assert height % 8 == 0 and width % 8 == 0
    assert t.rows * t.cols >= t.per_frame and frames * t.per_frame >= shape[0] > (frames - 1) * t.per_frame
    assert t.per_frame == 1 or t.per_frame * shape[1] * shape[2] <= mpx << 20


@pytest.mark.parametrize("shape, mpx", [(SMOLLM2_CHUNK, 4), (SMOLLM2_CHUNK, 1), ((7, 40, 24), 1), ((5, 8, 16), 4)])
def test_tile_then_untile_is_exact_for_numpy_and_torch_uint16(shape, mpx):
    planes = np.random.default_rng(1).integers(0, 1024, shape).astype(np.uint16)
    t = Tiling.of(shape, mpx)
    frames = t.tile(planes, fill=512)
    assert frames.shape == t.frame_shape and (frames == 512).sum() >= frames.size - planes.size
    assert np.array_equal(t.untile(frames), planes)
    back = t.untile(torch.from_numpy(frames.view(np.int16)).view(torch.uint16))
    assert back.dtype == torch.uint16 and back.is_contiguous()
    assert np.array_equal(back.view(torch.int16).numpy().view(np.uint16), planes)


def test_a_tiled_hevc_stream_is_fewer_larger_frames_and_lossless_stays_bit_exact():
    planes = np.random.default_rng(2).integers(0, 256, (12, 64, 96)).astype(np.uint8)
    tiled = Hevc(lossless=True, tile=1)
    data = tiled.encode(planes)
    frames, height, width = tiled.stream_shape(planes.shape)
    assert (frames, height, width) == (1, 256, 288)  # a 4x3 grid: the squarest without empty slots
    decoded = PyAVDecoder().decode(data, width, height, 8)  # the stream itself: one frame of 288x256
    assert len(decoded) == 1 and decoded[0].shape == (256, 288)
    assert np.array_equal(tiled.decode(data, planes.shape), planes)
    assert tiled.params["tile"] == 1 and "tile" not in Hevc(lossless=True).params  # untiled identities unchanged
    with pytest.raises(ValueError, match="tile must be 0..64"):
        Hevc(tile=65)


def test_the_tiled_rung_has_its_own_identity():
    assert SCHEMES["video-tiled"].codec_params["tile"] and "tile" not in SCHEMES["video-fast"].codec_params
    assert SCHEMES["video-tiled"].identity != replace(SCHEMES["video-tiled"], codec_params={
        k: v for k, v in SCHEMES["video-tiled"].codec_params.items() if k != "tile"}).identity


def _tiled_chunk(tokens: int = 64, seed: int = 3) -> bytes:
    scheme = on_tiny_profile(SCHEMES["video-tiled"])
    return ChunkEncoder(scheme, MODEL, auth=AUTH).encode(synthetic_kv(seed, tokens=tokens), KEY, 0, 0)


def test_a_tiled_video_chunk_decodes_the_same_through_every_path(tiny_profile, monkeypatch):
    chunk = _tiled_chunk()
    plain = ChunkDecoder(MODEL, auth=AUTH).decode(chunk, key=KEY)  # the coder's own PyAV decoder
    assert plain.planes.dtype == np.uint16 and tuple(plain.planes.shape) == tuple(plain.header.planes_shape)
    coder = Hevc(**plain.header.codec_params)
    frames = coder.stream_shape(tuple(plain.header.planes_shape))
    assert frames[0] < plain.header.planes_shape[0]  # fewer frames than planes
    assert len(PyAVDecoder().decode(_chunk_payload(chunk), frames[2], frames[1], 10)) == frames[0]
    verified = ChunkDecoder(MODEL, auth=AUTH, decoder="pyav", selftest=True)
    assert np.array_equal(verified.decode(chunk, key=KEY).planes, plain.planes)
    monkeypatch.setitem(DECODERS._targets, "device", f"{FAKES}:{DeviceDecoder.__name__}")  # as NVDEC's device output
    monkeypatch.setitem(DECODERS._loaded, "device", DeviceDecoder)
    device = ChunkDecoder(MODEL, auth=AUTH, decoder="device", device_output=True)
    for _ in range(2):  # the first is hashed on the host, the second trusted: both the same planes
        planes = device.decode(chunk, key=KEY).planes
        assert isinstance(planes, torch.Tensor) and planes.dtype == torch.uint16
        assert np.array_equal(planes.view(torch.int16).numpy().view(np.uint16), plain.planes)
    for dec in (verified, device):
        dec.close()
