"""``ChunkEncoder``: one KV chunk -> container bytes (layout, bitstream coder, header, digests).

Used by ingest (once per context) and by the quality harness. The reading side is
``serving.decode`` (bytes -> planes) and ``serving.restore`` (planes -> KV).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from . import __version__
from .bitstream import CODERS, BitstreamCoder
from .format.auth import ChunkAuth
from .format.codecs import Scheme
from .format.container import Container, planes_digest
from .format.geometry import Geometry
from .layout import get_layout

PAYLOAD = "payload"


def make_coder(scheme: Scheme, **runtime: Any) -> BitstreamCoder:
    """The scheme's bitstream coder; runtime options (decoder, threads) go only to coders that take them."""
    cls = CODERS.get(scheme.codec)
    accepted = {k: v for k, v in runtime.items() if k in getattr(cls, "RUNTIME_OPTIONS", ())}
    return cls(**scheme.codec_params, **accepted)


class ChunkEncoder:
    """Encodes chunks of one scheme for one model, signed with ``auth`` (``format.auth``)."""

    def __init__(self, scheme: Scheme, model_id: str, *, auth: ChunkAuth, threads: int = 1) -> None:
        self.scheme = scheme
        self.model_id = model_id
        self.auth = auth
        self.layout = get_layout(scheme.layout, **scheme.layout_params)
        self.codec = make_coder(scheme, threads=threads)
        self.last_decode_s = 0.0
        self.last_restore_s = 0.0

    def encode(self, kv: np.ndarray, key: str, chunk_index: int, token_start: int, tenant: str = "") -> bytes:
        """``tenant``: ``format.keys.tenant_id`` of the request's cache salt ("" unsalted): the header names
        it, and an encrypted chunk is sealed with that tenant's key (``format.auth``)."""
        g = Geometry.of(kv)
        at = {"token_start": int(token_start)} if self.layout.needs_positions else {}
        planes, side = self.layout.to_planes(kv, **at)
        header = {
            "model_id": self.model_id,
            "scheme": self.scheme.name,
            "scheme_id": self.scheme.identity,
            "layout": self.layout.name,
            "layout_version": self.layout.version,
            "layout_params": self.scheme.layout_params,
            "codec": self.scheme.codec,
            "codec_params": self.scheme.codec_params,
            "key": key,
            "chunk_index": int(chunk_index),
            "token_start": int(token_start),
            "geometry": g.to_dict(),
            "planes_shape": list(planes.shape),
            "writer": f"kvcodec/{__version__}",  # the release that wrote it (informational; covered by the tag)
        }
        if tenant:
            header["tenant"] = tenant
        if planes.dtype != np.uint8:
            header["planes_dtype"] = planes.dtype.name  # 10-bit layouts: uint16 samples
        payload = self.codec.encode(planes)
        t0 = time.perf_counter()
        decoded = self.codec.decode(payload, planes.shape)
        self.last_decode_s = time.perf_counter() - t0  # what a reader on this machine pays (serving.costs)
        if self.codec.lossless and not np.array_equal(decoded, planes):
            raise RuntimeError(f"{self.scheme.name}: the lossless codec did not return its planes exactly")
        # The digest of what a decoder must return: it catches a damaged bitstream that still
        # decodes, and any decoder (NVDEC or software) that is not bit-exact.
        header["planes_digest"] = planes_digest(decoded)
        self.last_restore_s = self._time_restore(decoded, side, g, at)
        sections = dict(side)
        sections[PAYLOAD] = payload
        return Container(header, sections).to_bytes(self.auth)

    def _time_restore(self, decoded: np.ndarray, side: dict, geometry: Geometry, at: dict) -> float:
        """Seconds to restore the decoded planes to KV on this machine's CPU, as a reader's restore step
        does (``serving.restore``): what write-back and ingest tell the cost model (``serving.costs``)."""
        from .layout.tensors import CPU

        t0 = time.perf_counter()
        self.layout.from_planes_torch(decoded, dict(side), geometry, CPU, **at)
        return time.perf_counter() - t0

