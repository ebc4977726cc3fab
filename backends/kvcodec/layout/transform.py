"""The transform layout (``pca``): a per-model PCA basis, one uniform step per (layer, K|V).

For each (layer, K|V) a token's KV vector (all KV heads side by side, ``C = kv_heads * head_dim``
values; keys with RoPE undone at their absolute positions) is centred on the profile's mean and
projected on the profile's PCA basis. Every coefficient of that (layer, K|V) is quantized with
the same step: ``step / 1000`` times that (layer, K|V)'s RMS on the fit set, times
``sqrt(kv_balance)`` for keys and ``1 / sqrt(kv_balance)`` for values (in an orthonormal basis a
uniform step spreads the error evenly, close to the rate-optimal allocation when the step is
small against the leading components; the trailing components round to zero). ``kv_balance`` 2
was measured better than 1 (values are the more sensitive: 0.0076 against 0.0108 mean KL at the
same 3.8x on two texts, ``perf/results/README.md``).

Planes: the signed integers, zig-zag mapped to 16 bits and split in two byte planes (low bytes,
then high bytes), each frame one (layer, K|V) with the ``C`` coefficients as rows (leading
components first) and the tokens as columns, so zeros of the trailing components run together.
Restore is one batched matrix product, an add, and RoPE re-applied (no per-token loops).
Side data: the profile digest (``pca_profile``) and the float32 steps (``pca_step``).
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from ..errors import ConfigError, CorruptChunk, ForeignChunk
from ..geometry import Geometry
from ..profiles import DEFAULT_PROFILE, Profile, load_profile
from ..profiles.rope import rope, unrope
from . import Layout

LIMIT = 32767


def zigzag(q: np.ndarray) -> np.ndarray:
    q = q.astype(np.int32)
    return ((q << 1) ^ (q >> 31)).astype(np.uint16)


def unzigzag(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.int32)
    return (z >> 1) ^ -(z & 1)


class PcaUniform(Layout):
    name = "pca"
    version = 1
    needs_positions = True

    def __init__(self, profile: str = DEFAULT_PROFILE, step: int = 160, kv_balance: float = 2.0) -> None:
        step = int(step)
        if not 1 <= step <= 10000:
            raise ConfigError(f"step must be 1..10000 (thousandths of the layer RMS), got {step}")
        kv_balance = float(kv_balance)
        if not 0.01 <= kv_balance <= 100:
            raise ConfigError(f"kv_balance must be 0.01..100, got {kv_balance}")
        self.profile_name = str(profile)
        self.step = step
        self.kv_balance = kv_balance
        self._profile = None

    @property
    def profile(self) -> Profile:
        if self._profile is None:
            self._profile = load_profile(self.profile_name)
        return self._profile

    def _checked(self, g: Geometry) -> Profile:
        p = self.profile
        if not p.fits(g.layers, g.kv_heads, g.head_dim):
            raise ConfigError(f"codec profile {p.name} is for {p.layers} layers x {p.kv_heads} heads x {p.head_dim}, "
                              f"not this model's {g.layers} x {g.kv_heads} x {g.head_dim}")
        return p

    def planes_shape(self, g: Geometry) -> Tuple[int, int, int]:
        return (g.layers * 2 * 2, g.kv_heads * g.head_dim, g.tokens)

    def steps(self, p: Profile) -> np.ndarray:
        split = np.array([np.sqrt(self.kv_balance), 1.0 / np.sqrt(self.kv_balance)], dtype=np.float64)
        return (p.rms * (self.step / 1000.0) * split[None, :]).astype(np.float32)

    def to_planes(self, kv: np.ndarray, token_start: int = 0) -> Tuple[np.ndarray, Dict[str, bytes]]:
        g = Geometry.of(kv)
        p = self._checked(g)
        x = np.array(kv, dtype=np.float32)
        x[:, 0] = unrope(x[:, 0], token_start, p.rope_theta)
        X = x.transpose(0, 1, 3, 2, 4).reshape(g.layers, 2, g.tokens, p.channels)
        coeff = np.matmul(X - p.mean[:, :, None, :], p.basis)  # [L, 2, T, C]
        step = self.steps(p)
        q = np.clip(np.rint(coeff / step[:, :, None, None]), -LIMIT, LIMIT)
        z = zigzag(q).transpose(0, 1, 3, 2).reshape(g.layers * 2, p.channels, g.tokens)  # coefficient-major
        planes = np.concatenate([(z & 0xFF).astype(np.uint8), (z >> 8).astype(np.uint8)])
        side = {"pca_profile": p.digest.encode(), "pca_step": step.tobytes()}
        return np.ascontiguousarray(planes), side

    def from_planes(self, planes: np.ndarray, side: Dict[str, bytes], g: Geometry, token_start: int = 0) -> np.ndarray:
        want = self.planes_shape(g)
        if planes.shape != want or planes.dtype != np.uint8:
            raise CorruptChunk(f"pca planes are {planes.dtype}{planes.shape}, expected uint8{want}")
        p = self._checked(g)
        if side.get("pca_profile") != p.digest.encode():
            raise ForeignChunk(f"chunk was made with another {p.name} codec profile than this build ships")
        try:
            step = np.frombuffer(side["pca_step"], dtype=np.float32).reshape(g.layers, 2)
        except (KeyError, ValueError) as exc:
            raise CorruptChunk(f"pca side data missing or malformed: {exc}") from None
        if not np.isfinite(step).all():
            raise CorruptChunk("pca side data holds non-finite steps")
        half = g.layers * 2
        z = planes[:half].astype(np.uint16) | (planes[half:].astype(np.uint16) << 8)
        q = unzigzag(z).reshape(g.layers, 2, p.channels, g.tokens)
        coeff = q.astype(np.float32) * step[:, :, None, None]  # [L, 2, C, T]
        X = np.matmul(p.basis, coeff) + p.mean[:, :, :, None]  # [L, 2, C, T] = B @ coeff (B^T inverse)
        x = X.reshape(g.layers, 2, g.kv_heads, g.head_dim, g.tokens).transpose(0, 1, 2, 4, 3)
        out = np.empty(g.shape, dtype=np.float16)
        out[:, 0] = rope(np.ascontiguousarray(x[:, 0]), token_start, p.rope_theta)
        out[:, 1] = x[:, 1]
        return out
