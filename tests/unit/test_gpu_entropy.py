"""Entropy-coded rungs on a device decoder (``bitstream.simple``'s zstd framing, ``bitstream.decoders``'
``ENTROPY_DECODERS``, ``bitstream.nvcomp``), on the CPU: the framing (one zstd frame, or
``frame_kb`` pieces of standard zstd frames), ``ChunkDecoder``'s dispatch to a device decoder
registered through the same registry as nvCOMP's, the planes digest catching one that is not
bit-exact, and the reasons given where nvCOMP or a GPU is missing."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
import zstandard

from kvcodec.bitstream.decoders import open_entropy_decoder
from kvcodec.bitstream.nvcomp import NvcompZstdDecoder, out_pieces, staged
from kvcodec.bitstream.simple import Zstd, ZstdCpuDecoder
from kvcodec.encode import ChunkEncoder
from kvcodec.errors import CorruptChunk, Unsupported
from kvcodec.format.codecs import SCHEMES, get_scheme
from kvcodec.serving.decode import ChunkDecoder

from .conftest import AUTH, on_tiny_profile, synthetic_kv

MODEL = "org/tiny@abc123"
KEY = "aaaa/bbbb/0123456789abcdef"


def _planes(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 6, (8, 96, 256)) * rng.integers(0, 2, (8, 1, 256))).astype(np.uint8)


# -- the framing --------------------------------------------------------------------------------------
def test_one_frame_payloads_are_plain_zstd_as_the_stored_rungs_wrote_them():
    planes = _planes()
    data = Zstd(level=3).encode(planes)
    assert data == zstandard.ZstdCompressor(level=3).compress(planes.tobytes())  # old chunks decode as they are
    assert zstandard.frame_content_size(data) == planes.nbytes  # what a RAW nvCOMP decode reads
    assert np.array_equal(Zstd(level=3).decode(data, planes.shape), planes)
    assert "frame_kb" not in Zstd(level=3).params  # the rungs' identities stay


@pytest.mark.parametrize("frame_kb", [16, 64, 1024])
def test_framed_payloads_are_independent_standard_zstd_frames_that_round_trip(frame_kb):
    planes = _planes(1)
    coder = Zstd(level=3, frame_kb=frame_kb)
    data = coder.encode(planes)
    frames = coder.frames(data)
    assert len(frames) == -(-planes.nbytes // (frame_kb * 1024)) and coder.params["frame_kb"] == frame_kb
    pieces = [zstandard.ZstdDecompressor().decompress(bytes(f)) for f in frames]  # each alone, any zstd decoder
    assert b"".join(pieces) == planes.tobytes()
    assert np.array_equal(coder.decode(data, planes.shape), planes)


def test_a_damaged_frame_table_or_frame_is_corrupt():
    planes = _planes(2)
    coder = Zstd(level=3, frame_kb=16)
    data = bytearray(coder.encode(planes))
    for bad in (data[:3], data[:-1], bytes([0xFF]) + bytes(data[1:])):
        with pytest.raises(CorruptChunk):
            coder.decode(bytes(bad), planes.shape)
    data[-5] ^= 0xFF
    with pytest.raises(CorruptChunk):
        coder.decode(bytes(data), planes.shape)
    with pytest.raises(CorruptChunk, match="frames"):  # the frame count must be the planes'
        Zstd(level=3, frame_kb=32).decode(coder.encode(planes), planes.shape)
    with pytest.raises(ValueError, match="frame_kb"):
        Zstd(frame_kb=-1)


def test_staging_aligns_every_frame_and_the_output_pieces_cover_the_planes():
    frames = [b"a" * 5, b"bb" * 9, b"c"]
    buf, offsets, sizes = staged(frames, 16)
    assert offsets == [0, 16, 48] and sizes == [5, 18, 1] and all(o % 16 == 0 for o in offsets)
    assert all(bytes(buf[o:o + n]) == f for f, o, n in zip(frames, offsets, sizes, strict=True))
    assert out_pieces(100, 3) == ([0, 34, 68], [34, 34, 32]) and out_pieces(7, 1) == ([0], [7])


# -- dispatch through the registry ----------------------------------------------------------------------
class DeviceZstd:
    """A device entropy decoder as nvCOMP is one: frames in, the planes' bytes as a torch tensor out
    (on the CPU here, standing in for the GPU); counts its calls."""

    name = "device-zstd"
    device_output = True
    calls = 0
    made_with: dict = {}

    def __init__(self, gpu_id: int = 0) -> None:
        DeviceZstd.made_with = {"gpu_id": gpu_id}

    def decode(self, frames, size):
        DeviceZstd.calls += 1
        return torch.from_numpy(ZstdCpuDecoder().decode(frames, size).copy())

    def close(self):
        pass


class OffByOneZstd(DeviceZstd):
    """Not bit-exact: one byte of the planes wrong."""

    name = "off-by-one"

    def decode(self, frames, size):
        out = super().decode(frames, size)
        out[size // 2] ^= 1
        return out


def _chunk(spec: str, seed: int = 1) -> bytes:
    scheme = on_tiny_profile(get_scheme(*spec.split(":")) if ":" in spec else SCHEMES[spec])
    return ChunkEncoder(scheme, MODEL, auth=AUTH).encode(synthetic_kv(seed, tokens=64), KEY, 0, 0)


@pytest.mark.parametrize("rung", ["int8-zstd", "kvtc-w", "transform-zstd"])
def test_zstd_rungs_decode_on_the_registered_device_decoder_bit_exact_with_the_cpu(rung, register_entropy, tiny_profile):
    register_entropy("device-zstd", DeviceZstd)
    chunk = _chunk(rung)
    cpu = ChunkDecoder(MODEL, auth=AUTH).decode(chunk, key=KEY)
    dec = ChunkDecoder(MODEL, auth=AUTH, entropy="device-zstd", gpu_id=5)
    before = DeviceZstd.calls
    got = dec.decode(chunk, key=KEY)
    assert DeviceZstd.calls == before + 1 and DeviceZstd.made_with == {"gpu_id": 5}
    assert isinstance(got.planes, torch.Tensor) and np.array_equal(got.planes.numpy(), cpu.planes)
    dec.decode(_chunk("lossless8"), key=KEY)  # not a zstd payload: not its job
    assert DeviceZstd.calls == before + 1
    dec.close()


def test_a_device_decoder_that_is_not_bit_exact_fails_its_self_test_and_its_chunks_are_misses(register_entropy):
    register_entropy("off-by-one", OffByOneZstd)
    dec = ChunkDecoder(MODEL, auth=AUTH, entropy="off-by-one")
    assert dec.selftest_results["off-by-one"]["zstd"].startswith("mismatch: planes digest differs")
    with pytest.raises(Unsupported, match="failed its self-test for zstd: mismatch"):
        dec.decode(_chunk("int8-zstd"), key=KEY)
    dec.close()


# -- nvCOMP missing: clear reasons, never an ImportError -------------------------------------------------
def test_without_nvcomp_installed_the_nvcomp_decoder_is_unsupported_and_auto_falls_back_to_the_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.nvcomp", None)  # import fails (ModuleNotFoundError)
    with pytest.raises(Unsupported, match="nvCOMP unavailable: .*(pip install nvidia-nvcomp-cu13)"):
        open_entropy_decoder("nvcomp")
    with pytest.raises(Unsupported, match="nvCOMP unavailable"):
        ChunkDecoder(MODEL, auth=AUTH, entropy="nvcomp")
    assert isinstance(open_entropy_decoder("auto"), ZstdCpuDecoder)
    with pytest.raises(Unsupported, match="unknown entropy decoder 'lz9'"):
        open_entropy_decoder("lz9")


def _stand_in_nvcomp(monkeypatch):
    nvidia = types.ModuleType("nvidia")
    nvcomp = types.ModuleType("nvidia.nvcomp")
    nvcomp.Codec = lambda **kwargs: None
    nvcomp.BitstreamKind = types.SimpleNamespace(RAW="raw")
    nvidia.nvcomp = nvcomp
    monkeypatch.setitem(sys.modules, "nvidia", nvidia)
    monkeypatch.setitem(sys.modules, "nvidia.nvcomp", nvcomp)


def test_nvcomp_without_a_gpu_says_so(monkeypatch):
    _stand_in_nvcomp(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Unsupported, match="no CUDA device 0 visible to torch"):
        NvcompZstdDecoder()


def test_nvcomp_whose_import_raises_runtime_error_is_unsupported(monkeypatch):
    nvidia = types.ModuleType("nvidia")
    monkeypatch.setitem(sys.modules, "nvidia", nvidia)
    monkeypatch.delitem(sys.modules, "nvidia.nvcomp", raising=False)

    def finder(name, *a, **k):
        if name == "nvidia.nvcomp":
            raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")
        return real_import(name, *a, **k)

    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: finder(
        "nvidia.nvcomp" if name == "nvidia" and a and a[2] and "nvcomp" in a[2] else name, *a, **k))
    with pytest.raises(Unsupported, match="nvCOMP unavailable: RuntimeError: CUDA driver version is insufficient"):
        NvcompZstdDecoder()
