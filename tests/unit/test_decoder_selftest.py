"""The decoder self-test (``kvcodec.bitstream.selftest``, ``verified``, ``profiles``) and what ``ChunkDecoder`` does with it:
reference streams against their index, PyAV passing every profile, a decoder that alters planes
failing its profile and then not used for it, the host digest skipped only for a verified
decoder's device output, NVDEC's device mode on a stand-in PyNvVideoCodec (torch on the CPU in
place of the GPU), and kv_decode's ``initialize`` on a stand-in ``triton_python_backend_utils``.
"""
from __future__ import annotations

import ctypes
import enum
import hashlib
import json
import sys
import types

import numpy as np
import pytest
import torch

from kvcodec.bitstream import selftest
from kvcodec.bitstream.hevc import DECODERS, Hevc, PyAVDecoder, _luma
from kvcodec.bitstream.nvdec import _Cuda
from kvcodec.bitstream.stream_profiles import stream_profile
from kvcodec.bitstream.verified import VerifiedDecoders
from kvcodec.encode import ChunkEncoder
from kvcodec.errors import CorruptChunk, Unsupported
from kvcodec.format.codecs import SCHEMES, get_scheme
from kvcodec.serving import decode as decode_mod
from kvcodec.serving.chunkinfo import ChunkInfo
from kvcodec.serving.decode import ChunkDecoder, DecodeStep

from .conftest import AUTH, on_tiny_profile, synthetic_kv
from .fake_triton import exec_step, load_step

MODEL = "org/tiny@abc123"
KEY = "aaaa/bbbb/0123456789abcdef"
HERE = __name__  # the registry's "module:Class" targets for the fakes below


# -- fake decoders, registered in hevc.DECODERS as the real ones are ------------------------------
class CountingDecoder:
    """PyAV underneath; counts the streams it decodes."""

    name = "counting"

    def __init__(self, threads: int = 1) -> None:
        self._pyav = PyAVDecoder(threads)
        self.calls = 0

    def decode(self, data, width, height, bit_depth=8):
        self.calls += 1
        return self._pyav.decode(data, width, height, bit_depth)

    def close(self) -> None:
        pass


class Altering10Decoder(CountingDecoder):
    """Returns 10-bit planes with one sample changed: fails the ``video`` profile, passes the others."""

    name = "altering10"

    def decode(self, data, width, height, bit_depth=8):
        out = super().decode(data, width, height, bit_depth)
        if bit_depth == 10:
            out[0] = out[0].copy()
            out[0][0, 0] ^= 1
        return out


class DeviceDecoder(CountingDecoder):
    """Says its output is on the device: torch tensors (on the CPU here, standing in for the GPU)."""

    name = "device"
    device_output = True
    made_with: dict = {}

    def __init__(self, gpu_id: int = 0, device_output: bool = False) -> None:
        super().__init__()
        DeviceDecoder.made_with = {"gpu_id": gpu_id, "device_output": device_output}

    def decode(self, data, width, height, bit_depth=8):
        return [torch.from_numpy(np.array(p)) for p in super().decode(data, width, height, bit_depth)]


class SizeBuggyDeviceDecoder(DeviceDecoder):
    """Device output right at the self-test's frame sizes, wrong at any other (a reconfigure bug)."""

    name = "size-buggy"
    WIDTHS = {entry["shape"][2] for entry in selftest.load_index()["profiles"].values()}

    def decode(self, data, width, height, bit_depth=8):
        out = super().decode(data, width, height, bit_depth)
        if width not in self.WIDTHS:
            out[-1][0, 0] ^= 1
        return out


@pytest.fixture(autouse=True)
def decoders_as_they_were(monkeypatch):
    """Every test leaves ``DECODERS`` as it found it, classes loaded meanwhile too (a fake loaded
    as "nvdec" would otherwise be ``auto``'s pick in later tests)."""
    monkeypatch.setattr(DECODERS, "_targets", dict(DECODERS._targets))
    monkeypatch.setattr(DECODERS, "_loaded", dict(DECODERS._loaded))


