"""Restore on the device with torch, for the GPU checks: planes already on the GPU -> float16 KV on
the GPU, with no trip through host memory.

The library's restore (``kvcodec.serving.restore``) is numpy on the host: planes must come back
from the GPU, and the KV goes back up to it. This is the same arithmetic in torch, for the two
layouts of the video rungs, written here (not in the library) to measure what moving restore to
the device would give:

- ``q8`` (``lossless8``, ``video-q8``): ``q * step + min`` per (layer, K|V, head, channel);
- ``pca10`` (``video``): the token order undone by one gather, ``basis @ q + offset`` with the
  scale (times the profile's per-component factors) folded into the basis and the centre into the
  offset (as ``PcaVideo.from_planes``), RoPE re-applied to the keys at their absolute positions,
  the exact sink tokens written over their columns.

It reads the side data with the layout's own checks (profile digest, steps) and returns what the
library would return to float16 rounding: the checks compare the two (max difference, share of
values bit-equal). The profile's basis and mean go to the device once per profile and device.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch

from kvcodec.errors import CorruptChunk
from kvcodec.format.header import ChunkHeader
from kvcodec.layout import get_layout

_PROFILES: Dict[Tuple[str, str], tuple] = {}
_ROPE: Dict[tuple, tuple] = {}
LAYOUTS = ("q8", "pca10")


def planes_to_device(planes: np.ndarray, device):
    """Host planes as a torch tensor on ``device``, as NVDEC would leave them in device memory:
    uint8, or the 10-bit samples' 16-bit words as int16 (torch's uint16 has few kernels)."""
    planes = np.array(planes, order="C")  # a writable copy (decoded planes may be read-only views)
    return torch.from_numpy(planes.view(np.int16) if planes.dtype == np.uint16 else planes).to(device)


def planes_to_host(planes) -> np.ndarray:
    """``planes_to_device`` undone: the numpy planes the library's restore takes (uint16 again)."""
    host = planes.cpu().numpy()
    return host.view(np.uint16) if host.dtype == np.int16 else host


def _samples(planes):
    """The planes' samples as float32 (16-bit words read unsigned)."""
    if planes.dtype in (torch.int16, torch.uint16):
        return (planes.view(torch.int16).to(torch.int32) & 0xFFFF).to(torch.float32)
    return planes.to(torch.float32)


def _profile(layout, g, side, device):
    p = layout.checked_profile(side, g)  # the chunk's profile digest against the shipped file
    key = (p.digest, str(device))
    if key not in _PROFILES:
        _PROFILES[key] = (torch.from_numpy(np.ascontiguousarray(p.basis, np.float32)).to(device),
                          torch.from_numpy(np.ascontiguousarray(p.mean, np.float32)).to(device))
    return p, _PROFILES[key]


def _cos_sin(tokens: int, head_dim: int, token_start: int, theta: float, device):
    """cos and sin ``[tokens, head_dim]`` float32 on ``device``; angles in float64 as in
    ``kvcodec.profiles.rope``."""
    key = (tokens, head_dim, token_start, float(theta), str(device))
    if key not in _ROPE:
        inv_freq = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        freqs = np.outer(np.arange(token_start, token_start + tokens, dtype=np.float64), inv_freq)
        emb = np.concatenate([freqs, freqs], axis=-1)
        _ROPE[key] = (torch.from_numpy(np.cos(emb).astype(np.float32)).to(device),
                      torch.from_numpy(np.sin(emb).astype(np.float32)).to(device))
    return _ROPE[key]


def _rope(k, token_start: int, theta: float):
    cos, sin = _cos_sin(k.shape[-2], k.shape[-1], token_start, theta, k.device)
    half = k.shape[-1] // 2
    rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return k * cos + rotated * sin


def _q8(header: ChunkHeader, planes, side: Dict[str, bytes]):
    g = header.geometry
    scale_shape = (g.layers, 2, g.kv_heads, 1, g.head_dim)
    try:
        lo = np.frombuffer(side["q8_min"], dtype=np.float16).reshape(scale_shape)
        step = np.frombuffer(side["q8_step"], dtype=np.float16).reshape(scale_shape)
    except (KeyError, ValueError) as exc:
        raise CorruptChunk(f"q8 side data missing or malformed: {exc}") from None
    lo_d = torch.from_numpy(lo.astype(np.float32)).to(planes.device)
    step_d = torch.from_numpy(step.astype(np.float32)).to(planes.device)
    q = _samples(planes).reshape(g.layers, 2, g.tokens, g.kv_heads, g.head_dim).permute(0, 1, 3, 2, 4)
    return (q * step_d + lo_d).to(torch.float16)


def _pca10(header: ChunkHeader, planes, side: Dict[str, bytes]):
    g = header.geometry
    layout = get_layout(header.layout, **header.layout_params)
    p, (basis_d, mean_d) = _profile(layout, g, side, planes.device)
    step = layout.read_steps(side, g)
    try:
        shift = np.frombuffer(side["pca_shift"], dtype=np.uint8).reshape(g.layers, 2, p.channels)
    except (KeyError, ValueError) as exc:
        raise CorruptChunk(f"pca10 side data missing or malformed: {exc}") from None
    # each component's step: the layout's factors (1, or 1 / sqrt(weight) for a weighted profile)
    scale = torch.from_numpy(step[:, :, None] * layout.factors(p) * np.exp2(shift).astype(np.float32)).to(planes.device)
    index, kept = layout.read_exact(side, g, header.token_start)  # sink tokens, kept as float16
    q = _samples(planes).reshape(g.layers, 2, p.channels, g.tokens)
    if layout.reorder:
        order = np.frombuffer(side["pca_order"], dtype="<u2").astype(np.int64)
        if order.size != g.tokens or not np.array_equal(np.sort(order), np.arange(g.tokens)):
            raise CorruptChunk("pca10 token order is not a permutation of the chunk's tokens")
        inverse = np.empty_like(order)
        inverse[order] = np.arange(g.tokens)
        q = q.index_select(3, torch.from_numpy(inverse).to(planes.device))
    basis = basis_d * scale[:, :, None, :]
    offset = mean_d - layout.CENTRE * basis.sum(dim=-1)
    x = torch.matmul(basis, q) + offset[..., None]  # [L, 2, C, T]
    x = x.reshape(g.layers, 2, g.kv_heads, g.head_dim, g.tokens).transpose(3, 4)
    out = torch.empty(g.shape, dtype=torch.float16, device=planes.device)
    out[:, 0] = _rope(x[:, 0].contiguous(), header.token_start, p.rope_theta)
    out[:, 1] = x[:, 1]
    if len(index):
        out[:, :, :, torch.from_numpy(index).to(planes.device)] = torch.from_numpy(kept.copy()).to(planes.device)
    return out


def restore_torch(header: ChunkHeader, planes, side: Dict[str, bytes]):
    """Float16 KV ``[layers, 2, kv_heads, tokens, head_dim]`` on the planes' device, from planes
    as ``planes_to_device`` leaves them."""
    if tuple(planes.shape) != header.planes_shape:
        raise CorruptChunk(f"planes are {tuple(planes.shape)}, the header says {header.planes_shape}")
    if header.layout in LAYOUTS and header.layout_version != get_layout(header.layout, **header.layout_params).version:
        raise CorruptChunk(f"chunk layout {header.layout} v{header.layout_version} is not the one written here")
    if header.layout == "q8":
        return _q8(header, planes, side)
    if header.layout == "pca10":
        return _pca10(header, planes, side)
    raise ValueError(f"no torch restore for layout {header.layout!r} (have {', '.join(LAYOUTS)})")
