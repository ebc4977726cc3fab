"""The KVTC-style layout (``kvtc``): PCA coefficients with bits allocated per component, sink and
recent tokens kept exact; the baseline of NVIDIA's KVTC (arXiv 2511.01815), rebuilt on this
project's codec profile.

- **Transform:** the ``pca`` layout's (``transform.PcaUniform.coefficients``): per (layer, K|V),
  keys before RoPE and values, all KV heads of a token side by side, centred and projected on the
  profile's PCA basis.
- **Bit allocation:** every component ``j`` of every (layer, K|V) gets ``b_j`` in 0..8 bits, by
  greedy reverse water-filling on the profile's fitted variances: starting from 0 bits everywhere,
  the next bit goes to the component whose expected squared error falls most, until the budget of
  ``bits / 100`` bits per coefficient on average is spent (the greedy order is optimal for these
  convex, decreasing distortion curves). Trailing components end at 0 bits: restored as the mean.
  ``weighted=1`` multiplies each variance by the profile's sensitivity weight first (the
  components where the model looks get the bits; ``kvcodec_tools.quality.sensitivity``). The allocation is
  a function of the profile and the parameters, so it is never stored.
- **Quantizer:** for ``b`` bits, a uniform midrise quantizer whose step is the mean-squared-error
  optimum of ``2**b`` levels for a Gaussian of the component's fitted standard deviation (Max,
  1960: ``allocation.STEP``), but not clipped to those levels: values beyond them take further
  levels, up to 128 either side of the centre (at most ``MAX_BITS`` = 6, so the range is at least
  13 standard deviations), and the entropy coder prices the rare outliers. Clipped at the ``2**b``
  levels, the KV's heavy tails (coefficients up to 9 standard deviations) cost 0.6% of the
  variance as clipping error whatever the bits: mean KL 0.023 at 4.5 bits per coefficient on four
  eval texts (``perf/results/README.md``).
- **Exact tokens:** the context's first ``sink`` tokens (attention sinks: positions below ``sink``,
  so only in a context's first chunk) and each chunk's last ``recent`` tokens are stored as float16
  in the side section ``pca_exact`` and restored bit for bit.
- **Planes:** ``uint8 [layers * 2, C, tokens]`` of level indices (``CENTRE`` the first level above
  zero; 0 for a 0-bit component), leading
  components first: the entropy coder (zstd in the ``kvtc`` scheme; KVTC uses DEFLATE) takes it
  from there.

Restore: one batched matrix product (``(basis * step) @ q + offset``, the midrise centre folded into
the offset), RoPE re-applied, then the exact tokens written over their columns; on any device.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import torch

from ..errors import ConfigError
from ..format.geometry import Geometry
from ..profiles import Profile
from .allocation import MAX_BITS, allocation
from .tensors import Planes, as_tensor, check_planes, side_tensor
from .transform import PcaUniform, on_device

CENTRE = 128


class KvtcLayout(PcaUniform):
    name = "kvtc"
    version = 1
    needs_positions = True

    def __init__(self, profile: Optional[str] = None, bits: int = 150, sink: int = 4, recent: int = 0,
                 weighted: int = 0) -> None:
        super().__init__(profile=profile, weighted=weighted, sink=sink, recent=recent)
        bits = int(bits)
        if not 1 <= bits <= 100 * MAX_BITS:
            raise ConfigError(f"bits must be 1..{100 * MAX_BITS} (hundredths of a bit per coefficient), got {bits}")
        self.bits = bits

    def planes_shape(self, g: Geometry) -> Tuple[int, int, int]:
        return (g.layers * 2, g.kv_heads * g.head_dim, g.tokens)

    def quantizer(self, p: Profile) -> Tuple[np.ndarray, np.ndarray]:
        """Each component's step and the value of its level 0 (midrise: ``(0.5 - CENTRE) * step``),
        float32 ``[layers, 2, C]``, both 0 for a 0-bit component."""
        step = allocation(p, self.bits, bool(self.weighted)).step
        return step, np.where(step > 0, (0.5 - CENTRE) * step, 0.0).astype(np.float32)

    def to_planes(self, kv: np.ndarray, token_start: int = 0) -> Tuple[np.ndarray, Dict[str, bytes]]:
        g, p, coeff = self.coefficients(kv, token_start)  # [L, 2, T, C]
        side = {"pca_profile": p.digest.encode()}
        coeff = self.keep_exact(kv, coeff, token_start, side)
        step, _ = self.quantizer(p)
        safe = np.where(step > 0, step, 1.0)
        idx = np.clip(np.floor(coeff / safe[:, :, None, :]) + CENTRE, 0, 2 * CENTRE - 1)
        idx = np.where(step[:, :, None, :] > 0, idx, 0)
        idx[:, :, self.exact_tokens(token_start, g.tokens), :] = 0  # restored from the side section instead
        planes = np.ascontiguousarray(idx.astype(np.uint8).transpose(0, 1, 3, 2).reshape(self.planes_shape(g)))
        return planes, side

    def from_planes_torch(self, planes: Planes, side: Dict[str, bytes], g: Geometry, device: torch.device,
                          token_start: int = 0) -> torch.Tensor:
        check_planes(planes, self.planes_shape(g), np.uint8, self.name)
        p = self.checked_profile(side, g)
        exact = self.read_exact(side, g, token_start)
        step, level0 = self.quantizer(p)
        on = on_device(p, device)
        q = as_tensor(planes, device).reshape(g.layers, 2, p.channels, g.tokens)
        basis = on.basis * side_tensor(step, device)[:, :, None, :]
        offset = on.mean + torch.matmul(on.basis, side_tensor(level0, device)[..., None])[..., 0]
        return self.put_exact(self.restore_kv(q, basis, offset, p, g, token_start), exact)