@pytest.fixture
def register():
    """Registers fakes in ``hevc.DECODERS`` (``register(name, cls)``), for this test only."""

    def add(name, cls):
        DECODERS.register(name, f"{HERE}:{cls.__name__}")

    return add


def _chunk(scheme_name: str, seed: int = 1, tokens: int = 64) -> bytes:
    kv = synthetic_kv(seed, layers=2, tokens=tokens)
    return ChunkEncoder(SCHEMES[scheme_name], MODEL, auth=AUTH).encode(kv, KEY, 0, 0)


def _video_chunk() -> bytes:
    """A ``video`` chunk (HEVC Main10) on the tiny codec profile (the ``tiny_profile`` fixture)."""
    return ChunkEncoder(on_tiny_profile(SCHEMES["video"]), MODEL, auth=AUTH).encode(synthetic_kv(2, tokens=64), KEY, 0, 0)


def _chunk_payload(data: bytes) -> bytes:
    from kvcodec.encode import PAYLOAD
    from kvcodec.format import container

    return bytes(container.parse(data, AUTH).sections[PAYLOAD])


# -- reference streams -----------------------------------------------------------------------------
def test_the_reference_streams_match_their_index_and_the_rungs_settings():
    index = selftest.load_index()
    assert index["format"] == selftest.FORMAT and sorted(index["profiles"]) == sorted(selftest.STREAM_PROFILES)
    for name, entry in index["profiles"].items():
        data = (selftest.REFERENCE_DIR / entry["file"]).read_bytes()
        assert len(data) == entry["bytes"] < 16 * 1024, f"{name}: reference streams stay small"
        assert hashlib.sha256(data).hexdigest() == entry["stream_sha256"]
        # the rung's settings today: if they change, regenerate (python -m kvcodec_tools.decoder_selftest --regenerate)
        assert entry["codec_params"] == SCHEMES[name].codec_params, f"{name}: settings changed; regenerate"
        frames, height, width = entry["shape"]
        assert min(height, width) >= 144  # NVDEC's HEVC minimum
        tiling = Hevc(**entry["codec_params"]).tiling(tuple(entry["planes_shape"]))
        if tiling is None:  # more frames than NVDEC's display delay
            assert frames > 4 and entry["shape"] == entry["planes_shape"]
        else:  # the planes in one larger frame, as the rung's chunks are
            assert entry["shape"] == list(tiling.frame_shape) and frames < entry["planes_shape"][0]
        planes = np.stack(PyAVDecoder().decode(data, width, height, entry["bit_depth"]))
        assert f"{planes.dtype.name}{list(planes.shape)}" == f"{entry['dtype']}{entry['shape']}"
        assert selftest._digest(planes) == entry["planes_digest"]
        top = (1 << entry["bit_depth"]) - 1
        assert planes.min() == 0 and planes.max() == top, f"{name}: both ends of the range"
        if entry["codec_params"]["lossless"]:
            assert np.array_equal(planes, selftest.reference_frames(entry))


def test_pyav_passes_the_self_test_for_every_profile():
    results = selftest.verify(PyAVDecoder())
    assert set(results) == set(selftest.STREAM_PROFILES)
    assert all(r["ok"] and r["status"] == "ok" for r in results.values()), results


def test_a_damaged_or_missing_reference_is_an_error_not_a_pass(tmp_path):
    assert all(r["status"] == "error" for r in selftest.verify(PyAVDecoder(), tmp_path).values())
    for f in selftest.REFERENCE_DIR.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    data = bytearray((tmp_path / "video.hevc").read_bytes())
    data[-10] ^= 0xFF
    (tmp_path / "video.hevc").write_bytes(bytes(data))
    results = selftest.verify(PyAVDecoder(), tmp_path)
    assert results["video"]["status"] == "error" and "damaged" in results["video"]["detail"]
    assert results["lossless8"]["ok"] and results["video-q8"]["ok"]


