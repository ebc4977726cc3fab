"""Raw float16 bytes as planes: the no-compression baseline (LMCache's naive serde)."""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from ..errors import CorruptChunk
from ..format.geometry import Geometry
from . import Layout


class Fp16Bytes(Layout):
    name = "fp16"
    version = 1

    def planes_shape(self, g: Geometry) -> Tuple[int, int, int]:
        return (g.layers * 2, g.tokens, g.kv_heads * g.head_dim * 2)

    def to_planes(self, kv: np.ndarray) -> Tuple[np.ndarray, Dict[str, bytes]]:
        g = Geometry.of(kv)
        data = np.ascontiguousarray(np.asarray(kv, dtype="<f2").transpose(0, 1, 3, 2, 4))
        return data.view(np.uint8).reshape(self.planes_shape(g)), {}

    def from_planes(self, planes: np.ndarray, side: Dict[str, bytes], g: Geometry) -> np.ndarray:
        want = self.planes_shape(g)
        if planes.shape != want or planes.dtype != np.uint8:
            raise CorruptChunk(f"fp16 planes are {planes.dtype}{planes.shape}, expected uint8{want}")
        kv = np.ascontiguousarray(planes).view("<f2").reshape(g.layers, 2, g.tokens, g.kv_heads, g.head_dim)
        return kv.transpose(0, 1, 3, 2, 4).astype(np.float16)
