"""Byte-level codecs: ``identity`` (no compression) and ``zstd``.

``zstd`` payloads come in two forms, both of standard zstd frames (RFC 8878, each with its content
size, as python-zstandard writes them):

- ``frame_kb`` 0 (the default; every rung's today): the planes' bytes as one zstd frame;
- ``frame_kb`` N: the planes' bytes cut into pieces of N KiB, each its own zstd frame, behind a
  table of their compressed sizes: ``<u32 frames> <u32 size> * frames | frames...``. Independent
  frames are what a GPU decoder decodes side by side (nvCOMP's batched zstd: one frame a CUDA
  block group, ``bitstream.nvcomp``); one large frame is decoded by one.

Decoding is split in two: ``Zstd.frames(data)`` cuts a payload into its zstd frames (and checks
the table), then an *entropy decoder* (``bitstream.decoders.ENTROPY_DECODERS``: ``cpu``,
``ZstdCpuDecoder`` here, or ``nvcomp`` on a GPU) decodes them into the planes' bytes:
``decode(frames, size)`` -> ``size`` bytes, 1-D ``uint8`` (numpy, or a torch tensor on its device).
``Zstd.decode_with(decoder, data, shape)`` is the planes from any such decoder; ``Zstd.decode``
uses the CPU one.
"""
from __future__ import annotations

import struct
from typing import Any, List, Sequence, Tuple

import numpy as np

from ..errors import CorruptChunk
from . import BitstreamCoder

_COUNT = struct.Struct("<I")
MAX_FRAME_KB = 1 << 14  # 16 MiB: nvCOMP's largest zstd chunk


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


class ZstdCpuDecoder:
    """The entropy decoder on the host: python-zstandard, frame by frame into one buffer."""

    name = "cpu"
    device_output = False

    def __init__(self) -> None:
        import zstandard

        self._zstd = zstandard
        self._decompressor = zstandard.ZstdDecompressor()

    def decode(self, frames: Sequence[Any], size: int) -> np.ndarray:
        out = np.empty(int(size), dtype=np.uint8)
        at = 0
        try:
            for frame in frames:
                if self._zstd.frame_content_size(frame) > int(size) - at:  # before allocating it (-1: unknown)
                    raise CorruptChunk(f"zstd frames hold more than the {size} bytes expected for the planes")
                piece = self._decompressor.decompress(frame, max_output_size=int(size) - at)
                if at + len(piece) > size:
                    raise CorruptChunk(f"zstd frames hold more than the {size} bytes expected for the planes")
                out[at:at + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
                at += len(piece)
        except self._zstd.ZstdError as exc:
            raise CorruptChunk(f"zstd: {exc} (expected {size} bytes of planes)") from None
        if at != size:
            raise CorruptChunk(f"decoded {at} bytes, expected {size}")
        return out

    def close(self) -> None:
        pass


class Zstd(BitstreamCoder):
    name = "zstd"

    def __init__(self, level: int = 3, frame_kb: int = 0) -> None:
        if not isinstance(frame_kb, int) or isinstance(frame_kb, bool) or not 0 <= frame_kb <= MAX_FRAME_KB:
            raise ValueError(f"zstd frame_kb must be 0..{MAX_FRAME_KB} (KiB per frame; 0: one frame), got {frame_kb!r}")
        extra = {"frame_kb": int(frame_kb)} if frame_kb else {}  # only when set: identities without it stay
        super().__init__(level=level, **extra)
        self._level = int(level)
        self.frame_kb = int(frame_kb)
        self._cpu: Any = None  # python-zstandard, made on first CPU decode: a GPU machine may not have it

    def encode(self, planes: np.ndarray) -> bytes:
        import zstandard

        raw = memoryview(np.ascontiguousarray(planes, dtype=np.uint8)).cast("B")
        compressor = zstandard.ZstdCompressor(level=self._level)
        if not self.frame_kb:
            return compressor.compress(raw)
        step = self.frame_kb * 1024
        frames = [compressor.compress(raw[at:at + step]) for at in range(0, len(raw), step)]
        table = struct.pack(f"<I{len(frames)}I", len(frames), *(len(f) for f in frames))
        return table + b"".join(frames)

    def frames(self, data: Any) -> List[memoryview]:
        """The payload's zstd frames (views of ``data``)."""
        view = memoryview(data).cast("B")
        if not self.frame_kb:
            return [view]
        if len(view) < _COUNT.size:
            raise CorruptChunk("zstd frame table is missing")
        (count,) = _COUNT.unpack_from(view)
        start = _COUNT.size * (1 + count)
        if not 0 < count <= len(view) // 8 or start > len(view):
            raise CorruptChunk(f"zstd frame table of {count} frames does not fit the {len(view)}-byte payload")
        sizes = struct.unpack_from(f"<{count}I", view, _COUNT.size)
        if start + sum(sizes) != len(view):
            raise CorruptChunk("zstd frame table does not add up to the payload")
        out, at = [], start
        for n in sizes:
            out.append(view[at:at + n])
            at += n
        return out

    def decode_with(self, decoder: Any, data: Any, shape: Tuple[int, int, int]) -> Any:
        """Planes ``shape`` decoded by the entropy decoder ``decoder`` (numpy, or a tensor on its device)."""
        size = int(np.prod(shape))
        frames = self.frames(data)
        if self.frame_kb and len(frames) != -(-size // (self.frame_kb * 1024)):
            raise CorruptChunk(f"zstd payload holds {len(frames)} frames, planes {tuple(shape)} make "
                               f"{-(-size // (self.frame_kb * 1024))}")
        out = decoder.decode(frames, size)
        if tuple(out.shape) != (size,):
            raise CorruptChunk(f"entropy decoder {getattr(decoder, 'name', '?')} returned {tuple(out.shape)} "
                               f"bytes, expected {size}")
        return out.reshape(shape)

    def decode(self, data: bytes, shape: Tuple[int, int, int]) -> np.ndarray:
        if self._cpu is None:
            self._cpu = ZstdCpuDecoder()
        return self.decode_with(self._cpu, data, shape)
