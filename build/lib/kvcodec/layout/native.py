"""The engine's own KV bytes as planes: the no-compression rung (LMCache's naive serde).

Parameter ``dtype`` ("float16" or "float32", the engine's KV dtype from its model card): the
values are stored as that dtype, little-endian, each one's bytes side by side in uint8 planes
``[layers * 2, tokens, kv_heads * head_dim * itemsize]``; ``from_planes`` returns that dtype,
bit for bit (float32 for float32: the one layout that does not restore float16). Restore (torch,
any device) reads the bytes as the dtype in place (torch runs on little-endian hosts only) and
copies them once, so the KV never shares memory with the planes.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch

from ..errors import ForeignChunk
from ..format.geometry import Geometry
from . import Layout
from .tensors import TORCH_OF, Planes, as_tensor, check_planes, empty

DTYPES: Dict[str, np.dtype] = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4")}


class NativeBytes(Layout):
    name = "native"
    version = 1

    def __init__(self, dtype: str) -> None:
        if dtype not in DTYPES:
            raise ForeignChunk(f"layout native: dtype {dtype!r} is not one this build reads ({', '.join(DTYPES)})")
        self.dtype = str(dtype)
        self.wire = DTYPES[self.dtype]  # little-endian, as stored
        self.out = TORCH_OF[np.dtype(self.dtype)]  # as restored

    def planes_shape(self, g: Geometry) -> Tuple[int, int, int]:
        return (g.layers * 2, g.tokens, g.kv_heads * g.head_dim * self.wire.itemsize)

    def to_planes(self, kv: np.ndarray) -> Tuple[np.ndarray, Dict[str, bytes]]:
        g = Geometry.of(kv)
        data = np.ascontiguousarray(np.asarray(kv, dtype=self.wire).transpose(0, 1, 3, 2, 4))
        return data.view(np.uint8).reshape(self.planes_shape(g)), {}

    def from_planes_torch(self, planes: Planes, side: Dict[str, bytes], g: Geometry,
                          device: torch.device) -> torch.Tensor:
        check_planes(planes, self.planes_shape(g), np.uint8, f"native {self.dtype}")
        data = as_tensor(planes, device).contiguous().view(self.out)  # the bytes as values, in place
        kv = empty((g.layers, 2, g.tokens, g.kv_heads, g.head_dim), self.out, device)  # the planes' order
        kv.view(-1).copy_(data.view(-1))
        return kv.permute(0, 1, 3, 2, 4)
