"""nvCOMP's zstd against the CPU decoder, on payloads made on the fly (opt-in: needs an NVIDIA GPU,
torch with CUDA and ``nvidia-nvcomp-cu13``; skipped, saying what is missing, everywhere else).

No silent fallback: the decoder is ``NvcompZstdDecoder`` itself, never ``auto``. Its output (a
tensor on the GPU) is compared byte for byte with python-zstandard's decode of the same payload,
for one-frame payloads (the stored rungs' form) and ``frame_kb`` pieces.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvcodec.bitstream.host import host_array
from kvcodec.bitstream.simple import Zstd
from kvcodec.errors import CorruptChunk, Unsupported
from kvcodec.layout.quant import PerChannel8

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nvcomp():
    from kvcodec.bitstream.nvcomp import NvcompZstdDecoder

    try:
        decoder = NvcompZstdDecoder()
    except Unsupported as exc:
        pytest.skip(f"needs nvCOMP on a GPU: {exc}")
    yield decoder
    decoder.close()


def _planes(seed: int = 0, layers: int = 8, tokens: int = 256) -> np.ndarray:
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((layers, 2, 3, tokens, 64)).astype(np.float32) * rng.uniform(0.1, 3, (layers, 2, 3, 1, 64))
    return PerChannel8().to_planes(kv)[0]


@pytest.mark.parametrize("level, frame_kb", [(3, 0), (19, 0), (3, 64), (19, 256)])
def test_nvcomp_output_equals_the_cpu_decoders(nvcomp, level, frame_kb):
    planes = _planes()
    coder = Zstd(level=level, frame_kb=frame_kb)
    data = coder.encode(planes)
    out = coder.decode_with(nvcomp, data, planes.shape)
    assert str(out.device).startswith("cuda")
    assert np.array_equal(host_array(out), coder.decode(data, planes.shape))


def test_nvcomp_refuses_a_damaged_frame(nvcomp):
    planes = _planes(1)
    coder = Zstd(level=3)
    data = bytearray(coder.encode(planes))
    data[len(data) // 2] ^= 0xFF
    try:
        out = coder.decode_with(nvcomp, bytes(data), planes.shape)
    except CorruptChunk:
        return
    assert not np.array_equal(host_array(out), planes)  # decoded anyway: the chunk's digest catches it
