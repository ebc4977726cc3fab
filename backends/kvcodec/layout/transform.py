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

from typing import Dict, Optional, Tuple

import numpy as np

from ..errors import ConfigError, CorruptChunk, ForeignChunk
from ..format.geometry import Geometry
from ..profiles import Profile, load_profile
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

    def __init__(self, profile: Optional[str] = None, step: int = 160, kv_balance: float = 2.0) -> None:
        step = int(step)
        if not 1 <= step <= 10000:
            raise ConfigError(f"step must be 1..10000 (thousandths of the layer RMS), got {step}")
        kv_balance = float(kv_balance)
        if not 0.01 <= kv_balance <= 100:
            raise ConfigError(f"kv_balance must be 0.01..100, got {kv_balance}")
        self.profile_name = profile
        self.step = step
        self.kv_balance = kv_balance
        self._profile = None

    @property
    def profile(self) -> Profile:
        if self._profile is None:
            if not self.profile_name:
                raise ConfigError(f"layout {self.name} needs a codec profile: the engine's model card names it")
            self._profile = load_profile(str(self.profile_name))
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

    def coefficients(self, kv: np.ndarray, token_start: int) -> Tuple[Geometry, Profile, np.ndarray]:
        """The chunk on the profile's basis: float32 ``[layers, 2, tokens, C]`` (keys unroped)."""
        g = Geometry.of(kv)
        p = self._checked(g)
        x = np.array(kv, dtype=np.float32)
        x[:, 0] = unrope(x[:, 0], token_start, p.rope_theta)
        X = x.transpose(0, 1, 3, 2, 4).reshape(g.layers, 2, g.tokens, p.channels)
        return g, p, np.matmul(X - p.mean[:, :, None, :], p.basis)

    def checked_profile(self, side: Dict[str, bytes], g: Geometry) -> Profile:
        p = self._checked(g)
        if side.get("pca_profile") != p.digest.encode():
            raise ForeignChunk(f"chunk was made with another {p.name} codec profile than this build ships")
        return p

    def read_steps(self, side: Dict[str, bytes], g: Geometry) -> np.ndarray:
        try:
            step = np.frombuffer(side["pca_step"], dtype=np.float32).reshape(g.layers, 2)
        except (KeyError, ValueError) as exc:
            raise CorruptChunk(f"pca side data missing or malformed: {exc}") from None
        if not np.isfinite(step).all():
            raise CorruptChunk("pca side data holds non-finite steps")
        return step

    def restore_kv(self, q: np.ndarray, basis: np.ndarray, offset: np.ndarray, p: Profile, g: Geometry,
                   token_start: int) -> np.ndarray:
        """Float16 KV from the stored integers ``q`` ``[layers, 2, C, tokens]``: ``basis @ q + offset``
        (the layout's scales folded into ``basis``, its centre into ``offset``), RoPE re-applied."""
        X = synthesize(basis, q, offset)
        x = X.reshape(g.layers, 2, g.kv_heads, g.head_dim, g.tokens).transpose(0, 1, 2, 4, 3)
        out = np.empty(g.shape, dtype=np.float16)
        out[:, 0] = rope(np.ascontiguousarray(x[:, 0]), token_start, p.rope_theta)
        out[:, 1] = x[:, 1]
        return out

    def to_planes(self, kv: np.ndarray, token_start: int = 0) -> Tuple[np.ndarray, Dict[str, bytes]]:
        g, p, coeff = self.coefficients(kv, token_start)
        step = self.steps(p)
        q = np.clip(np.rint(coeff / step[:, :, None, None]), -LIMIT, LIMIT)
        z = zigzag(q).transpose(0, 1, 3, 2).reshape(g.layers * 2, p.channels, g.tokens)  # coefficient-major
        planes = np.concatenate([(z & 0xFF).astype(np.uint8), (z >> 8).astype(np.uint8)])
        side = {"pca_profile": p.digest.encode(), "pca_step": step.tobytes()}
        return np.ascontiguousarray(planes), side

    def opened(self, planes: np.ndarray, side: Dict[str, bytes], g: Geometry, dtype) -> Tuple[Profile, np.ndarray]:
        """The profile and the steps a chunk's planes restore with, once its planes are checked."""
        want = self.planes_shape(g)
        if planes.shape != want or planes.dtype != dtype:
            raise CorruptChunk(f"{self.name} planes are {planes.dtype}{planes.shape}, "
                               f"expected {np.dtype(dtype).name}{want}")
        return self.checked_profile(side, g), self.read_steps(side, g)

    def from_planes(self, planes: np.ndarray, side: Dict[str, bytes], g: Geometry, token_start: int = 0) -> np.ndarray:
        p, step = self.opened(planes, side, g, np.uint8)
        half = g.layers * 2
        z = planes[:half].astype(np.uint16) | (planes[half:].astype(np.uint16) << 8)
        q = unzigzag(z).reshape(g.layers, 2, p.channels, g.tokens)
        return self.restore_kv(q, p.basis * step[:, :, None, None], p.mean, p, g, token_start)


