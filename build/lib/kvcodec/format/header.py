"""``ChunkHeader``: the typed, checked header of one stored chunk.

The container (``format.container``) carries the header as JSON; ``ChunkHeader.from_dict`` reads
it once, checks every field a reader relies on (types, ranges, the planes' shape and sample type,
the geometry) and raises ``CorruptChunk`` naming the field otherwise. Checks come before any
allocation: a header that claims more planes than its geometry can need is corrupt, not a buffer.

The same record, with the chunk's side data, is the restore descriptor that ``kv_decode`` hands
to ``kv_restore`` (``to_json`` / ``from_json``): the digests were verified once, at decode.

Fields (as stored)::

    model_id, key, chunk_index, token_start      what and where (bound into the chunk key)
    scheme, scheme_id                            the codec (user-facing name) and its identity
    layout, layout_version, layout_params        KV <-> planes
    codec, codec_params                          the bitstream coder and its settings
    geometry                                     {layers, kv_heads, head_dim, tokens}
    planes_shape, planes_dtype, planes_digest    what a decoder must return
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Tuple

import numpy as np

from ..errors import CorruptChunk
from .geometry import Geometry

PLANE_DTYPES: Dict[str, np.dtype] = {"uint8": np.dtype(np.uint8), "uint16": np.dtype("<u2")}
MAX_PLANE_SIDE = 1 << 14  # NVDEC's and x265's largest picture side is 8192; nothing we write is larger
PLANES_PER_KV_VALUE = 4  # the largest planes any layout makes, in samples per KV value (pca: 2 byte planes x 2)


def _int(d: Mapping[str, Any], name: str, lo: int = 0, hi: int = 1 << 31) -> int:
    value = d.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise CorruptChunk(f"bad {name} in chunk header: {value!r}")
    return value


def _str(d: Mapping[str, Any], name: str) -> str:
    value = d.get(name)
    if not isinstance(value, str):
        raise CorruptChunk(f"bad {name} in chunk header: {value!r}")
    return value


def _params(d: Mapping[str, Any], name: str) -> Dict[str, Any]:
    value = d.get(name) or {}
    if not isinstance(value, dict):
        raise CorruptChunk(f"bad {name} in chunk header: {value!r}")
    return value


def planes_shape_of(value: Any) -> Tuple[int, int, int]:
    ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    shape = tuple(value) if ok else ()
    if len(shape) != 3 or min(shape) <= 0 or max(shape[1:]) > MAX_PLANE_SIDE:
        raise CorruptChunk(f"bad planes shape in chunk header: {value!r}")
    return shape  # type: ignore[return-value]


@dataclass(frozen=True)
class ChunkHeader:
    model_id: str
    key: str
    chunk_index: int
    token_start: int
    scheme: str
    scheme_id: str
    layout: str
    layout_version: int
    layout_params: Dict[str, Any]
    codec: str
    codec_params: Dict[str, Any]
    geometry: Geometry
    planes_shape: Tuple[int, int, int]
    planes_dtype: np.dtype
    planes_digest: str
    extra: Dict[str, Any] = field(default_factory=dict)  # fields this build does not read, kept as written

    @property
    def planes_nbytes(self) -> int:
        return int(np.prod(self.planes_shape)) * self.planes_dtype.itemsize

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ChunkHeader":
        """The checked header; ``CorruptChunk`` naming the first field that does not fit."""
        if not isinstance(d, Mapping):
            raise CorruptChunk("chunk header is not an object")
        g = Geometry.from_dict(d.get("geometry") if isinstance(d.get("geometry"), dict) else {})
        if min(g.layers, g.kv_heads, g.head_dim, g.tokens) <= 0 or max(g.layers, g.kv_heads, g.head_dim) > 4096 \
                or g.tokens > 1 << 16:
            raise CorruptChunk(f"bad geometry in chunk header: {d.get('geometry')!r}")
        shape = planes_shape_of(d.get("planes_shape"))
        dtype_name = d.get("planes_dtype", "uint8")
        if not isinstance(dtype_name, str) or dtype_name not in PLANE_DTYPES:
            raise CorruptChunk(f"bad planes dtype in chunk header: {dtype_name!r}")
        values = g.layers * 2 * g.kv_heads * g.tokens * g.head_dim
        if int(np.prod(shape)) > PLANES_PER_KV_VALUE * values:
            raise CorruptChunk(f"planes shape {list(shape)} is larger than geometry {g.to_dict()} needs")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        return cls(
            model_id=_str(d, "model_id"), key=_str(d, "key"), chunk_index=_int(d, "chunk_index"),
            token_start=_int(d, "token_start"), scheme=_str(d, "scheme"), scheme_id=_str(d, "scheme_id"),
            layout=_str(d, "layout"), layout_version=_int(d, "layout_version"),
            layout_params=_params(d, "layout_params"), codec=_str(d, "codec"), codec_params=_params(d, "codec_params"),
            geometry=g, planes_shape=shape, planes_dtype=PLANE_DTYPES[dtype_name],
            planes_digest=_str(d, "planes_digest"),
            extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> Dict[str, Any]:
        out = dict(self.extra)
        out.update(model_id=self.model_id, key=self.key, chunk_index=self.chunk_index, token_start=self.token_start,
                   scheme=self.scheme, scheme_id=self.scheme_id, layout=self.layout,
                   layout_version=self.layout_version, layout_params=self.layout_params, codec=self.codec,
                   codec_params=self.codec_params, geometry=self.geometry.to_dict(),
                   planes_shape=list(self.planes_shape), planes_digest=self.planes_digest)
        if self.planes_dtype != np.uint8:
            out["planes_dtype"] = self.planes_dtype.name  # 10-bit layouts: uint16 samples
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: Any) -> "ChunkHeader":
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", "replace")
        try:
            d = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise CorruptChunk(f"chunk header unreadable: {exc}") from None
        return cls.from_dict(d)
