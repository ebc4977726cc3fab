"""KV chunk <-> container bytes, in the three stages the serving pipeline runs apart.

- ``ChunkEncoder.encode(kv, ...)``      ingest: layout + codec + container (once per context)
- ``ChunkDecoder.decode(data, key)``    serving step ``kv_decode``: verify, decode to planes
- ``restore(header, planes)``           serving step ``kv_restore``: planes -> float16 KV

``decode`` raises ``CorruptChunk`` (checksum, header or bitstream) or ``ForeignChunk`` (another
model, key or an unknown codec identity); the caller turns either into a miss from that chunk on.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import container
from .codec import CODECS, BitstreamCodec
from .container import Container
from .errors import CorruptChunk, ForeignChunk, Unsupported
from .geometry import Geometry
from .layout import get_layout
from .schemes import SCHEMES, Scheme

PAYLOAD = "payload"
PLANE_DTYPES = {"uint8": np.uint8, "uint16": np.dtype("<u2")}


@dataclass
class Decoded:
    header: Container  # the chunk without its payload: geometry, layout, side data
    planes: np.ndarray


def planes_digest(planes: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(planes).tobytes(), digest_size=16).hexdigest()


def _make_codec(scheme: Scheme, **runtime: Any) -> BitstreamCodec:
    """The scheme's codec; runtime options (decoder, threads) go only to codecs that take them."""
    cls = CODECS.get(scheme.codec)
    accepted = {k: v for k, v in runtime.items() if k in getattr(cls, "RUNTIME_OPTIONS", ())}
    return cls(**scheme.codec_params, **accepted)


class ChunkEncoder:
    def __init__(self, scheme: Scheme, model_id: str, threads: int = 1) -> None:
        self.scheme = scheme
        self.model_id = model_id
        self.layout = get_layout(scheme.layout, **scheme.layout_params)
        self.codec = _make_codec(scheme, threads=threads)

    def encode(self, kv: np.ndarray, key: str, chunk_index: int, token_start: int) -> bytes:
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
        }
        if planes.dtype != np.uint8:
            header["planes_dtype"] = planes.dtype.name  # 10-bit layouts: uint16 samples
        payload = self.codec.encode(planes)
        t0 = time.perf_counter()
        decoded = self.codec.decode(payload, planes.shape)
        self.last_decode_s = time.perf_counter() - t0  # what a reader on this machine pays (costs.py)
        if self.codec.lossless and not np.array_equal(decoded, planes):
            raise RuntimeError(f"{self.scheme.name}: the lossless codec did not return its planes exactly")
        # The digest of what a decoder must return: it catches a damaged bitstream that still
        # decodes, and any decoder (NVDEC or software) that is not bit-exact.
        header["planes_digest"] = planes_digest(decoded)
        sections = dict(side)
        sections[PAYLOAD] = payload
        return Container(header, sections).to_bytes()


class ChunkDecoder:
    """Decodes chunks of any registered scheme; one codec object per scheme, made on first use."""

    def __init__(self, model_id: str, decoder: str = "pyav", threads: int = 1) -> None:
        self.model_id = model_id
        self._runtime = {"decoder": decoder, "threads": threads}
        self._codecs: Dict[str, BitstreamCodec] = {}

    def _codec_for(self, header: Dict[str, Any]) -> BitstreamCodec:
        identity = header.get("scheme_id")
        if identity not in self._codecs:
            base = SCHEMES.get(header.get("scheme"))
            params = header.get("codec_params")
            if base is None or not isinstance(params, dict):
                raise ForeignChunk(f"chunk codec {identity!r} is not one this build reads")
            scheme = replace(base, codec_params=params, layout_params=header.get("layout_params") or {})
            if scheme.identity != identity:
                raise ForeignChunk(f"chunk codec {identity!r} is not one this build reads")
            try:
                self._codecs[identity] = _make_codec(scheme, **self._runtime)
            except TypeError as exc:
                raise ForeignChunk(f"chunk codec settings {params!r} not understood: {exc}") from None
        return self._codecs[identity]

    def decode(self, data: bytes, key: Optional[str] = None) -> Decoded:
        chunk = container.parse(data)
        chunk.expect(model_id=self.model_id)
        if key is not None:
            chunk.expect(key=key)
        if PAYLOAD not in chunk.sections:
            raise CorruptChunk("chunk has no payload")
        shape = _shape3(chunk.header.get("planes_shape"))
        planes = self._codec_for(chunk.header).decode(chunk.sections[PAYLOAD], shape)
        if planes_digest(planes) != chunk.header.get("planes_digest"):
            raise CorruptChunk("decoded planes do not match the digest taken at ingest")
        return Decoded(chunk.without(PAYLOAD), planes)

    def close(self) -> None:
        for codec in self._codecs.values():
            codec.close()
        self._codecs.clear()


def _shape3(value: Any) -> Tuple[int, int, int]:
    try:
        shape = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        shape = ()
    if len(shape) != 3 or min(shape) <= 0:
        raise CorruptChunk(f"bad planes shape in chunk header: {value!r}")
    return shape  # type: ignore[return-value]


def restore(header: Container, planes: np.ndarray) -> np.ndarray:
    """Float16 KV ``[layers, 2, kv_heads, tokens, head_dim]`` from a decoded chunk."""
    g = Geometry.from_dict(header.header.get("geometry") or {})
    name = header.header.get("layout")
    params = header.header.get("layout_params") or {}
    try:
        layout = get_layout(name, **params)
    except Unsupported:
        raise ForeignChunk(f"chunk layout {name!r} is not one this build reads") from None
    except (TypeError, ValueError) as exc:
        raise ForeignChunk(f"chunk layout {name} settings {params!r} not understood: {exc}") from None
    if header.header.get("layout_version") != layout.version:
        raise ForeignChunk(f"chunk layout {name} v{header.header.get('layout_version')}, this build reads v{layout.version}")
    shape = tuple(header.header.get("planes_shape") or ())
    if planes.ndim == 1:  # flat bytes, as they cross the ensemble
        dtype = header.header.get("planes_dtype", "uint8")
        if dtype not in PLANE_DTYPES:
            raise CorruptChunk(f"bad planes dtype in chunk header: {dtype!r}")
        try:
            planes = np.ascontiguousarray(planes, dtype=np.uint8).view(PLANE_DTYPES[dtype]).reshape(shape)
        except ValueError as exc:
            raise CorruptChunk(f"planes do not fit the header's shape {shape}: {exc}") from None
    if layout.needs_positions:
        token_start = header.header.get("token_start")
        if not isinstance(token_start, int) or token_start < 0:
            raise CorruptChunk(f"bad token_start in chunk header: {token_start!r}")
        return layout.from_planes(planes, header.sections, g, token_start=token_start)
    return layout.from_planes(planes, header.sections, g)