class PcaVideo(PcaUniform):
    """``pca10``: the same coefficients as 10-bit luma samples for a lossy video codec.

    Each coefficient is divided by a fine step (``step`` thousandths of its (layer, K|V) RMS, the
    ``kv_balance`` split as above) and centred on 512; the video codec's own quantizer (its QP)
    then does the coarse quantization, on 2-D transforms of the (coefficient, token) plane. A
    component whose values would leave 0..1023 at that step is scaled down by a power of two for
    that chunk (side data ``pca_shift``, one byte per (layer, K|V, component); the leading
    components of some layers need it). Planes: ``uint16 [layers * 2, C, tokens]`` (10-bit).

    ``reorder=1`` puts the chunk's tokens in the order of a greedy nearest-neighbour chain (on
    their coefficients, in fine steps, over every layer), so that neighbouring columns look alike
    and the codec's intra prediction has something to predict; the order is side data
    (``pca_order``, two bytes a token) and restore undoes it with one gather.
    """

    name = "pca10"
    version = 1
    CENTRE = 512
    HALF = 511

    def __init__(self, profile: Optional[str] = None, step: int = 40, kv_balance: float = 2.0,
                 reorder: int = 0) -> None:
        super().__init__(profile=profile, step=step, kv_balance=kv_balance)
        if int(reorder) not in (0, 1):
            raise ConfigError(f"reorder must be 0 or 1, got {reorder}")
        self.reorder = int(reorder)

    def planes_shape(self, g: Geometry) -> Tuple[int, int, int]:
        return (g.layers * 2, g.kv_heads * g.head_dim, g.tokens)

    def to_planes(self, kv: np.ndarray, token_start: int = 0) -> Tuple[np.ndarray, Dict[str, bytes]]:
        g, p, coeff = self.coefficients(kv, token_start)
        step = self.steps(p)
        c = coeff.transpose(0, 1, 3, 2) / step[:, :, None, None]  # [L, 2, C, T], in fine steps
        side = {"pca_profile": p.digest.encode(), "pca_step": step.tobytes()}
        if self.reorder:
            order = chain_order(c.reshape(-1, g.tokens).T)
            c = c[..., order]
            side["pca_order"] = order.astype("<u2").tobytes()
        peak = np.abs(c).max(axis=3)
        shift = np.ceil(np.log2(np.maximum(peak, 1e-9) / self.HALF)).clip(0, 15).astype(np.uint8)
        q = np.rint(c / np.exp2(shift)[..., None]) + self.CENTRE
        planes = np.clip(q, 0, 2 * self.HALF + 1).astype(np.uint16).reshape(self.planes_shape(g))
        side["pca_shift"] = shift.tobytes()
        return np.ascontiguousarray(planes), side

    def from_planes(self, planes: np.ndarray, side: Dict[str, bytes], g: Geometry, token_start: int = 0) -> np.ndarray:
        p, step = self.opened(planes, side, g, np.uint16)
        try:
            shift = np.frombuffer(side["pca_shift"], dtype=np.uint8).reshape(g.layers, 2, p.channels)
        except (KeyError, ValueError) as exc:
            raise CorruptChunk(f"pca10 side data missing or malformed: {exc}") from None
        if int(shift.max(initial=0)) > 15:
            raise CorruptChunk("pca10 side data holds a shift above 15")
        scale = step[:, :, None] * np.exp2(shift).astype(np.float32)  # [L, 2, C]
        q = planes.reshape(g.layers, 2, p.channels, g.tokens)
        if self.reorder:
            q = q[..., self._inverse_order(side, g.tokens)]  # the gather on 2-byte samples
        # basis @ ((q - 512) * scale) + mean, with the scale folded into the basis' columns and
        # the centre into the offset: one matrix product over the samples as they come
        basis = p.basis * scale[:, :, None, :]
        offset = p.mean - self.CENTRE * basis.sum(axis=-1)
        return self.restore_kv(q, basis, offset, p, g, token_start)

    @staticmethod
    def _inverse_order(side: Dict[str, bytes], tokens: int) -> np.ndarray:
        try:
            order = np.frombuffer(side["pca_order"], dtype="<u2").astype(np.int64)
        except (KeyError, ValueError) as exc:
            raise CorruptChunk(f"pca10 side data has no readable token order: {exc}") from None
        if order.size != tokens or not np.array_equal(np.sort(order), np.arange(tokens)):
            raise CorruptChunk("pca10 token order is not a permutation of the chunk's tokens")
        inverse = np.empty_like(order)
        inverse[order] = np.arange(tokens)
        return inverse


def synthesize(basis: np.ndarray, coeff: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """``basis @ coeff + offset[..., None]`` in float32, batched over (layer, K|V), by torch's matmul
    (about twice numpy's on this CPU)."""
    import torch

    b = torch.from_numpy(np.ascontiguousarray(basis, dtype=np.float32))
    c = torch.from_numpy(np.ascontiguousarray(coeff)).to(torch.float32)
    out = torch.matmul(b, c)
    out += torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32))[..., None]
    return out.numpy()


def chain_order(x: np.ndarray) -> np.ndarray:
    """A greedy nearest-neighbour chain through the rows of ``x`` ``[n, d]``, from row 0."""
    n = x.shape[0]
    sq = np.einsum("ij,ij->i", x, x)
    dist = sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)
    taken = np.zeros(n, dtype=bool)
    order = np.empty(n, dtype=np.int64)
    cur = 0
    for i in range(n):
        order[i] = cur
        taken[cur] = True
        if i + 1 < n:
            row = np.where(taken, np.inf, dist[cur])
            cur = int(np.argmin(row))
    return order
