"""An engine's paged KV pool, seen as canonical strided views, a K and a V view per layer.

``KVPages`` holds, per layer, two views ``[num_blocks, kv_heads, block_size, head_dim]`` (K, V) of
the engine's own memory: no copy of the pool is made, and ``write`` stores into the engine's
blocks. K and V are separate views because an engine may lay them out differently (vLLM's CPU
attention stores K transposed). The constructors recognize the engines' layouts:

- ``from_vllm(layer_tensors, kv_heads, head_dim, block_size=None, layout=None)``, one tensor per
  layer, its layout recognized from its shape, or named by ``layout``:

  - ``"cpu_attn"`` (vLLM CPU attention, 0.32): ``[num_blocks, kv_heads, block_size, 2*head_dim]``
    whose memory, per (block, head), is K transposed (``[head_dim, block_size]``: dim-major, as
    the attention kernel reads it), then V ``[block_size, head_dim]``. A row is not one token's
    ``[K|V]``, and the Python view vLLM names ``key_cache`` is not where its kernel puts K: the
    layout was measured against the transformers engine's KV of the same prompt (K max error
    6e-6, V 3e-7; the tests of the vLLM engine check it again). The last two dims must be
    contiguous. A 4-D tensor is taken as this one;
  - ``"token_kv"``: the same shape where each row is one token's ``[K|V]`` (the FlashAttention and
    FlashInfer backends of vLLM 0.3x); never guessed, name it;
  - ``"flash_attn"``: ``[2, num_blocks, block_size, kv_heads, head_dim]``;
  - ``"flashinfer"``: ``[num_blocks, 2, block_size, kv_heads, head_dim]`` (any strides, so the HND
    variant, a permuted view of ``[num_blocks, 2, kv_heads, block_size, head_dim]``, too).

  ``block_size``, if given, must match. A shape that fits no layout, or two (a 5-D pool of 2
  blocks), raises ``Unsupported`` naming the shape.
- ``from_trtllm(pool, num_layers, kv_heads, tokens_per_block, head_dim)``: TensorRT-LLM's primary
  pool ``[num_blocks, num_layers, 2, kv_heads*tokens_per_block*head_dim]``, the last dim laid out
  ``[kv_heads, tokens_per_block, head_dim]`` (HND). ``from_trtllm_pool(pool, num_layers, kv_heads,
  head_dim, tokens_per_block=None)`` reads the block size off the pool and refuses a dtype other
  than ``POOL_DTYPES``.

Token position ``p`` of a request (counted from the start of its block list) lives in block
``block_ids[p // block_size]``, slot ``p % block_size``:

- ``write(block_ids, token_start, kv)``: ``kv`` (torch or numpy, any float dtype, cast to the
  pool's) ``[layers, 2, kv_heads, n, head_dim]`` goes to positions ``[token_start, token_start+n)``,
  one indexed copy per layer. Everything is checked before anything is written (``ValueError``);
- ``read(block_ids, token_start, n)``: a copy of those positions, same shape, the pool's dtype.

Both work on the current stream and never synchronize it: the block and slot indices are built on
the host and reach a GPU from pinned memory (``non_blocking``); ``kv`` on the pool's device is copied
there without leaving it (a host ``kv`` is copied from wherever it is: pin it to keep the copy
asynchronous).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..errors import Unsupported

LAYOUTS = ("cpu_attn", "token_kv", "flash_attn", "flashinfer")
POOL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what a connector writes (no quantized KV)


KV = Tuple[torch.Tensor, torch.Tensor]  # a layer's K and V views, [num_blocks, kv_heads, block_size, head_dim]


def _cpu_attn(t: torch.Tensor, kv_heads: int, head_dim: int) -> KV:
    nb, _, bs, _ = t.shape
    if t.stride(-1) != 1 or t.stride(-2) != 2 * head_dim:
        raise Unsupported(f"vLLM CPU KV layer {tuple(t.shape)} with strides {t.stride()}: "
                          "the last two dims must be contiguous")
    halves = t.view(nb, kv_heads, 2, bs * head_dim)
    k = halves[:, :, 0].unflatten(-1, (head_dim, bs)).transpose(-1, -2)
    v = halves[:, :, 1].unflatten(-1, (bs, head_dim))
    return k, v


def _token_kv(t: torch.Tensor, kv_heads: int, head_dim: int) -> KV:
    if t.stride(-1) != 1:
        raise Unsupported(f"KV layer {tuple(t.shape)} with strides {t.stride()}: the last dim must be contiguous")
    u = t.unflatten(-1, (2, head_dim))  # [blocks, heads, bs, 2, dim]
    return u[..., 0, :], u[..., 1, :]


def _fits(t: torch.Tensor, layout: str, kv_heads: int, head_dim: int, block_size: Optional[int]) -> bool:
    s = tuple(t.shape)
    if layout in ("cpu_attn", "token_kv"):
        return len(s) == 4 and s[1] == kv_heads and s[3] == 2 * head_dim and block_size in (None, s[2])
    two = 0 if layout == "flash_attn" else 1
    return len(s) == 5 and s[two] == 2 and s[3] == kv_heads and s[4] == head_dim and block_size in (None, s[2])


def _vllm_view(t: torch.Tensor, kv_heads: int, head_dim: int, block_size: Optional[int],
               layout: Optional[str]) -> torch.Tensor:
    if layout is not None and layout not in LAYOUTS:
        raise Unsupported(f"unknown vLLM KV layout {layout!r} (known: {', '.join(LAYOUTS)})")
    guess = [layout] if layout else [name for name in LAYOUTS if name != "token_kv"]
    fits = [name for name in guess if _fits(t, name, kv_heads, head_dim, block_size)]
    geometry = f"kv_heads={kv_heads}, head_dim={head_dim}, block_size={block_size}"
    if not fits:
        raise Unsupported(f"vLLM KV layer of shape {tuple(t.shape)} fits no known layout "
                          f"({'/'.join(guess)}) with {geometry}")
    if len(fits) > 1:
        raise Unsupported(f"vLLM KV layer of shape {tuple(t.shape)} fits several layouts ({', '.join(fits)}) "
                          f"with {geometry}: name one with layout=")
    if fits[0] == "cpu_attn":
        return _cpu_attn(t, kv_heads, head_dim)
    if fits[0] == "token_kv":
        return _token_kv(t, kv_heads, head_dim)
    if fits[0] == "flash_attn":  # [2, blocks, bs, heads, dim]
        return t[0].permute(0, 2, 1, 3), t[1].permute(0, 2, 1, 3)
    return t[:, 0].permute(0, 2, 1, 3), t[:, 1].permute(0, 2, 1, 3)  # flashinfer: [blocks, 2, bs, heads, dim]


def _as_torch(kv) -> torch.Tensor:
    if isinstance(kv, np.ndarray):
        if kv.dtype.kind != "f":
            raise ValueError(f"KV must be floating point, got numpy {kv.dtype}")
        return torch.from_numpy(kv if kv.flags.writeable else kv.copy())
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"KV must be a torch tensor or a numpy array, got {type(kv).__name__}")
    if not kv.is_floating_point():
        raise ValueError(f"KV must be floating point, got {kv.dtype}")
    return kv


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An index built on the host, on ``device`` without a synchronize: a CUDA device gets it from
    pinned memory, copied on the current stream (``non_blocking``; torch keeps the pinned buffer until
    the copy is done). ``torch.tensor(..., device=cuda)`` would copy from pageable memory and block the
    host until the stream got there, stalling the engine's step behind its forward."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class KVPages:
    """Per layer, canonical K and V views ``[num_blocks, kv_heads, block_size, head_dim]`` of a pool."""

    def __init__(self, views: Sequence[KV]) -> None:
        views = [tuple(pair) for pair in views]
        if not views:
            raise ValueError("KVPages needs at least one layer")
        first = views[0][0]
        for i, pair in enumerate(views):
            for v in pair:
                if v.dim() != 4:
                    raise ValueError(f"layer {i}: view {tuple(v.shape)} is not [num_blocks, heads, block_size, dim]")
                if v.shape != first.shape or v.dtype != first.dtype or v.device != first.device:
                    raise ValueError(f"layer {i}: {tuple(v.shape)} {v.dtype} on {v.device} differs from layer 0's "
                                     f"{tuple(first.shape)} {first.dtype} on {first.device}")
        self.views: List[KV] = views

    @classmethod
    def from_vllm(cls, layer_tensors: Sequence[torch.Tensor], kv_heads: int, head_dim: int,
                  block_size: Optional[int] = None, layout: Optional[str] = None) -> "KVPages":
        return cls([_vllm_view(t, kv_heads, head_dim, block_size, layout) for t in layer_tensors])

    @classmethod
    def from_trtllm(cls, pool: torch.Tensor, num_layers: int, kv_heads: int, tokens_per_block: int,
                    head_dim: int) -> "KVPages":
        want = (num_layers, 2, kv_heads * tokens_per_block * head_dim)
        if pool.dim() != 4 or tuple(pool.shape[1:]) != want:
            raise Unsupported(f"TensorRT-LLM pool of shape {tuple(pool.shape)}: expected [num_blocks, {want[0]}, "
                              f"{want[1]}, {want[2]}] (layers, K|V, kv_heads*tokens_per_block*head_dim)")
        if pool.stride(-1) != 1:
            raise Unsupported(f"TensorRT-LLM pool {tuple(pool.shape)} with strides {pool.stride()}: "
                              "the last dim must be contiguous")
        hnd = pool.unflatten(-1, (kv_heads, tokens_per_block, head_dim))  # [blocks, layers, 2, H, N, D]
        return cls([(hnd[:, layer, 0], hnd[:, layer, 1]) for layer in range(num_layers)])

    @classmethod
    def from_trtllm_pool(cls, pool: torch.Tensor, num_layers: int, kv_heads: int, head_dim: int,
                         tokens_per_block: Optional[int] = None) -> "KVPages":
        """``from_trtllm`` with the block size read off the pool (checked against ``tokens_per_block``
        where the engine's config says it) and its dtype checked: float16, bfloat16 or float32 (a
        quantized pool needs its scales, which no rung carries)."""
        per_token = kv_heads * head_dim
        if pool.dim() != 4 or tuple(pool.shape[1:3]) != (num_layers, 2) or pool.shape[-1] % per_token:
            raise Unsupported(f"TensorRT-LLM KV pool {tuple(pool.shape)} does not fit the model: expected "
                              f"[num_blocks, {num_layers}, 2, {kv_heads}*tokens_per_block*{head_dim}]")
        found = pool.shape[-1] // per_token
        if tokens_per_block is not None and tokens_per_block != found:
            raise Unsupported(f"TensorRT-LLM KV pool {tuple(pool.shape)} has {found} tokens a block, its config "
                              f"says {tokens_per_block}")
        if pool.dtype not in POOL_DTYPES:
            raise Unsupported(f"TensorRT-LLM KV cache dtype {pool.dtype}: the connector writes float16, bfloat16 "
                              "or float32 (not quantized KV)")
        return cls.from_trtllm(pool, num_layers, kv_heads, found, head_dim)

    # -- geometry ----------------------------------------------------------------------------
    @property
    def layers(self) -> int:
        return len(self.views)

    @property
    def num_blocks(self) -> int:
        return self.views[0][0].shape[0]

    @property
    def kv_heads(self) -> int:
        return self.views[0][0].shape[1]

    @property
    def block_size(self) -> int:
        return self.views[0][0].shape[2]

    @property
    def head_dim(self) -> int:
        return self.views[0][0].shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.views[0][0].dtype

    # -- access ------------------------------------------------------------------------------
    def _index(self, block_ids: Sequence[int], token_start: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(block, slot) index tensors of positions ``[token_start, token_start+n)``, checked."""
        if token_start < 0 or n < 0:
            raise ValueError(f"bad token range: start {token_start}, count {n}")
        bs = self.block_size
        first, last = token_start // bs, (token_start + n - 1) // bs
        if last >= len(block_ids):
            raise ValueError(f"tokens [{token_start}, {token_start + n}) need {last + 1} blocks of {bs}, "
                             f"the request has {len(block_ids)}")
        used = [int(b) for b in block_ids[first:last + 1]]
        bad = [b for b in used if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad[:4]} out of range [0, {self.num_blocks})")
        if len(set(used)) != len(used):
            raise ValueError(f"block ids repeat in {used[:8]}...")
        device = self.views[0][0].device
        pos = torch.arange(token_start, token_start + n)
        blocks, slots = torch.tensor(used, dtype=torch.long)[pos // bs - first], pos % bs
        return _to_device(blocks, device), _to_device(slots, device)

    def write(self, block_ids: Sequence[int], token_start: int, kv) -> None:
        kv = _as_torch(kv)
        want = (self.layers, 2, self.kv_heads, self.head_dim)
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != want:
            raise ValueError(f"KV of shape {tuple(kv.shape)} does not fit the pool: expected "
                             f"[{want[0]}, 2, {want[2]}, tokens, {want[3]}]")
        n = kv.shape[3]
        if n == 0:
            return
        blocks, slots = self._index(block_ids, token_start, n)
        kv = kv.to(device=self.views[0][0].device, dtype=self.dtype, non_blocking=True)
        for layer, (k, v) in enumerate(self.views):
            k[blocks, :, slots, :] = kv[layer, 0].transpose(0, 1)  # [n, heads, dim]
            v[blocks, :, slots, :] = kv[layer, 1].transpose(0, 1)

    def read(self, block_ids: Sequence[int], token_start: int, n: int) -> torch.Tensor:
        if n == 0:
            return torch.empty((self.layers, 2, self.kv_heads, 0, self.head_dim), dtype=self.dtype,
                               device=self.views[0][0].device)
        blocks, slots = self._index(block_ids, token_start, n)
        return torch.stack([torch.stack([k[blocks, :, slots, :], v[blocks, :, slots, :]]) for k, v in self.views]
                           ).transpose(2, 3).contiguous()