@pytest.mark.parametrize("params, profile", [
    (SCHEMES["lossless8"].codec_params, "lossless8"),
    (SCHEMES["video-q8"].codec_params, "video-q8"),
    (get_scheme("video-q8", quality=20).codec_params, "video-q8"),  # the QP is not part of a profile
    (SCHEMES["video"].codec_params, "video"),
    (get_scheme("video", quality=12).codec_params, "video"),
    (SCHEMES["video-tiled"].codec_params, "video-tiled"),  # transform skip: a tool the decoder runs
    (dict(SCHEMES["video"].codec_params, x265="rd=2:rdoq-level=2"), "video"),  # the encoder's search only
    (SCHEMES["video-fast"].codec_params, None),  # 16x16 blocks, no SAO: no reference stream has them
    ({"lossless": True, "qp": 0, "preset": "ultrafast", "bit_depth": 10}, None),  # no rung writes it
    ({"lossless": False, "qp": 8, "preset": "slow"}, None),
    ({"lossless": False, "bit_depth": "ten"}, None),
])
def test_stream_profile_of_a_chunks_settings(params, profile):
    assert stream_profile(params) == profile


# -- a decoder that fails a profile is not used for it ----------------------------------------------
def test_a_decoder_returning_altered_planes_fails_that_profile_only(register):
    register("altering10", Altering10Decoder)
    decoders = VerifiedDecoders("altering10")
    results = decoders.results["altering10"]
    assert results["video"]["status"] == "mismatch" and "digest differs" in results["video"]["detail"]
    assert results["lossless8"]["ok"] and results["video-q8"]["ok"]
    assert decoders.verified_stream_profiles == {"lossless8", "video-q8"}
    with pytest.raises(Unsupported, match="self-test for HEVC stream profile video: altering10: mismatch"):
        decoders.choose("video")
    decoder, verified = decoders.choose("lossless8")
    assert verified and isinstance(decoder, Altering10Decoder)
    assert decoders.choose(None) == (decoder, False)  # no reference for it: used, unverified (host digest)
    decoders.close()


def test_a_mismatch_on_a_lossless_stream_says_how_many_samples_differ():
    class Off8(CountingDecoder):
        def decode(self, data, width, height, bit_depth=8):
            out = [p.copy() for p in super().decode(data, width, height, bit_depth)]
            if bit_depth == 8:
                out[3][5, 7] ^= 0x40  # the kind of error a wrong pitch or shift gives, once
            return out

    results = selftest.verify(Off8())
    assert results["lossless8"]["status"] == "mismatch" and results["video-q8"]["status"] == "mismatch"
    assert "1 of 167808 samples differ from the encoded planes" in results["lossless8"]["detail"]
    assert results["video"]["ok"]


def test_chunks_of_a_failed_profile_are_misses_with_the_reason(register, tiny_profile):
    register("altering10", Altering10Decoder)
    step = DecodeStep(MODEL, auth=AUTH, decoder="altering10", selftest=True)
    video = _video_chunk()
    info = ChunkInfo("s", 0, 2, key=KEY)
    assert step.run(info, video).header is None
    assert info.status == "error" and "start-up self-test for HEVC stream profile video" in info.reason
    info = ChunkInfo("s", 1, 2, key=KEY)
    assert step.run(info, _chunk("lossless8")).header is not None and info.ok
    step.close()


def test_auto_falls_back_to_pyav_for_a_profile_nvdec_failed(register, tiny_profile, monkeypatch):
    monkeypatch.setitem(DECODERS._targets, "nvdec", f"{HERE}:Altering10Decoder")  # NVDEC, as it were
    monkeypatch.delitem(DECODERS._loaded, "nvdec", raising=False)
    dec = ChunkDecoder(MODEL, auth=AUTH, decoder="auto", selftest=True)
    assert set(dec.selftest_results) == {"nvdec", "pyav"}
    assert dec.verified_stream_profiles == set(selftest.STREAM_PROFILES)
    nvdec = dec._video.decoders["nvdec"]
    video = _video_chunk()
    before = nvdec.calls
    assert dec.decode(video, key=KEY).planes.dtype == np.uint16  # decoded by PyAV: digest matches
    assert nvdec.calls == before
    dec.decode(_chunk("lossless8"), key=KEY)
    assert nvdec.calls == before + 1  # the profile it passed stays with it
    dec.close()


