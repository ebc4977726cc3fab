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
Restore is one batched matrix product, an add, and RoPE re-applied (no per-token loops), in torch on
any device (``from_planes_torch``): the profile's basis and mean go to a device once (``on_device``),
RoPE's cos/sin tables once per (device, dtype, head_dim, theta) over a range of positions that grows
as needed (``rope_tables``). Side data: the profile digest (``pca_profile``) and the float32 steps
(``pca_step``).
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np
import torch

from ..errors import ConfigError, CorruptChunk, ForeignChunk
from ..format.geometry import Geometry
from ..profiles import Profile, load_profile
from ..profiles.rope import _cos_sin, unrope
from . import Layout
from .allocation import MAX_BITS, allocation
from .tensors import NUMPY_OF, Cached, Planes, as_tensor, check_planes, empty, side_tensor

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

    def __init__(self, profile: Optional[str] = None, step: int = 160, kv_balance: float = 2.0,
                 weighted: int = 0, alloc: int = 0, sink: int = 0, recent: int = 0) -> None:
        step = int(step)
        if not 1 <= step <= 10000:
            raise ConfigError(f"step must be 1..10000 (thousandths of the layer RMS), got {step}")
        kv_balance = float(kv_balance)
        if not 0.01 <= kv_balance <= 100:
            raise ConfigError(f"kv_balance must be 0.01..100, got {kv_balance}")
        if int(weighted) not in (0, 1):
            raise ConfigError(f"weighted must be 0 or 1, got {weighted}")
        if not 0 <= int(alloc) <= 100 * MAX_BITS:
            raise ConfigError(f"alloc must be 0..{100 * MAX_BITS} (hundredths of a bit per coefficient), got {alloc}")
        self.alloc = int(alloc)
        if not 0 <= int(sink) <= 1024 or not 0 <= int(recent) <= 1024:
            raise ConfigError(f"sink and recent must be 0..1024 tokens, got {sink} and {recent}")
        self.sink, self.recent = int(sink), int(recent)
        self.profile_name = profile
        self.step = step
        self.kv_balance = kv_balance
        self.weighted = int(weighted)
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
        if self.weighted and p.weight is None:
            raise ConfigError(f"codec profile {p.name} has no component weights; a weighted layout needs them")
        return p

    def factors(self, p: Profile) -> np.ndarray:
        """Each component's step relative to its (layer, K|V)'s: float32 ``[layers, 2, C]``. Ones by
        default; ``weighted``: ``1 / sqrt(weight)`` (reverse water-filling on the weighted error: the
        components where the model looks get the finer steps); ``alloc``: the steps of a bit
        allocation of ``alloc / 100`` bits per coefficient (``allocation``, weighted or not) over
        their geometric mean, and 0 for a component given no bits (dropped: restored as the mean)."""
        if self.alloc:
            step = allocation(p, self.alloc, bool(self.weighted)).step.astype(np.float64)
            kept = step > 0
            scale = np.exp(np.mean(np.log(step[kept]))) if kept.any() else 1.0
            return (step / scale).astype(np.float32)
        if not self.weighted:
            return np.ones((p.layers, 2, p.channels), dtype=np.float32)
        return (1.0 / np.sqrt(p.weight)).astype(np.float32)

    def inverse(self, p: Profile, step: np.ndarray) -> np.ndarray:
        """``1 / (step * factors)`` per component, ``[layers, 2, C]``; 0 where a component is dropped."""
        full = step[:, :, None].astype(np.float64) * self.factors(p)
        return np.where(full > 0, 1.0 / np.where(full > 0, full, 1.0), 0.0)

    def planes_shape(self, g: Geometry) -> Tuple[int, int, int]:
        return (g.layers * 2 * 2, g.kv_heads * g.head_dim, g.tokens)

    def exact_tokens(self, token_start: int, tokens: int) -> np.ndarray:
        """Indices (within the chunk) of the tokens kept as float16 in the side section ``pca_exact``:
        the context's first ``sink`` tokens (attention sinks: only in its first chunk), then each
        chunk's last ``recent`` tokens."""
        sinks = np.arange(0, max(0, min(self.sink - token_start, tokens)))
        tail = np.arange(max(tokens - self.recent, len(sinks)), tokens)
        return np.concatenate([sinks, tail]).astype(np.int64)

    def keep_exact(self, kv: np.ndarray, coeff: np.ndarray, token_start: int, side: Dict[str, bytes]) -> np.ndarray:
        """Puts the exact tokens' float16 KV in ``side`` (when there are any) and returns ``coeff``
        ``[L, 2, T, C]`` with theirs zeroed (the mean: nothing to code, and no outlier to set a
        component's range)."""
        exact = self.exact_tokens(token_start, coeff.shape[2])
        if len(exact):
            side["pca_exact"] = np.ascontiguousarray(np.asarray(kv)[:, :, :, exact, :], dtype=np.float16).tobytes()
            coeff = coeff.copy()
            coeff[:, :, exact, :] = 0
        return coeff

    def read_exact(self, side: Dict[str, bytes], g: Geometry, token_start: int) -> Tuple[np.ndarray, np.ndarray]:
        """The exact tokens' indices and their float16 KV ``[L, 2, H, n, D]`` from the side section,
        checked on the host (before anything is made on a device)."""
        exact = self.exact_tokens(token_start, g.tokens)
        if not len(exact):
            return exact, np.empty((0,), np.float16)
        try:
            kept = np.frombuffer(side["pca_exact"], dtype=np.float16).reshape(
                g.layers, 2, g.kv_heads, len(exact), g.head_dim)
        except (KeyError, ValueError) as exc:
            raise CorruptChunk(f"{self.name} side data has no readable exact tokens: {exc}") from None
        if not np.isfinite(kept).all():
            raise CorruptChunk(f"{self.name} exact tokens hold non-finite values")
        return exact, kept

    @staticmethod
    def put_exact(out: torch.Tensor, exact: Tuple[np.ndarray, np.ndarray]) -> torch.Tensor:
        """``out`` (restored KV) with the exact tokens (``read_exact``) written over their columns."""
        index, kept = exact
        if len(index):
            out[:, :, :, as_tensor(index, out.device), :] = side_tensor(kept, out.device)
        return out

    def steps(self, p: Profile) -> np.ndarray:
        """The step of each (layer, K|V), float32 ``[layers, 2]``: ``step`` thousandths of its RMS with
        the ``kv_balance`` split; ``weighted``: one step, ``step`` thousandths of the RMS over every
        (layer, K|V), the weights doing the rest (``kv_balance`` unused)."""
        if self.weighted or self.alloc:
            rms = float(np.sqrt(np.mean(np.square(p.rms, dtype=np.float64))))
            return np.full((p.layers, 2), rms * self.step / 1000.0, dtype=np.float32)
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

    def restore_kv(self, q: torch.Tensor, basis: torch.Tensor, offset: torch.Tensor, p: Profile, g: Geometry,
                   token_start: int) -> torch.Tensor:
        """Float16 KV from the stored integers ``q`` ``[layers, 2, C, tokens]``: ``basis @ q + offset``
        (the layout's scales folded into ``basis``, its centre into ``offset``), RoPE re-applied; on
        ``q``'s device."""
        X = synthesize(basis, q, offset).view(g.layers, 2, g.kv_heads, g.head_dim, g.tokens)
        out = empty(g.shape, torch.float16, X.device)
        out[:, 0].copy_(rope_dt(X[:, 0], token_start, p.rope_theta).transpose(-1, -2))  # [.., D, T] -> [.., T, D]
        out[:, 1].copy_(X[:, 1].transpose(-1, -2))
        return out

    def to_planes(self, kv: np.ndarray, token_start: int = 0) -> Tuple[np.ndarray, Dict[str, bytes]]:
        g, p, coeff = self.coefficients(kv, token_start)
        step = self.steps(p)
        side = {"pca_profile": p.digest.encode(), "pca_step": step.tobytes()}
        coeff = self.keep_exact(kv, coeff, token_start, side)
        q = np.clip(np.rint(coeff * self.inverse(p, step)[:, :, None, :]), -LIMIT, LIMIT)
        z = zigzag(q).transpose(0, 1, 3, 2).reshape(g.layers * 2, p.channels, g.tokens)  # coefficient-major
        planes = np.concatenate([(z & 0xFF).astype(np.uint8), (z >> 8).astype(np.uint8)])
        return np.ascontiguousarray(planes), side

    def opened(self, planes: Planes, side: Dict[str, bytes], g: Geometry, dtype) -> Tuple[Profile, np.ndarray]:
        """The profile and the steps a chunk's planes restore with, once its planes are checked."""
        check_planes(planes, self.planes_shape(g), dtype, self.name)
        return self.checked_profile(side, g), self.read_steps(side, g)

    def from_planes_torch(self, planes: Planes, side: Dict[str, bytes], g: Geometry, device: torch.device,
                          token_start: int = 0) -> torch.Tensor:
        p, step = self.opened(planes, side, g, np.uint8)
        exact = self.read_exact(side, g, token_start)
        on = on_device(p, device)
        t = as_tensor(planes, device)
        half = g.layers * 2
        z = t[:half].to(torch.int32).bitwise_or_(t[half:].to(torch.int32).bitwise_left_shift_(8))
        q = unzigzag_torch(z).reshape(g.layers, 2, p.channels, g.tokens)
        basis = on.basis * side_tensor(step[:, :, None] * self.factors(p), device)[:, :, None, :]
        return self.put_exact(self.restore_kv(q, basis, on.mean, p, g, token_start), exact)


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
                 reorder: int = 0, weighted: int = 0, alloc: int = 0, sink: int = 0, recent: int = 0) -> None:
        super().__init__(profile=profile, step=step, kv_balance=kv_balance, weighted=weighted, alloc=alloc,
                         sink=sink, recent=recent)
        if int(reorder) not in (0, 1):
            raise ConfigError(f"reorder must be 0 or 1, got {reorder}")
        self.reorder = int(reorder)

    def planes_shape(self, g: Geometry) -> Tuple[int, int, int]:
        return (g.layers * 2, g.kv_heads * g.head_dim, g.tokens)

    def to_planes(self, kv: np.ndarray, token_start: int = 0) -> Tuple[np.ndarray, Dict[str, bytes]]:
        g, p, coeff = self.coefficients(kv, token_start)
        step = self.steps(p)
        side = {"pca_profile": p.digest.encode(), "pca_step": step.tobytes()}
        coeff = self.keep_exact(kv, coeff, token_start, side)
        c = coeff.transpose(0, 1, 3, 2) * self.inverse(p, step)[..., None]  # [L, 2, C, T], in fine steps
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

    def from_planes_torch(self, planes: Planes, side: Dict[str, bytes], g: Geometry, device: torch.device,
                          token_start: int = 0) -> torch.Tensor:
        p, step = self.opened(planes, side, g, np.uint16)
        try:
            shift = np.frombuffer(side["pca_shift"], dtype=np.uint8).reshape(g.layers, 2, p.channels)
        except (KeyError, ValueError) as exc:
            raise CorruptChunk(f"pca10 side data missing or malformed: {exc}") from None
        if int(shift.max(initial=0)) > 15:
            raise CorruptChunk("pca10 side data holds a shift above 15")
        inverse = self._inverse_order(side, g.tokens) if self.reorder else None
        exact = self.read_exact(side, g, token_start)
        scale = step[:, :, None] * self.factors(p) * np.exp2(shift).astype(np.float32)  # [L, 2, C], host
        on = on_device(p, device)
        q = as_tensor(planes, device).reshape(g.layers, 2, p.channels, g.tokens)
        if inverse is not None:  # the gather on 2-byte samples (as int16: uint16 has few kernels)
            q = q.view(torch.int16)[..., as_tensor(inverse, device)].view(torch.uint16)
        # basis @ ((q - 512) * scale) + mean, with the scale folded into the basis' columns and
        # the centre into the offset: one matrix product over the samples as they come
        basis = on.basis * side_tensor(scale, device)[:, :, None, :]
        offset = on.mean - self.CENTRE * basis.sum(dim=-1)
        return self.put_exact(self.restore_kv(q, basis, offset, p, g, token_start), exact)

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


