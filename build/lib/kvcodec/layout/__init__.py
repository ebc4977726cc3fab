"""KV tensor <-> frames. The research on codec-friendly layouts lives here.

A ``Layout`` turns a KV chunk into planes (``[frames, height, width]``, uint8, or uint16 for the
10-bit ``pca10``) plus named side sections (quantization scales, steps, token order...), and back.
``to_planes`` may lose precision (quantization); ``from_planes`` must be exact for the planes it is
given, cheap, and return float16 ``[layers, 2, kv_heads, tokens, head_dim]`` (``native``, the
engine's own bytes, returns its ``dtype`` parameter's: float16 or float32). Layouts with
``needs_positions`` (keys before RoPE) take ``token_start`` as a keyword in both directions. Layouts
that project on a per-model codec profile take its name as the ``profile`` parameter (the model
card names it; ``format.codecs.Scheme.for_card``).

Restore is written once per layout, in torch, for any device: ``from_planes_torch(planes, side,
geometry, device, **at)`` takes the planes as numpy or as a torch tensor on any device and returns
the KV as a tensor on ``device``; its side data checks (``CorruptChunk`` / ``ForeignChunk``) run on
the host before anything is allocated on the device. ``from_planes`` (numpy in, numpy out: the
encoder side's round trips, the tests) is that same implementation on the CPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Tuple, Union

import numpy as np

from ..format.geometry import Geometry
from ..registry import Registry

if TYPE_CHECKING:
    import torch


class Layout:
    name: str = ""
    version: int = 1
    # True for layouts whose planes depend on the tokens' absolute positions (keys before RoPE):
    # their ``to_planes`` / ``from_planes`` take ``token_start`` as a keyword.
    needs_positions: bool = False

    def planes_shape(self, geometry: Geometry) -> Tuple[int, int, int]:
        raise NotImplementedError

    def to_planes(self, kv: np.ndarray) -> Tuple[np.ndarray, Dict[str, bytes]]:
        raise NotImplementedError

    def from_planes(self, planes: np.ndarray, side: Dict[str, bytes], geometry: Geometry, **at: Any) -> np.ndarray:
        """The KV chunk as float16 ``geometry.shape`` (``native``: as its ``dtype``), numpy:
        ``from_planes_torch`` on the CPU (the same memory, no copy)."""
        from .tensors import CPU

        return self.from_planes_torch(planes, side, geometry, CPU, **at).numpy()

    def from_planes_torch(self, planes: Union[np.ndarray, "torch.Tensor"], side: Dict[str, bytes],
                          geometry: Geometry, device: "torch.device", **at: Any) -> "torch.Tensor":
        """``from_planes`` as a torch tensor on ``device``, from planes on any device."""
        raise NotImplementedError


LAYOUTS: Registry = Registry("layout")
LAYOUTS.register("q8", "kvcodec.layout.quant:PerChannel8")
LAYOUTS.register("native", "kvcodec.layout.native:NativeBytes")
LAYOUTS.register("qn", "kvcodec.layout.nlevel:PerChannelN")
LAYOUTS.register("cg", "kvcodec.layout.cachegen:CacheGenQuant")
LAYOUTS.register("pca", "kvcodec.layout.transform:PcaUniform")
LAYOUTS.register("pca10", "kvcodec.layout.transform:PcaVideo")
LAYOUTS.register("kvtc", "kvcodec.layout.kvtc:KvtcLayout")


def get_layout(name: str, **params) -> Layout:
    """The layout ``name`` made with its parameters (``levels``, ``bins``, ``dtype``...); none for q8."""
    return LAYOUTS.get(name)(**params)