def test_auto_makes_no_pyav_when_the_first_decoder_passes_everything(register, monkeypatch):
    monkeypatch.setitem(DECODERS._targets, "nvdec", f"{HERE}:CountingDecoder")
    monkeypatch.delitem(DECODERS._loaded, "nvdec", raising=False)
    decoders = VerifiedDecoders("auto")
    assert list(decoders.decoders) == ["nvdec"] and decoders.verified_stream_profiles == set(selftest.STREAM_PROFILES)


def test_an_unavailable_decoder_makes_its_chunks_misses_not_a_failed_start(register):
    def unavailable(*_a, **_k):
        raise Unsupported("NVDEC unavailable: no driver")

    register("gone", CountingDecoder)
    DECODERS._loaded["gone"] = unavailable
    step = DecodeStep(MODEL, auth=AUTH, decoder="gone", selftest=True)
    assert step.decoder.selftest_results == {"gone": "unavailable: NVDEC unavailable: no driver"}
    info = ChunkInfo("s", 0, 1, key=KEY)
    step.run(info, _chunk("lossless8"))
    assert info.status == "error" and "unavailable (NVDEC unavailable: no driver)" in info.reason


# -- the host digest: skipped only for a verified decoder's device output ---------------------------
@pytest.fixture
def digests(monkeypatch):
    """Counts ``planes_digest`` calls in serving.decode; ``digests.forbid()`` makes the next one raise."""
    real = decode_mod.planes_digest
    state = types.SimpleNamespace(calls=0, forbidden=False)

    def counted(planes):
        if state.forbidden:
            raise AssertionError("planes_digest called: the host digest was not skipped")
        state.calls += 1
        return real(planes)

    state.forbid = lambda: setattr(state, "forbidden", True)
    monkeypatch.setattr(decode_mod, "planes_digest", counted)
    return state


def test_verified_device_output_skips_the_host_digest_after_the_first_chunk_of_its_shape(register, digests):
    register("device", DeviceDecoder)
    dec = ChunkDecoder(MODEL, auth=AUTH, decoder="device", device_output=True, gpu_id=3)
    assert DeviceDecoder.made_with == {"gpu_id": 3, "device_output": True}  # the caller's GPU id reaches it
    assert dec.verified_stream_profiles == set(selftest.STREAM_PROFILES)
    first = dec.decode(_chunk("lossless8", seed=1), key=KEY)
    assert isinstance(first.planes, torch.Tensor) and digests.calls == 1  # a new (profile, shape): hashed once
    want = PyAVDecoder().decode(_chunk_payload(_chunk("lossless8", seed=2)), 192, 64)
    digests.forbid()
    second = dec.decode(_chunk("lossless8", seed=2), key=KEY)
    assert isinstance(second.planes, torch.Tensor) and np.array_equal(second.planes.numpy(), np.stack(want))
    digests.forbidden = False
    dec.decode(_chunk("video-q8", seed=3), key=KEY)  # another profile: its first chunk is hashed
    dec.decode(_chunk("lossless8", seed=4, tokens=128), key=KEY)  # another shape: hashed once
    assert digests.calls == 3
    digests.forbid()
    dec.decode(_chunk("video-q8", seed=5), key=KEY)
    dec.decode(_chunk("lossless8", seed=6, tokens=128), key=KEY)
    dec.close()


def test_host_planes_keep_the_digest_on_every_chunk_even_when_verified(digests):
    dec = ChunkDecoder(MODEL, auth=AUTH, decoder="pyav", selftest=True)
    assert dec.verified_stream_profiles == set(selftest.STREAM_PROFILES)
    for seed in (1, 2, 3):
        assert isinstance(dec.decode(_chunk("lossless8", seed=seed), key=KEY).planes, np.ndarray)
    assert digests.calls == 3
    dec.close()


def test_without_selftest_the_coders_decode_as_before(digests):
    dec = ChunkDecoder(MODEL, auth=AUTH)
    assert dec.selftest_results is None and dec.verified_stream_profiles == set()
    dec.decode(_chunk("lossless8"), key=KEY)
    assert digests.calls == 1 and dec._video is None
    dec.close()


