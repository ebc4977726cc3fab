"""Rotary position embedding (the Llama / Hugging Face ``rotate_half`` convention) in numpy.

``unrope`` turns cached keys back into the keys before RoPE; ``rope`` applies it again. Both take
keys ``[..., tokens, head_dim]`` at absolute positions ``token_start + 0..tokens-1``; the angles
are computed in float64, so ``rope(unrope(k))`` returns ``k`` to rounding.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np


def _cos_sin(tokens: int, head_dim: int, token_start: int, theta: float) -> Tuple[np.ndarray, np.ndarray]:
    inv_freq = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    pos = np.arange(token_start, token_start + tokens, dtype=np.float64)
    freqs = np.outer(pos, inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rope(k: np.ndarray, token_start: int, theta: float) -> np.ndarray:
    cos, sin = _cos_sin(k.shape[-2], k.shape[-1], token_start, theta)
    cos, sin = cos.astype(k.dtype, copy=False), sin.astype(k.dtype, copy=False)
    return k * cos + _rotate_half(k) * sin


def unrope(k: np.ndarray, token_start: int, theta: float) -> np.ndarray:
    cos, sin = _cos_sin(k.shape[-2], k.shape[-1], token_start, theta)
    cos, sin = cos.astype(k.dtype, copy=False), sin.astype(k.dtype, copy=False)
    return k * cos - _rotate_half(k) * sin
