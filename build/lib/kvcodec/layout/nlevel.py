"""Per-channel N-level uniform quantization (the ``nlevel-zstd`` baseline).

As ``q8`` (one frame per (layer, K|V), tokens as rows, ``kv_heads * head_dim`` columns), but each
(layer, K|V, head, channel) is mapped onto ``levels`` values 0..levels-1 with its float16 minimum
and step (side data ``qn_min`` / ``qn_step``). Restore is ``q * step + min``, in torch on any
device (``quant.per_channel``, as ``q8``).
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch

from ..errors import ConfigError, CorruptChunk
from ..format.geometry import Geometry
from . import Layout
from .quant import per_channel
from .tensors import Planes, check_planes, side_array


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


class PerChannelN(Layout):
    name = "qn"
    version = 1

    def __init__(self, levels: int = 32) -> None:
        levels = int(levels)
        if not 2 <= levels <= 256:
            raise ConfigError(f"levels must be 2..256, got {levels}")
        self.levels = levels

    def planes_shape(self, g: Geometry) -> Tuple[int, int, int]:
        return (g.layers * 2, g.tokens, g.kv_heads * g.head_dim)

    def to_planes(self, kv: np.ndarray) -> Tuple[np.ndarray, Dict[str, bytes]]:
        g = Geometry.of(kv)
        x = np.asarray(kv, dtype=np.float32)
        top = self.levels - 1
        lo = _f16(x.min(axis=3, keepdims=True))
        step = _f16((x.max(axis=3, keepdims=True) - lo) / top)
        step = np.where(step > 0, step, np.float32(1.0))
        q = np.clip(np.rint((x - lo) / step), 0, top).astype(np.uint8)
        planes = q.transpose(0, 1, 3, 2, 4).reshape(self.planes_shape(g))
        side = {"qn_min": lo.astype(np.float16).tobytes(), "qn_step": step.astype(np.float16).tobytes()}
        return np.ascontiguousarray(planes), side

    def from_planes_torch(self, planes: Planes, side: Dict[str, bytes], g: Geometry,
                          device: torch.device) -> torch.Tensor:
        check_planes(planes, self.planes_shape(g), np.uint8, "qn")
        shape = (g.layers, 2, g.kv_heads, 1, g.head_dim)
        try:
            lo = side_array(side, "qn_min", np.float16, shape).astype(np.float32)
            step = side_array(side, "qn_step", np.float16, shape).astype(np.float32)
        except (KeyError, ValueError) as exc:
            raise CorruptChunk(f"qn side data missing or malformed: {exc}") from None
        if not (np.isfinite(lo).all() and np.isfinite(step).all()):
            raise CorruptChunk("qn side data holds non-finite scales")
        return per_channel(planes, lo, step, g, device)
