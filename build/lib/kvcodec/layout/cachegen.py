"""CacheGen-style quantization, as LMCache's CacheGen serializer does it.

Matched from LMCache (``storage_backend/serde/cachegen_encoder.py``): per layer, K and V are
``[tokens, kv_heads * head_dim]``; each token's row is scaled by its own max-abs over the
channels (``amax(abs(x), dim=-1)``) and rounded to ``2C+1`` symmetric levels, ``C = bins//2 - 1``,
stored offset by ``C`` (symbols 0..2C). Bins per layer as LMCache's 7B config: keys ``bins`` in
layers 0-9 and ``bins // 2`` after, values ``bins`` in layers 0-1 and ``bins // 2`` after
(``bins=32`` is LMCache's setting). Not matched: the paper's delta-vs-anchor-token grouping
(LMCache does not implement it). The max-abs scales (float16, one per (layer, K|V, token)) are side
data ``cg_max``; the entropy coding is the ``ans`` codec's. Restore: ``(s - C) * (max / C)``, in
torch on any device.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch

from ..errors import ConfigError, CorruptChunk
from ..format.geometry import Geometry
from . import Layout
from .tensors import Planes, as_tensor, check_planes, empty, side_array, side_tensor

KEY_FIRST_LAYERS = 10
VALUE_FIRST_LAYERS = 2


class CacheGenQuant(Layout):
    name = "cg"
    version = 1

    def __init__(self, bins: int = 32) -> None:
        bins = int(bins)
        if not 8 <= bins <= 256:
            raise ConfigError(f"bins must be 8..256, got {bins}")
        self.bins = bins

    def half_range(self, layers: int) -> np.ndarray:
        """``C`` per (layer, K|V): ``[layers, 2]``."""
        b = np.full((layers, 2), self.bins // 2, dtype=np.int64)
        b[:KEY_FIRST_LAYERS, 0] = self.bins
        b[:VALUE_FIRST_LAYERS, 1] = self.bins
        return b // 2 - 1

    def planes_shape(self, g: Geometry) -> Tuple[int, int, int]:
        return (g.layers * 2, g.tokens, g.kv_heads * g.head_dim)

    def to_planes(self, kv: np.ndarray) -> Tuple[np.ndarray, Dict[str, bytes]]:
        g = Geometry.of(kv)
        x = np.asarray(kv, dtype=np.float32).transpose(0, 1, 3, 2, 4).reshape(g.layers, 2, g.tokens, -1)
        c = self.half_range(g.layers)[:, :, None, None].astype(np.float32)
        mx = np.abs(x).max(axis=3, keepdims=True).astype(np.float16).astype(np.float32)
        mx = np.where(mx > 0, mx, np.float32(1.0))
        q = np.clip(np.rint(x * (c / mx)), -c, c) + c
        planes = q.astype(np.uint8).reshape(self.planes_shape(g))
        return np.ascontiguousarray(planes), {"cg_max": mx.astype(np.float16).tobytes()}

    def from_planes_torch(self, planes: Planes, side: Dict[str, bytes], g: Geometry,
                          device: torch.device) -> torch.Tensor:
        check_planes(planes, self.planes_shape(g), np.uint8, "cg")
        try:
            mx = side_array(side, "cg_max", np.float16, (g.layers, 2, g.tokens, 1)).astype(np.float32)
        except (KeyError, ValueError) as exc:
            raise CorruptChunk(f"cg side data missing or malformed: {exc}") from None
        if not np.isfinite(mx).all():
            raise CorruptChunk("cg side data holds non-finite scales")
        c = self.half_range(g.layers)[:, :, None, None].astype(np.float32)
        shape = (g.layers, 2, g.tokens, g.kv_heads * g.head_dim)
        x = empty(shape, torch.float32, device).copy_(as_tensor(planes, device).reshape(shape))
        x.sub_(side_tensor(c, device)).mul_(side_tensor(mx / c, device))
        out = empty(shape, torch.float16, device).copy_(x)
        return out.view(g.layers, 2, g.tokens, g.kv_heads, g.head_dim).permute(0, 1, 3, 2, 4)
