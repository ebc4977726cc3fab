"""Bitstream codecs: planes <-> bytes.

A ``BitstreamCodec`` is built from keyword parameters (recorded in the chunk header and bound
into the chunk key), encodes ``uint8 [frames, height, width]`` planes to bytes and decodes them
back to the same shape. Lossless codecs return the planes bit-exactly. Decoders that need a
device (NVDEC) are made once, when the codec object is made, and released by ``close``.

Registered here, imported on first use: ``identity``, ``zstd``, ``hevc`` (software x265 encode;
decode by ``decoder="pyav"`` in software or ``decoder="nvdec"`` on an NVIDIA GPU).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import numpy as np

from ..registry import Registry


class BitstreamCodec:
    name: str = ""

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


CODECS: Registry = Registry("codec")
CODECS.register("identity", "kvcodec.codec.simple:Identity")
CODECS.register("zstd", "kvcodec.codec.simple:Zstd")
CODECS.register("hevc", "kvcodec.codec.hevc:Hevc")
CODECS.register("ans", "kvcodec.codec.entropy:CategoricalAns")
