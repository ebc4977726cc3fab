"""Decoded planes on the host: the one copy a device decoder's output makes when the host needs it.

``serving.decode`` hashes a chunk's planes against the digest taken at ingest; planes NVDEC left
on the GPU are copied here first (once per (profile, size) for a self-tested decoder's device
output, every chunk otherwise). The self-test compares the same way.

- ``host_array(planes)``: numpy as it is (no copy); a torch tensor copied from its device
  (``uint16`` through ``int16``: numpy conversion of torch's ``uint16`` is recent);
- ``to_host(frames)``: decoded frames (numpy, or tensors on any device) stacked as one host array.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def host_array(planes: Any) -> np.ndarray:
    """Planes as a host numpy array: numpy as it is, a torch tensor copied from its device."""
    if isinstance(planes, np.ndarray):
        return planes
    import torch

    planes = planes.detach().cpu()
    if planes.dtype == torch.uint16:
        return planes.view(torch.int16).numpy().view(np.uint16)
    return planes.numpy()


def to_host(frames: Sequence[Any]) -> np.ndarray:
    """Decoded frames (numpy, or torch tensors on any device) stacked as one host array."""
    if not len(frames):
        return np.zeros((0, 0, 0), np.uint8)
    if isinstance(frames[0], np.ndarray):
        return np.stack(frames)
    import torch

    return host_array(torch.stack(list(frames)))