def test_device_output_of_an_unverified_profile_is_hashed_on_every_chunk(register, digests, monkeypatch):
    register("device", DeviceDecoder)
    dec = ChunkDecoder(MODEL, auth=AUTH, decoder="device", device_output=True)
    monkeypatch.setattr(decode_mod, "stream_profile", lambda params: None)  # as for settings no rung writes
    for seed in (1, 2):
        assert isinstance(dec.decode(_chunk("lossless8", seed=seed), key=KEY).planes, torch.Tensor)
    assert digests.calls == 2
    dec.close()


def test_a_device_decoder_wrong_at_another_size_is_caught_by_that_sizes_first_chunk(register):
    register("size-buggy", SizeBuggyDeviceDecoder)
    dec = ChunkDecoder(MODEL, auth=AUTH, decoder="size-buggy", device_output=True)
    assert dec.verified_stream_profiles == set(selftest.STREAM_PROFILES)  # right at the self-test's size
    for seed in (1, 2):  # and never trusted at this one: every chunk checked, every one refused
        with pytest.raises(CorruptChunk, match="do not match the digest taken at ingest"):
            dec.decode(_chunk("lossless8", seed=seed), key=KEY)
    dec.close()


# -- NVDEC's device mode on a stand-in PyNvVideoCodec (torch on the CPU for the GPU) -----------------
class FakeNvc(types.ModuleType):
    """Just enough of PyNvVideoCodec 2.2.4, behaving as the real one does with the arguments it is
    given: CreateDecoder -> a session whose Decode(PacketData) decodes the packet's bytes with PyAV,
    holding the last two frames back until the flush. ``usedevicememory=True``: frames are DLPack
    stand-ins (torch tensors with padded rows, NV12 / P016), readable only when the session was made
    in the caller's context and stream (``CpuCuda.handles``; any other context's memory is not
    addressable from torch); else host frames (``framesize``, ``GetPtrToPlane``, packed). Frames
    larger than the session's ``maxwidth`` x ``maxheight`` fail, and sizes outside the caps
    (144..8192) are refused, as NVDEC's are."""

    def __init__(self, p016_as_bytes: bool = False) -> None:
        super().__init__("PyNvVideoCodec")
        self.cudaVideoCodec = types.SimpleNamespace(HEVC="hevc")
        # 2.2.4 has no YUV420 here (seen on the H200); the member is found by its name's "420"
        self.cudaVideoChromaFormat = enum.IntEnum("cudaVideoChromaFormat",
                                                  {"Monochrome": 0, "_420": 1, "_422": 2, "_444": 3})
        self.sessions = 0
        self.p016_as_bytes = p016_as_bytes

    def GetDecoderCaps(self, chromaformat, **_):
        if chromaformat is not self.cudaVideoChromaFormat["_420"]:
            raise RuntimeError("caps asked for another chroma format")
        return {"width_min": 144, "height_min": 144, "width_max": 8192, "height_max": 8192}

    class PacketData:
        bsl = 0
        bsl_data = 0

    def CreateDecoder(self, **kwargs):
        self.sessions += 1
        return FakeSession(self, kwargs)


