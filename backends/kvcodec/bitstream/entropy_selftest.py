"""Entropy decoder self-test: a device entropy decoder (nvCOMP) checked once, at start-up, on a
reference payload of each zstd framing the rungs write, instead of copying every chunk's planes to
the host to hash them.

The HEVC self-test's counterpart (``bitstream.selftest``). Two *framings* (``FRAMINGS``):
``zstd``, the planes as one standard zstd frame (every entropy rung today), and ``zstd-framed``,
the planes cut into ``frame_kb`` pieces of independent frames behind a size table
(``simple.Zstd``), whose last piece is shorter. The level is not part of a profile: it changes how
hard the encoder searched, not the frame syntax a decoder reads. Reference payloads live beside the
HEVC streams in ``reference/`` (``zstd.zst``, ``zstd-framed.zst``; made from ``reference_planes()``,
whose frames give zstd each kind of block: Huffman-coded literals of a peaked distribution like
quantized KV's, long matches, a run (RLE) and incompressible bytes (raw)), indexed in ``entropy.json`` with each payload's SHA-256 and the
digest of its CPU decode (python-zstandard); ``python -m kvcodec_tools.decoder_selftest
--regenerate`` writes them with the HEVC streams.

- ``framing_of(codec_params)``: the profile of a ``zstd`` chunk's parameters;
- ``verify(decoder) -> {profile: {"ok", "status", "detail"}}``: each reference payload decoded by
  ``decoder`` (the entropy decoder contract of ``bitstream.simple``; its output may be a tensor on
  a GPU) and compared with the reference digest: ``ok``, ``mismatch`` or ``error``; never raises.

What ``serving.decode`` does with the results: a decoder that passed a profile leaves that
profile's planes on the device, hashed on the host only for the first chunk of each planes shape;
one that failed is not used for it (``auto`` falls back to the CPU decoder).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import numpy as np

from . import selftest
from .host import host_array
from .selftest import REFERENCE_DIR, Mismatch, Result, checked, reference_bytes, verify_all

INDEX = "entropy.json"
FORMAT = "kvcodec-entropy-selftest/1"
FRAMINGS = ("zstd", "zstd-framed")
PARAMS: Dict[str, Dict[str, int]] = {"zstd": {"level": 3}, "zstd-framed": {"level": 3, "frame_kb": 8}}
SHAPE = (6, 64, 120)  # 46080 bytes: 6 frames of 8 KiB, the last one shorter


def reference_planes(shape=SHAPE) -> np.ndarray:
    """Deterministic ``uint8`` planes: two frames of a peaked (Laplace) distribution around 128,
    two of a block of rows repeated with changes (matches), one flat (a run), one uniform noise."""
    rng = np.random.default_rng(20261205)
    frames, rows, cols = shape
    out = np.empty(shape, np.uint8)
    for f in range(frames):
        if f < 2:
            out[f] = np.clip(np.rint(rng.laplace(128.0, 5.0, (rows, cols))), 0, 255)
        elif f < 4:
            block = rng.integers(0, 256, (8, cols), dtype=np.uint8)
            out[f] = np.tile(block, (-(-rows // 8), 1))[:rows]
            out[f, ::7, ::5] = rng.integers(0, 256, out[f, ::7, ::5].shape, dtype=np.uint8)
        elif f == 4:
            out[f] = 77
        else:
            out[f] = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    return out


def framing_of(codec_params: Dict[str, Any]) -> str:
    """``zstd-framed`` for a payload of ``frame_kb`` pieces, else ``zstd``."""
    return "zstd-framed" if codec_params.get("frame_kb") else "zstd"


def load_index(directory: Path = REFERENCE_DIR) -> Dict[str, Any]:
    return selftest.load_index(directory, INDEX)


def verify_one(decoder: Any, entry: Dict[str, Any], directory: Path = REFERENCE_DIR) -> Result:
    from ..format.container import planes_digest
    from .simple import Zstd

    def check() -> str:
        data = reference_bytes(entry, directory, "payload_sha256", "payload")
        shape = tuple(int(v) for v in entry["planes_shape"])
        planes = host_array(Zstd(**entry["codec_params"]).decode_with(decoder, data, shape))
        if planes_digest(planes) != entry["planes_digest"]:
            raise Mismatch(f"planes digest differs from the reference's (mean {float(planes.mean()):.3f})")
        return f"uint8{list(shape)}"

    return checked(check)


def verify(decoder: Any, directory: Path = REFERENCE_DIR) -> Dict[str, Result]:
    """Each framing's reference payload decoded by ``decoder`` against its digest."""
    return verify_all(decoder, directory, INDEX, FRAMINGS, verify_one, "payloads")