def unzigzag_torch(z: torch.Tensor) -> torch.Tensor:
    """``unzigzag`` of int32 ``z`` in torch (in place)."""
    sign = (z & 1).neg_()
    return z.bitwise_right_shift_(1).bitwise_xor_(sign)


def synthesize(basis: torch.Tensor, coeff: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``basis @ coeff + offset[..., None]`` in float32, batched over (layer, K|V), on their device
    (torch's matmul: about twice numpy's on this CPU)."""
    c = empty(coeff.shape, torch.float32, coeff.device).copy_(coeff)
    out = torch.matmul(basis, c, out=empty(basis.shape[:-1] + coeff.shape[-1:], torch.float32, coeff.device))
    out += offset[..., None]
    return out


class OnDevice(NamedTuple):
    basis: torch.Tensor  # float32 [layers, 2, C, C]
    mean: torch.Tensor  # float32 [layers, 2, C]


_ON_DEVICE = Cached(limit=8)


def on_device(p: Profile, device: torch.device) -> OnDevice:
    """The profile's basis and mean as tensors on ``device``, made once per profile (name and
    digest) and device; on the CPU they are the profile's own arrays (no copy)."""
    device = torch.device(device)
    return _ON_DEVICE.get((p.name, p.digest, device), lambda: OnDevice(
        as_tensor(np.ascontiguousarray(p.basis, np.float32), device),
        as_tensor(np.ascontiguousarray(p.mean, np.float32), device)))