class HostFrame:
    """A decoded frame in host memory: packed NV12 / P016 at an address (the session keeps it alive)."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf

    def framesize(self):
        return self.buf.nbytes

    def GetPtrToPlane(self, plane):
        return self.buf.ctypes.data


class FakeSession:
    def __init__(self, nvc: FakeNvc, made: dict) -> None:
        self.nvc, self.made, self.held, self.size = nvc, made, [], None
        self.device = bool(made["usedevicememory"])

    def setReconfigParams(self, width, height):
        self.size = (width, height)

    def Decode(self, pkt):
        if self.device and (self.made["cudacontext"], self.made["cudastream"]) != CpuCuda.HANDLES:
            raise RuntimeError("CUDA_ERROR_INVALID_CONTEXT: the frames are not addressable from the caller's context")
        if not pkt.bsl:
            out, self.held = self.held, []
            return out
        data = ctypes.string_at(pkt.bsl_data, pkt.bsl)
        frames = self._frames(data)
        self.held = frames[-2:]
        return frames[:-2]

    def _frames(self, data):
        import av

        ctx = av.CodecContext.create("hevc", "r")
        out = []
        for frame in [f for p in ctx.parse(data) + ctx.parse(None) for f in ctx.decode(p)] + list(ctx.decode(None)):
            if frame.width > self.made["maxwidth"] or frame.height > self.made["maxheight"]:
                raise RuntimeError(f"frame {frame.width}x{frame.height} exceeds the session's surfaces")
            wide = frame.format.name == "yuv420p10le"
            y = _luma(frame, frame.width, frame.height, 10 if wide else 8)
            pitch = frame.width + 40 if self.device else frame.width  # host frames are packed
            buf = np.full((frame.height * 3 // 2, pitch), 0x5A5A if wide else 0x5A, np.uint16 if wide else np.uint8)
            buf[:frame.height, :frame.width] = (y.astype(np.uint16) << 6) if wide else y
            if not self.device:
                out.append(HostFrame(buf))
                continue
            if wide and self.nvc.p016_as_bytes:
                buf = buf.view(np.uint8)
            out.append(torch.from_numpy(buf.view(np.int16) if buf.dtype == np.uint16 else buf))
        return out


class CpuCuda:
    """``nvdec._Cuda`` on the CPU: no context or stream; the frame -> luma code is the real one."""

    HANDLES = (0xC0, 0x5E)  # (context, stream): torch's, as the real one retains them

    def __init__(self, gpu_id):
        self.torch, self.device, self.gpu_id, self.closed = torch, torch.device("cpu"), gpu_id, False

    def handles(self):
        return self.HANDLES

    def ordered(self):
        import contextlib

        return contextlib.nullcontext()

    luma = _Cuda.luma

    def close(self):
        self.closed = True


@pytest.fixture(params=[False, True], ids=["p016-words", "p016-bytes"])
def fake_nvc(request, monkeypatch):
    from kvcodec.bitstream import nvdec

    fake = FakeNvc(p016_as_bytes=request.param)
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", fake)
    monkeypatch.setattr(nvdec, "_Cuda", CpuCuda)
    return fake


def _pyav_frames(data, width, height, bit_depth):
    return np.stack(PyAVDecoder().decode(data, width, height, bit_depth))


def test_nvdec_device_output_gives_device_tensors_bit_exact_with_pyav_and_passes_the_self_test(fake_nvc):
    """Device mode: the frames come back as tensors on the decoder's device (contiguous, uint16 for
    Main10 whether P016 is exported as words or bytes), equal to PyAV's; the session is usable from
    the caller's context (the fake refuses any other); the self-test passes on every profile."""
    from kvcodec.bitstream.nvdec import NvdecDecoder

    dec = NvdecDecoder(gpu_id=2, device_output=True)
    assert dec.device_output
    results = selftest.verify(dec)
    assert all(r["ok"] for r in results.values()), results
    data = (selftest.REFERENCE_DIR / "video-q8.hevc").read_bytes()
    planes = dec.decode(data, selftest.WIDTH, selftest.HEIGHT, 8)
    assert all(isinstance(p, torch.Tensor) and p.dtype == torch.uint8 and p.is_contiguous() for p in planes)
    assert np.array_equal(torch.stack(planes).numpy(), _pyav_frames(data, selftest.WIDTH, selftest.HEIGHT, 8))
    entry = selftest.load_index()["profiles"]["video"]
    data = (selftest.REFERENCE_DIR / entry["file"]).read_bytes()
    frames, height, width = entry["shape"]
    planes = dec.decode(data, width, height, 10)
    assert all(isinstance(p, torch.Tensor) and p.dtype == torch.uint16 and p.is_contiguous() for p in planes)
    got = torch.stack(planes).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(got, _pyav_frames(data, width, height, 10))
    dec.close()
    assert dec._cuda.closed


def test_nvdec_host_mode_is_the_default_and_gives_host_arrays_bit_exact_with_pyav(fake_nvc):
    from kvcodec.bitstream.nvdec import NvdecDecoder

    dec = NvdecDecoder()
    assert not dec.device_output
    assert all(r["ok"] for r in selftest.verify(dec).values())
    data = (selftest.REFERENCE_DIR / "lossless8.hevc").read_bytes()
    planes = dec.decode(data, selftest.WIDTH, selftest.HEIGHT, 8)
    assert all(isinstance(p, np.ndarray) for p in planes)
    assert np.array_equal(np.stack(planes), selftest.reference_planes(8))


