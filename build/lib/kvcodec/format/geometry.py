"""Shapes shared by the layout, the codecs and the engines.

A KV chunk is a float array ``[layers, 2, kv_heads, tokens, head_dim]`` (index 0 of axis 1 is the
keys, 1 the values), in the layout the transformers engine produces; the TensorRT-LLM connector
converts to its paged pool layout at its edge.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict

import numpy as np

from ..errors import BadRequest, CorruptChunk


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int
    tokens: int

    @property
    def shape(self) -> tuple:
        return (self.layers, 2, self.kv_heads, self.tokens, self.head_dim)

    @property
    def fp16_bytes(self) -> int:
        return int(np.prod(self.shape)) * 2

    def to_dict(self) -> Dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Geometry":
        values = {k: d.get(k) if isinstance(d, dict) else None for k in ("layers", "kv_heads", "head_dim", "tokens")}
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values.values()):
            raise CorruptChunk(f"bad geometry in chunk header: {d!r}"[:300])
        return cls(**values)

    @classmethod
    def of(cls, kv: np.ndarray) -> "Geometry":
        if kv.ndim != 5 or kv.shape[1] != 2:
            raise BadRequest(f"KV must be [layers, 2, heads, tokens, head_dim], got shape {kv.shape}")
        layers, _, heads, tokens, dim = kv.shape
        return cls(layers=layers, kv_heads=heads, head_dim=dim, tokens=tokens)