class RopeKey(NamedTuple):
    device: torch.device
    dtype: torch.dtype
    head_dim: int
    theta: float
    positions: int  # the table covers positions 0..positions-1


def _rope_table(tokens: int, head_dim: int, token_start: int, theta: float, device: torch.device,
                dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    cos, sin = _cos_sin(tokens, head_dim, token_start, theta)  # float64 [tokens, head_dim]
    sin[:, :head_dim // 2] *= -1.0  # rotate_half's minus sign folded into the table (exact)
    return (as_tensor(np.ascontiguousarray(cos.T, NUMPY_OF[dtype]), device),
            as_tensor(np.ascontiguousarray(sin.T, NUMPY_OF[dtype]), device))


_ROPE = Cached(limit=16)
ROPE_CACHED = 1 << 16  # positions below this come from a cached table; above, computed per chunk


def rope_tables(tokens: int, head_dim: int, token_start: int, theta: float, device: torch.device,
                dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sign-folded sin at positions ``token_start + 0..tokens-1``, transposed:
    ``[head_dim, tokens]``: views of a table per (device, dtype, head_dim, theta) that covers positions
    0 up to a power of two, at least 4096 and at most ``ROPE_CACHED`` (later positions: made for the
    chunk alone). The float64 angles of ``profiles.rope``, rounded once to ``dtype``: the same numbers
    either way."""
    end = token_start + tokens
    if token_start < 0 or end > ROPE_CACHED:
        return _rope_table(tokens, head_dim, token_start, theta, device, dtype)
    key = RopeKey(torch.device(device), dtype, int(head_dim), float(theta), 1 << max(12, (end - 1).bit_length()))
    cos, sin = _ROPE.get(key, lambda: _rope_table(key.positions, key.head_dim, 0, key.theta, key.device, key.dtype))
    return cos[:, token_start:end], sin[:, token_start:end]


def rope_dt(k: torch.Tensor, token_start: int, theta: float) -> torch.Tensor:
    """``profiles.rope.rope`` on keys laid out ``[..., head_dim, tokens]`` (a new tensor): ``k * cos +
    rotate_half(k) * sin``, with the same roundings (rotate_half's minus sign is in the sin table)."""
    head_dim, tokens = k.shape[-2], k.shape[-1]
    cos, sin = rope_tables(tokens, head_dim, token_start, theta, k.device, k.dtype)
    half = head_dim // 2
    rotated = torch.cat((k[..., half:, :], k[..., :half, :]), dim=-2, out=empty(k.shape, k.dtype, k.device))
    out = torch.mul(k, cos, out=empty(k.shape, k.dtype, k.device))
    out += rotated.mul_(sin)
    return out


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
