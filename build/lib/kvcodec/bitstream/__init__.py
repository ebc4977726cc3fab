"""Bitstream coders: planes <-> bytes.

The bitstream coder is the last of the three parts of a codec (see docs/codecs.md's glossary: a *codec*
is the user-facing name, e.g. ``video``; it pairs a *layout*, KV <-> planes, with a *bitstream
coder*, planes <-> bytes). A ``BitstreamCoder`` is built from keyword parameters (recorded in the
chunk header as ``codec_params`` and bound into the chunk key), encodes planes ``[frames, height,
width]`` (uint8, or uint16 for 10-bit video) to bytes and decodes any byte buffer back to planes of
the same shape and dtype. Lossless coders return the planes bit-exactly. Decoders that need a
device (NVDEC) are made once, when the coder object is made, and released by ``close``.

Registered in ``CODERS``, imported on first use: ``identity``, ``zstd``, ``ans`` (CacheGen-style
arithmetic coding), ``hevc`` (software x265 encode; decode by ``decoder="pyav"`` in software or
``decoder="nvdec"`` on an NVIDIA GPU).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np

from ..registry import Registry


class BitstreamCoder:
    name: str = ""
    # True when the decoded planes are the payload's bytes as they are (``identity``): the planes
    # digest then equals the payload's section digest, which the container check already verified.
    verbatim: bool = False

    def __init__(self, **params: Any) -> None:
        self.params: Dict[str, Any] = params

    def encode(self, planes: np.ndarray) -> bytes:
        raise NotImplementedError

    def decode(self, data: bytes, shape: Tuple[int, int, int]) -> np.ndarray:
        raise NotImplementedError

    @property
    def lossless(self) -> bool:
        """Whether ``decode(encode(planes))`` returns ``planes`` exactly."""
        return True

    def close(self) -> None:
        """Release decoder resources (no-op for software codecs)."""


CODERS: Registry = Registry("codec")
CODERS.register("identity", "kvcodec.bitstream.simple:Identity")
CODERS.register("zstd", "kvcodec.bitstream.simple:Zstd")
CODERS.register("hevc", "kvcodec.bitstream.hevc:Hevc")
CODERS.register("ans", "kvcodec.bitstream.entropy:CategoricalAns")