def test_nvdec_decodes_frames_larger_than_its_first_surfaces_and_refuses_sizes_nvdec_cannot(fake_nvc):
    """A tiled chunk's frame wider than the decoder's first surfaces (2048) makes a new session
    sized for it and decodes bit-exactly; a frame below NVDEC's 144x144 is Unsupported (a miss)."""
    from kvcodec.bitstream.nvdec import NvdecDecoder

    dec = NvdecDecoder(device_output=True)
    big = (np.arange(2 * 160 * 2304) % 251).astype(np.uint8).reshape(2, 160, 2304)
    data = Hevc(lossless=True).encode(big)
    planes = dec.decode(data, 2304, 160, 8)
    assert np.array_equal(torch.stack(planes).numpy(), big) and fake_nvc.sessions == 2
    small = Hevc(lossless=True).encode(np.zeros((1, 128, 128), np.uint8))
    with pytest.raises(Unsupported, match="NVDEC cannot decode 128x128"):
        dec.decode(small, 128, 128, 8)
    dec.close()


def test_nvdec_device_output_made_outside_the_callers_context_fails_its_self_test(fake_nvc, monkeypatch):
    """The same fake, with a context that is not torch's: nothing decodes, every profile fails, so
    a ChunkDecoder would never use it (the self-test is what catches a wrongly made session)."""
    from kvcodec.bitstream.nvdec import NvdecDecoder

    monkeypatch.setattr(CpuCuda, "handles", lambda self: (0xBAD, 0x5E))
    dec = NvdecDecoder(device_output=True)
    results = selftest.verify(dec)
    assert all(r["status"] == "error" and "INVALID_CONTEXT" in r["detail"] for r in results.values()), results


def test_nvdec_device_output_without_cuda_is_unsupported(monkeypatch):
    from kvcodec.bitstream import nvdec

    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", FakeNvc())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Unsupported, match="no CUDA device 1 visible to torch"):
        nvdec.NvdecDecoder(gpu_id=1, device_output=True)


# -- kv_decode's initialize: the instance's GPU, the self-test logged ---------------------------------
@pytest.fixture
def kv_decode(monkeypatch, tmp_path):
    """kv_decode's model.py on a stand-in ``triton_python_backend_utils`` (Logger records)."""
    monkeypatch.setenv("KVCODEC_CHUNK_KEY", bytes(range(32)).hex())  # the tests' AUTH
    fake = load_step(monkeypatch, "kv_decode")
    exec_step(fake)
    monkeypatch.setattr(fake.model, "model_card", lambda settings: types.SimpleNamespace(
        model_id=MODEL, geometry=lambda tokens: None))
    monkeypatch.setitem(DECODERS._targets, "nvdec", f"{HERE}:DeviceDecoder")
    monkeypatch.delitem(DECODERS._loaded, "nvdec", raising=False)
    fake.config = json.dumps({"parameters": {"home": {"string_value": str(tmp_path)},
                                             "decoder": {"string_value": "nvdec"}}})
    yield fake
    sys.modules.pop("kvcodec.triton", None)


def _request(chunk: bytes) -> dict:
    info = ChunkInfo("s", 0, 1, key=KEY)
    values = {"chunk_info": np.array([info.to_json().encode()], dtype=object),
              "chunk": np.frombuffer(chunk, np.uint8), "input_ids": np.zeros(3, np.int32),
              "max_tokens": np.array([4], np.int32)}
    values = {name: v[None] for name, v in values.items()}  # the batch dimension
    return {name: types.SimpleNamespace(name=name, value=v, as_numpy=lambda v=v: v, is_cpu=lambda: True)
            for name, v in values.items()}


