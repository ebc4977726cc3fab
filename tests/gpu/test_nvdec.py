"""NVDEC against software decode, on streams made on the fly (opt-in: needs an NVIDIA GPU with
NVDEC and PyNvVideoCodec; skipped, saying what is missing, everywhere else).

No silent fallback: these tests build ``NvdecDecoder`` directly, never ``auto``. The self-test
and device-output checks (``device_output=True``: planes as torch tensors on the GPU) also need
torch with CUDA; the self-test reads the committed reference streams (``bitstream/reference``).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvcodec.bitstream import selftest
from kvcodec.bitstream.hevc import Hevc, PyAVDecoder
from kvcodec.bitstream.host import host_array, to_host
from kvcodec.errors import Unsupported
from kvcodec.layout.quant import PerChannel8

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nvdec():
    from kvcodec.bitstream.nvdec import NvdecDecoder

    try:
        decoder = NvdecDecoder()
    except Unsupported as exc:
        pytest.skip(f"needs NVDEC: {exc}")
    yield decoder
    decoder.close()


def _planes(seed: int = 0, layers: int = 4, tokens: int = 256):
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 6, tokens)[None, None, None, :, None]
    kv = (np.sin(t * rng.uniform(0.5, 2, (layers, 2, 3, 1, 64))) * rng.uniform(0.1, 3, (layers, 2, 3, 1, 64))
          + 0.1 * rng.standard_normal((layers, 2, 3, tokens, 64))).astype(np.float32)
    return PerChannel8().to_planes(kv)[0]


@pytest.mark.parametrize("lossless,qp", [(True, 0), (False, 8)])
def test_nvdec_output_equals_software_output(nvdec, lossless, qp):
    planes = _planes()
    codec = Hevc(lossless=lossless, qp=qp)
    data = codec.encode(planes)
    frames, height, width = planes.shape
    t0 = time.perf_counter()
    hw = np.stack(nvdec.decode(data, width, height))
    t_hw = time.perf_counter() - t0
    sw = np.stack(PyAVDecoder().decode(data, width, height))
    assert hw.shape == sw.shape == planes.shape
    assert np.array_equal(hw, sw), f"{int((hw != sw).sum())} of {hw.size} values differ (nvdec {t_hw:.3f} s)"
    if lossless:
        assert np.array_equal(hw, planes)


def test_nvdec_decodes_streams_of_another_size_with_the_same_decoder(nvdec):
    for tokens in (256, 512):
        planes = _planes(seed=tokens, tokens=tokens)
        data = Hevc().encode(planes)
        out = np.stack(nvdec.decode(data, planes.shape[2], planes.shape[1]))
        assert np.array_equal(out, planes)


@pytest.mark.parametrize("lossless,qp", [(True, 0), (False, 7)])
def test_nvdec_10bit_output_equals_software_output(nvdec, lossless, qp):
    """The video rung's streams: HEVC Main10 (P016 out of NVDEC, 10 bits at the top of each word)."""
    rng = np.random.default_rng(5)
    rows, cols = np.meshgrid(np.arange(192), np.arange(256), indexing="ij")
    base = 512 + 300 * np.sin(rows / 11.0)[None] * np.cos(cols / 23.0)[None]
    planes = np.clip(base + rng.normal(0, 15, (8, 192, 256)), 0, 1023).astype(np.uint16)
    codec = Hevc(lossless=lossless, qp=qp, bit_depth=10, preset="medium", tune="mse")
    data = codec.encode(planes)
    hw = np.stack(nvdec.decode(data, 256, 192, 10))
    sw = np.stack(PyAVDecoder().decode(data, 256, 192, 10))
    assert hw.dtype == sw.dtype == np.uint16 and hw.shape == sw.shape == planes.shape
    assert np.array_equal(hw, sw), f"{int((hw != sw).sum())} of {hw.size} samples differ"
    if lossless:
        assert np.array_equal(hw, planes)


@pytest.mark.parametrize("tile", [1, 4])
def test_nvdec_decodes_tiled_frames_as_software_does(nvdec, tile):
    """The tiled video rung's streams (``hevc`` ``tile``): a SmolLM2-sized chunk's 60 planes in one
    1536x1920 frame (tile 4) or three 1024x960 ones (tile 1), HEVC Main10."""
    rng = np.random.default_rng(7)
    rows, cols = np.meshgrid(np.arange(192), np.arange(256), indexing="ij")
    base = 512 + 300 * np.sin(rows / 11.0)[None] * np.cos(cols / 23.0)[None]
    planes = np.clip(base + rng.normal(0, 15, (60, 192, 256)), 0, 1023).astype(np.uint16)
    codec = Hevc(lossless=False, qp=13, bit_depth=10, preset="medium", tune="mse", tile=tile)
    data = codec.encode(planes)
    frames, height, width = codec.stream_shape(planes.shape)
    hw = np.stack(nvdec.decode(data, width, height, 10))
    sw = np.stack(PyAVDecoder().decode(data, width, height, 10))
    assert hw.shape == sw.shape == (frames, height, width) and frames < 60
    assert np.array_equal(hw, sw), f"{int((hw != sw).sum())} of {hw.size} samples differ"
    assert np.array_equal(codec.decode_with(nvdec, data, planes.shape), codec.decode(data, planes.shape))


