"""Bits per PCA component: greedy reverse water-filling on a codec profile's fitted variances
(optionally times its sensitivity weights), and the Gaussian-optimal uniform step of each bit count.

Used by the ``kvtc`` layout (its quantizer) and by the transform layouts' ``alloc`` parameter (the
allocation's steps as each component's step, so that one uniform step, or one video QP, spends
bits as the allocation says; 0-bit components are dropped).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..profiles import Profile
from .tensors import Cached

MAX_BITS = 6
# The optimum uniform quantizer for a unit Gaussian with 2**b levels: its step and its mean squared
# error (Max 1960, table of uniform quantizers); b = 0 restores the mean (error = the variance).
STEP = np.array([0.0, 1.5958, 0.9957, 0.5860, 0.3352, 0.1881, 0.1041, 0.0569, 0.0308])
MSE = np.array([1.0, 0.3634, 0.1188, 0.03744, 0.01154, 0.003504, 0.001050, 0.0003110, 0.0000904])


def allocate(variance: np.ndarray, budget: int, max_bits: int = MAX_BITS) -> np.ndarray:
    """Integer bits 0..max_bits per entry of ``variance`` summing to at most ``budget``: greedy
    reverse water-filling (each bit to the entry whose expected error falls most)."""
    v = np.maximum(np.asarray(variance, dtype=np.float64).ravel(), 0.0)
    gains = v[None, :] * (MSE[:max_bits] - MSE[1:max_bits + 1])[:, None]  # [bit level b -> b+1, entry]
    # Each entry's gains fall with b (convex curves), so taking the ``budget`` largest gains over
    # all (b, entry) pairs takes every entry's bits in order: the greedy allocation, at once.
    budget = int(min(max(budget, 0), gains.size))
    bits = np.zeros(v.size, dtype=np.int64)
    if budget:
        top = np.argpartition(-gains.ravel(), budget - 1)[:budget]
        np.add.at(bits, top % v.size, 1)
    return bits.reshape(np.shape(variance))


class Allocation(NamedTuple):
    bits: np.ndarray  # int64 [layers, 2, C]
    step: np.ndarray  # float32 [layers, 2, C]: the Gaussian-optimal step of its bits (0 for 0 bits)


_ALLOCATIONS = Cached(limit=16)


def allocation(p: Profile, hundredths: int, weighted: bool) -> Allocation:
    """The allocation of ``hundredths / 100`` bits per coefficient on average over ``p``'s components
    (variances times ``p.weight`` if ``weighted``); made once per profile and parameters."""
    def make() -> Allocation:
        variance = p.variance.astype(np.float64) * (p.weight if weighted else 1.0)
        bits = allocate(variance, int(hundredths) * variance.size // 100)
        step = (STEP[bits] * np.sqrt(np.maximum(p.variance, 0.0))).astype(np.float32)
        return Allocation(bits, step)
    return _ALLOCATIONS.get((p.name, p.digest, int(hundredths), bool(weighted)), make)
