"""The per-chunk work of the ``kv_decode`` and ``kv_restore`` serving steps.

Both take a ``ChunkInfo`` and never raise for a bad chunk: they mark it failed (a miss from that
chunk on) and pass empty arrays along, so one bad chunk never fails the request.
"""
from __future__ import annotations

import logging
import time
from typing import Tuple

import numpy as np

from . import container
from .chunk import ChunkDecoder, restore
from .chunkinfo import ChunkInfo
from .errors import ChunkError, ForeignChunk, KVCodecError

log = logging.getLogger(__name__)
EMPTY_U8 = np.zeros(0, dtype=np.uint8)
EMPTY_KV = np.zeros((0, 2, 0, 0, 0), dtype=np.float16)


def _status(exc: Exception) -> str:
    return "foreign" if isinstance(exc, ForeignChunk) else "corrupt" if isinstance(exc, ChunkError) else "error"


class DecodeStep:
    """Bitstream -> planes. Holds one decoder per codec, made once."""

    def __init__(self, model_id: str, decoder: str = "pyav", threads: int = 1) -> None:
        self.decoder = ChunkDecoder(model_id, decoder=decoder, threads=threads)

    def run(self, info: ChunkInfo, data: bytes) -> Tuple[ChunkInfo, np.ndarray, bytes]:
        """Returns (info, planes as flat uint8 bytes, the chunk's header container without payload)."""
        info.t["received"] = time.time()
        if not info.ok or not data:
            return info, EMPTY_U8, b""
        t0 = time.perf_counter()
        try:
            decoded = self.decoder.decode(data, key=info.key or None)
            out = info, np.ascontiguousarray(decoded.planes).view(np.uint8).reshape(-1), decoded.header.to_bytes()
        except (KVCodecError, ValueError) as exc:
            if not isinstance(exc, KVCodecError):
                log.exception("unexpected decode failure")
            out = info.fail(_status(exc), f"decode: {exc}"), EMPTY_U8, b""
        info.s["decode"] = time.perf_counter() - t0
        info.t["decoded"] = time.time()
        return out

    def close(self) -> None:
        self.decoder.close()


class RestoreStep:
    """Planes -> float16 KV ``[layers, 2, kv_heads, tokens, head_dim]``."""

    def run(self, info: ChunkInfo, planes: np.ndarray, header: bytes) -> Tuple[ChunkInfo, np.ndarray]:
        if not info.ok or not len(header):
            return info, EMPTY_KV
        t0 = time.perf_counter()
        try:
            kv = restore(container.parse(bytes(header)), planes)
            if kv.shape[3] != info.tokens:
                raise ForeignChunk(f"chunk holds {kv.shape[3]} tokens, expected {info.tokens}")
            out = info, kv
        except (KVCodecError, ValueError) as exc:
            out = info.fail(_status(exc), f"restore: {exc}"), EMPTY_KV
        info.s["restore"] = time.perf_counter() - t0
        info.t["restored"] = time.time()
        return out