# -- the start-up self-test and device output ------------------------------------------------------
GPU_ID = 0


@pytest.fixture(scope="module")
def nvdec_device():
    torch = pytest.importorskip("torch", reason="device output needs torch")
    if not torch.cuda.is_available():
        pytest.skip("device output needs torch with a CUDA device")
    from kvcodec.bitstream.nvdec import NvdecDecoder

    try:
        decoder = NvdecDecoder(GPU_ID, device_output=True)
    except Unsupported as exc:
        pytest.skip(f"needs NVDEC with device output: {exc}")
    yield decoder
    decoder.close()


def test_nvdec_passes_the_self_test_for_every_profile(nvdec):
    results = selftest.verify(nvdec)
    assert all(r["ok"] for r in results.values()), results


def test_nvdec_device_output_passes_the_self_test_for_every_profile(nvdec_device):
    results = selftest.verify(nvdec_device)
    assert all(r["ok"] for r in results.values()), results


@pytest.mark.parametrize("bit_depth,lossless,qp", [(8, True, 0), (8, False, 8), (10, False, 7)])
def test_nvdec_device_output_stays_on_the_gpu_and_equals_the_host_output(nvdec, nvdec_device, bit_depth, lossless,
                                                                          qp):
    import torch

    rng = np.random.default_rng(bit_depth)
    top = (1 << bit_depth) - 1
    planes = rng.integers(0, top + 1, (6, 192, 256)).astype(np.uint16 if bit_depth == 10 else np.uint8)
    data = Hevc(lossless=lossless, qp=qp, bit_depth=bit_depth).encode(planes)
    out = nvdec_device.decode(data, 256, 192, bit_depth)
    want = torch.device("cuda", GPU_ID)
    assert all(isinstance(p, torch.Tensor) and p.device == want for p in out)
    assert {p.dtype for p in out} == {torch.uint16 if bit_depth == 10 else torch.uint8}
    dev = to_host(out)  # one copy, here, to compare
    host = np.stack(nvdec.decode(data, 256, 192, bit_depth))
    assert np.array_equal(dev, host), f"{int((dev != host).sum())} of {dev.size} samples differ"
    if lossless:
        assert np.array_equal(dev, planes)


def test_chunk_decoder_on_nvdec_device_output_verifies_at_start_up_and_skips_the_host_digest(nvdec_device,
                                                                                             monkeypatch):
    """Two chunks of one shape: the first is hashed once on the host (a new frame size after the
    self-test), the second is not (``planes_digest`` raises), and both equal PyAV's planes."""
    import torch

    from kvcodec.encode import ChunkEncoder
    from kvcodec.format.auth import ChunkAuth
    from kvcodec.format.codecs import SCHEMES
    from kvcodec.serving import decode as decode_mod

    auth = ChunkAuth(bytes(range(32)))
    chunks = [ChunkEncoder(SCHEMES["lossless8"], "m", auth=auth).encode(
        np.random.default_rng(s).standard_normal((4, 2, 3, 256, 64)).astype(np.float32), "k", 0, 0) for s in (1, 2)]
    dec = decode_mod.ChunkDecoder("m", auth=auth, decoder="nvdec", device_output=True, gpu_id=GPU_ID)
    try:
        assert dec.verified_stream_profiles == set(selftest.STREAM_PROFILES), dec.selftest_results
        first = dec.decode(chunks[0], key="k").planes
        monkeypatch.setattr(decode_mod, "planes_digest", lambda planes: pytest.fail("host digest on a verified chunk"))
        second = dec.decode(chunks[1], key="k").planes
        assert isinstance(second, torch.Tensor) and second.device == torch.device("cuda", GPU_ID)
        monkeypatch.undo()
        for planes, chunk in zip((first, second), chunks, strict=True):
            want = decode_mod.ChunkDecoder("m", auth=auth, decoder="pyav").decode(chunk, key="k").planes
            assert np.array_equal(host_array(planes), want)
    finally:
        dec.close()
