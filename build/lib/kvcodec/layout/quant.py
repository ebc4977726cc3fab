"""Per-channel 8-bit quantization, one frame per (layer, K|V), tokens as rows.

For every (layer, K|V, head, channel) the values over the chunk's tokens are mapped linearly
onto 0..255 with that channel's minimum and step (both stored as float16 side data, and the
quantization uses the float16-rounded values so that restore is exact for given planes). A frame
is ``tokens`` rows by ``kv_heads * head_dim`` columns. Restore (torch, any device): ``q * step + min``
in float32, rounded once to float16.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch

from ..errors import CorruptChunk
from ..format.geometry import Geometry
from . import Layout
from .tensors import Planes, as_tensor, check_planes, empty, side_array, side_tensor


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

    def from_planes_torch(self, planes: Planes, side: Dict[str, bytes], g: Geometry,
                          device: torch.device) -> torch.Tensor:
        check_planes(planes, self.planes_shape(g), np.uint8, "q8")
        scale_shape = (g.layers, 2, g.kv_heads, 1, g.head_dim)
        try:
            lo = side_array(side, "q8_min", np.float16, scale_shape)
            step = side_array(side, "q8_step", np.float16, scale_shape)
        except (KeyError, ValueError) as exc:
            raise CorruptChunk(f"q8 side data missing or malformed: {exc}") from None
        return per_channel(planes, lo, step, g, device)


def per_channel(planes: Planes, lo: np.ndarray, step: np.ndarray, g: Geometry, device: torch.device) -> torch.Tensor:
    """Float16 KV ``q * step + lo`` (float32, two roundings, then one to float16) from per-channel
    planes ``[layers * 2, tokens, kv_heads * head_dim]`` and host scales ``[layers, 2, kv_heads, 1,
    head_dim]``, on ``device``, in the planes' memory order (tokens before heads); also ``qn``'s."""
    shape = (g.layers, 2, g.tokens, g.kv_heads, g.head_dim)  # the planes' order: tokens before heads
    x = empty(shape, torch.float32, device).copy_(as_tensor(planes, device).reshape(shape)).permute(0, 1, 3, 2, 4)
    x.mul_(side_tensor(step, device, np.float32)).add_(side_tensor(lo, device, np.float32))
    return empty(shape, torch.float16, device).permute(0, 1, 3, 2, 4).copy_(x)
