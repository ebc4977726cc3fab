"""``ans``: planes entropy-coded with one symbol distribution per (frame, column), CacheGen-style.

Each (frame, column) of ``uint8 [frames, rows, columns]`` planes (for the ``cg`` layout: a
(layer, K|V) and a channel, over the chunk's tokens) gets its own categorical distribution: the
symbol counts over the rows. The counts travel in the payload (zstd-compressed ``uint16``
tables) and the symbols are coded with constriction's ANS coder (24-bit precision), one model per
(frame, column), decoded by batch (all rows of a column in one call).

Payload: ``<u32 frames, u32 columns, u32 alphabet, u32 table bytes> | zstd(counts) | ANS words``.
The decoder refuses tables whose shape or per-column sums do not match the planes (corrupt side
data) and a stream that does not end exactly where it should.
"""
from __future__ import annotations

import struct
from typing import Tuple

import numpy as np

from ..errors import CorruptChunk
from . import BitstreamCoder

_HEAD = struct.Struct("<IIII")


class CategoricalAns(BitstreamCoder):
    name = "ans"

    def __init__(self) -> None:
        super().__init__()
        import constriction
        import zstandard

        self._c = constriction
        self._zstd = zstandard

    def _models(self, counts: np.ndarray):
        Categorical = self._c.stream.model.Categorical
        probs = counts.astype(np.float64)
        probs /= probs.sum(axis=-1, keepdims=True)
        return probs, Categorical

    def encode(self, planes: np.ndarray) -> bytes:
        frames, rows, cols = planes.shape
        k = int(planes.max()) + 1
        sym = np.ascontiguousarray(planes.transpose(0, 2, 1)).reshape(frames * cols, rows)
        counts = np.zeros((frames * cols, k), dtype=np.uint16)
        np.add.at(counts, (np.repeat(np.arange(frames * cols), rows), sym.reshape(-1)), 1)
        probs, Categorical = self._models(counts)
        coder = self._c.stream.stack.AnsCoder()
        sym32 = sym.astype(np.int32)
        for i in range(frames * cols - 1, -1, -1):  # a stack: encode backwards, decode forwards
            coder.encode_reverse(sym32[i], Categorical(probs[i], perfect=False))
        words = coder.get_compressed().astype("<u4").tobytes()
        table = self._zstd.ZstdCompressor(level=19).compress(counts.astype("<u2").tobytes())
        return _HEAD.pack(frames, cols, k, len(table)) + table + words

    def decode(self, data: bytes, shape: Tuple[int, int, int]) -> np.ndarray:
        frames, rows, cols = shape
        if len(data) < _HEAD.size:
            raise CorruptChunk("ans payload too short")
        f, c, k, tlen = _HEAD.unpack_from(data)
        if (f, c) != (frames, cols) or not 1 <= k <= 256 or _HEAD.size + tlen > len(data):
            raise CorruptChunk(f"ans payload header {(f, c, k, tlen)} does not fit planes {tuple(shape)}")
        try:
            raw = self._zstd.ZstdDecompressor().decompress(data[_HEAD.size:_HEAD.size + tlen],
                                                         max_output_size=f * c * k * 2)
        except self._zstd.ZstdError as exc:
            raise CorruptChunk(f"ans distribution table: {exc}") from None
        if len(raw) != f * c * k * 2:
            raise CorruptChunk("ans distribution table has the wrong size")
        counts = np.frombuffer(raw, dtype="<u2").reshape(f * c, k)
        if not (counts.sum(axis=1, dtype=np.int64) == rows).all():
            raise CorruptChunk("ans distribution table does not sum to the rows of each column")
        words = data[_HEAD.size + tlen:]
        if len(words) % 4:
            raise CorruptChunk("ans stream is not whole 32-bit words")
        probs, Categorical = self._models(counts)
        out = np.empty((f * c, rows), dtype=np.uint8)
        try:
            coder = self._c.stream.stack.AnsCoder(np.frombuffer(words, dtype="<u4").astype(np.uint32))
            for i in range(f * c):
                out[i] = coder.decode(Categorical(probs[i], perfect=False), rows)
        except Exception as exc:  # constriction raises plain exceptions on a broken stream
            raise CorruptChunk(f"ans stream: {exc}") from None
        if not coder.is_empty():
            raise CorruptChunk("ans stream has data left after the last symbol")
        return np.ascontiguousarray(out.reshape(frames, cols, rows).transpose(0, 2, 1))
