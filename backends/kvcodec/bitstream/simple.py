"""Byte-level codecs: ``identity`` (no compression) and ``zstd``."""
from __future__ import annotations

from typing import Tuple

import numpy as np

from ..errors import CorruptChunk
from . import BitstreamCoder


def _as_planes(data: bytes, shape: Tuple[int, int, int]) -> np.ndarray:
    want = int(np.prod(shape))
    if len(data) != want:
        raise CorruptChunk(f"decoded {len(data)} bytes, expected {want} for planes {tuple(shape)}")
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


class Identity(BitstreamCoder):
    name = "identity"
    verbatim = True

    def encode(self, planes: np.ndarray) -> bytes:
        return np.ascontiguousarray(planes, dtype=np.uint8).tobytes()

    def decode(self, data: bytes, shape: Tuple[int, int, int]) -> np.ndarray:
        return _as_planes(data, shape)


class Zstd(BitstreamCoder):
    name = "zstd"

    def __init__(self, level: int = 3) -> None:
        super().__init__(level=level)
        import zstandard

        self._zstd = zstandard
        self._level = int(level)
        self._decompressor = zstandard.ZstdDecompressor()

    def encode(self, planes: np.ndarray) -> bytes:
        raw = np.ascontiguousarray(planes, dtype=np.uint8).tobytes()
        return self._zstd.ZstdCompressor(level=self._level).compress(raw)

    def decode(self, data: bytes, shape: Tuple[int, int, int]) -> np.ndarray:
        try:
            raw = self._decompressor.decompress(data, max_output_size=int(np.prod(shape)))
        except self._zstd.ZstdError as exc:
            raise CorruptChunk(f"zstd: {exc}") from None
        return _as_planes(raw, shape)
