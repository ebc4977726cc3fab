"""NVDEC against software decode, on streams made on the fly (opt-in: needs an NVIDIA GPU with
NVDEC and PyNvVideoCodec; skipped, saying what is missing, everywhere else).

No silent fallback: these tests build ``NvdecDecoder`` directly, never ``auto``.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from kvcodec.bitstream.hevc import Hevc, PyAVDecoder
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
