"""Per-channel 8-bit quantization, one frame per (layer, K|V), tokens as rows.

For every (layer, K|V, head, channel) the values over the chunk's tokens are mapped linearly
onto 0..255 with that channel's minimum and step (both stored as float16 side data, and the
quantization uses the float16-rounded values so that restore is exact for given planes). A frame
is ``tokens`` rows by ``kv_heads * head_dim`` columns.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from ..errors import CorruptChunk
from ..format.geometry import Geometry
from . import Layout


class PerChannel8(Layout):
    name = "q8"
    version = 1

    def planes_shape(self, g: Geometry) -> Tuple[int, int, int]:
        return (g.layers * 2, g.tokens, g.kv_heads * g.head_dim)

    def to_planes(self, kv: np.ndarray) -> Tuple[np.ndarray, Dict[str, bytes]]:
        g = Geometry.of(kv)
        x = np.asarray(kv, dtype=np.float32)
        lo = x.min(axis=3, keepdims=True).astype(np.float16).astype(np.float32)
        hi = x.max(axis=3, keepdims=True)
        step = ((hi - lo) / 255.0).astype(np.float16).astype(np.float32)
        step = np.where(step > 0, step, np.float32(1.0)).astype(np.float16).astype(np.float32)
        q = np.clip(np.rint((x - lo) / step), 0, 255).astype(np.uint8)  # [L,2,H,T,D]
        planes = q.transpose(0, 1, 3, 2, 4).reshape(self.planes_shape(g))
        side = {
            "q8_min": lo.astype(np.float16).tobytes(),
            "q8_step": step.astype(np.float16).tobytes(),
        }
        return np.ascontiguousarray(planes), side

    def from_planes(self, planes: np.ndarray, side: Dict[str, bytes], g: Geometry) -> np.ndarray:
        want = self.planes_shape(g)
        if planes.shape != want or planes.dtype != np.uint8:
            raise CorruptChunk(f"q8 planes are {planes.dtype}{planes.shape}, expected uint8{want}")
        scale_shape = (g.layers, 2, g.kv_heads, 1, g.head_dim)
        try:
            lo = np.frombuffer(side["q8_min"], dtype=np.float16).reshape(scale_shape).astype(np.float32)
            step = np.frombuffer(side["q8_step"], dtype=np.float16).reshape(scale_shape).astype(np.float32)
        except (KeyError, ValueError) as exc:
            raise CorruptChunk(f"q8 side data missing or malformed: {exc}") from None
        q = planes.reshape(g.layers, 2, g.tokens, g.kv_heads, g.head_dim).transpose(0, 1, 3, 2, 4)
        return (q.astype(np.float32) * step + lo).astype(np.float16)