def test_kv_decode_on_a_gpu_instance_builds_the_decoder_on_that_gpu_and_logs_its_self_test(kv_decode):
    model = kv_decode.model.TritonPythonModel()
    model.initialize({"model_instance_kind": "GPU", "model_instance_device_id": "1", "model_config": kv_decode.config})
    assert DeviceDecoder.made_with == {"gpu_id": 1, "device_output": True}
    [(level, message)] = kv_decode.logged
    assert level == "info" and message.startswith("kv_decode on cuda:1: decoder nvdec self-test: ")
    assert set(json.loads(message.split("self-test: ", 1)[1])["nvdec"]) == set(selftest.STREAM_PROFILES)
    [gauge] = kv_decode.MetricFamily.families["kvcodec_decoder_selftest_passed"].metrics
    assert gauge.value == 1.0
    [response] = model.execute([_request(_chunk("lossless8"))])
    assert response.error is None
    planes = response.tensors["planes8"].value[0]  # a CPU tensor stands for the GPU one: sent as numpy
    want = ChunkDecoder(MODEL, auth=AUTH).decode(_chunk("lossless8"), key=KEY).planes
    assert np.array_equal(planes, want) and response.tensors["planes16"].value.size == 0
    model.finalize()


def test_kv_decode_on_a_cpu_instance_self_tests_pyav_and_keeps_host_planes(kv_decode):
    model = kv_decode.model.TritonPythonModel()
    config = json.loads(kv_decode.config)
    config["parameters"]["decoder"]["string_value"] = "pyav"
    model.initialize({"model_instance_kind": "CPU", "model_instance_device_id": "0", "model_config": json.dumps(config)})
    [(level, message)] = kv_decode.logged
    assert level == "info" and message.startswith("kv_decode on cpu: decoder pyav self-test: ")
    [response] = model.execute([_request(_chunk("video-q8"))])
    assert isinstance(response.tensors["planes8"].value, np.ndarray) and response.tensors["planes8"].value.size
    model.finalize()


def test_kv_decode_logs_a_warning_when_nvcomp_fails_its_self_test(kv_decode, register_entropy):
    from .test_gpu_entropy import OffByOneZstd

    register_entropy("nvcomp", OffByOneZstd)  # nvCOMP, as it were, one byte wrong
    model = kv_decode.model.TritonPythonModel()
    config = json.loads(kv_decode.config)
    config["parameters"]["entropy"] = {"string_value": "nvcomp"}
    model.initialize({"model_instance_kind": "GPU", "model_instance_device_id": "0", "model_config": json.dumps(config)})
    [(level, message)] = kv_decode.logged
    assert level == "warn"
    results = json.loads(message.split("self-test: ", 1)[1])
    assert set(results["nvdec"]) == set(selftest.STREAM_PROFILES)  # NVDEC passed; the entropy decoder did not
    assert results[OffByOneZstd.name]["zstd"].startswith("mismatch")
    [gauge] = kv_decode.MetricFamily.families["kvcodec_decoder_selftest_passed"].metrics
    assert gauge.value == 0.0  # what the alert KVCodecDecoderSelfTestFailed reads
    model.finalize()


# -- the tool: self-test from the command line, reference streams made again ---------------------------
def test_the_tool_regenerates_the_committed_reference_streams_byte_for_byte(tmp_path, capsys):
    from kvcodec_tools import decoder_selftest

    assert decoder_selftest.main(["--regenerate", "--directory", str(tmp_path)]) == 0
    capsys.readouterr()
    made, committed = selftest.load_index(tmp_path), selftest.load_index()
    assert made["profiles"] == committed["profiles"]  # x265 is deterministic: the same streams, the same digests
    for entry in committed["profiles"].values():
        assert (tmp_path / entry["file"]).read_bytes() == (selftest.REFERENCE_DIR / entry["file"]).read_bytes()
    assert decoder_selftest.main(["--decoder", "pyav", "--directory", str(tmp_path)]) == 0
    assert set(json.loads(capsys.readouterr().out)["pyav"]) == set(selftest.STREAM_PROFILES)
    (tmp_path / "video.hevc").write_bytes(b"\x00" * 64)  # a damaged reference: that profile fails, exit 1
    assert decoder_selftest.main(["--decoder", "pyav", "--directory", str(tmp_path)]) == 1
