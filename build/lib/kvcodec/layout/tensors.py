"""Torch helpers for the layouts' restore (``Layout.from_planes_torch``), on any device.

- ``as_tensor(array, device)``: planes (numpy, or a torch tensor on any device) as a tensor on
  ``device``; a numpy array on the CPU is not copied (restore only reads its planes, so a read-only
  array is taken as it is, without torch's warning about it).
- ``side_array(side, name, dtype, shape)``: a side section as a numpy array of that shape (host:
  side data is a few kilobytes), raising ``KeyError`` / ``ValueError`` for the caller to map;
  ``side_tensor(array, device, dtype)`` such an array converted on the host, then on ``device``.
- ``check_planes(planes, shape, dtype, what)``: ``CorruptChunk`` unless the planes are that dtype
  and shape, with the message of the numpy era (``uint8(8, 256, 192)``) for arrays and tensors alike.
- ``empty(shape, dtype, device)``: the restore's large outputs and temporaries; on the CPU in numpy's
  memory, which is reused from chunk to chunk (torch's own allocations of several MB often are fresh
  mappings: thousands of page faults a chunk). ``flat(t)``: a dense tensor in memory order, 1-D.
- ``Cached``: tensors made once per key (a profile's basis on a device, RoPE tables), small and
  thread-safe enough (two threads may both make an entry; one wins, both are equal).
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Callable, Dict, Hashable, List, Tuple, Union

import numpy as np
import torch

from ..errors import CorruptChunk

Planes = Union[np.ndarray, torch.Tensor]
CPU = torch.device("cpu")
# numpy dtype <-> torch dtype, for the planes and KV dtypes that cross restore (and a few that a
# caller might wrongly send, so that the error names them)
TORCH_OF: Dict[np.dtype, torch.dtype] = {np.dtype(n): t for n, t in (
    (np.uint8, torch.uint8), (np.int8, torch.int8), (np.uint16, torch.uint16), (np.int16, torch.int16),
    (np.uint32, torch.uint32), (np.int32, torch.int32), (np.int64, torch.int64), (np.float16, torch.float16),
    (np.float32, torch.float32), (np.float64, torch.float64), (np.bool_, torch.bool))}
NUMPY_OF: Dict[torch.dtype, np.dtype] = {t: n for n, t in TORCH_OF.items()}


def dtype_name(planes: Planes) -> str:
    """The numpy name of the planes' dtype (``uint8``), for tensors too (else torch's own name)."""
    if isinstance(planes, torch.Tensor):
        np_dtype = NUMPY_OF.get(planes.dtype)
        return np_dtype.name if np_dtype is not None else str(planes.dtype).replace("torch.", "")
    return np.dtype(planes.dtype).name


def describe(planes: Planes) -> str:
    return f"{dtype_name(planes)}{tuple(planes.shape)}"


def check_planes(planes: Planes, shape: Tuple[int, ...], dtype: Any, what: str) -> None:
    want = np.dtype(dtype)
    if tuple(planes.shape) != tuple(shape) or dtype_name(planes) != want.name:
        raise CorruptChunk(f"{what} planes are {describe(planes)}, expected {want.name}{tuple(shape)}")


def as_tensor(planes: Planes, device: torch.device) -> torch.Tensor:
    """``planes`` as a tensor on ``device`` (no copy for a numpy array or tensor already there)."""
    if isinstance(planes, np.ndarray):
        if planes.flags.writeable:
            t = torch.from_numpy(planes)
        else:  # restore never writes into its planes: a read-only buffer is fine as it is
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(planes)
    else:
        t = planes
    return t.to(device) if t.device != device else t


def empty(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor; on the CPU in numpy's memory: numpy's allocations of a few MB reuse
    the blocks freed before them, where torch's aligned ones are often a fresh mapping (thousands of
    page faults a chunk, as much as the restore itself for ``native``)."""
    if device.type == "cpu":
        return torch.from_numpy(np.empty(shape, NUMPY_OF[dtype]))
    return torch.empty(shape, dtype=dtype, device=device)


def flat(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order, one dimension (a view; a copy if not dense)."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.shape[d]))
    in_memory = t.permute(order)
    return in_memory.view(-1) if in_memory.is_contiguous() else in_memory.reshape(-1)


def side_array(side: Dict[str, bytes], name: str, dtype: Any, shape: Tuple[int, ...]) -> np.ndarray:
    """The side section ``name`` read as ``dtype`` in ``shape``: KeyError if absent, ValueError if
    its size does not fit."""
    return np.frombuffer(side[name], dtype=dtype).reshape(shape)


def side_tensor(array: np.ndarray, device: torch.device, dtype: Any = None) -> torch.Tensor:
    """A (small) host array as a tensor on ``device``, converted to the numpy ``dtype`` on the host."""
    return as_tensor(np.ascontiguousarray(array, dtype=dtype), device)


_CACHES: List["Cached"] = []


class Cached:
    """Values made once per key by the ``make()`` given with it; at most ``limit`` kept (the oldest
    made goes first). ``clear_caches()`` empties every one (a Triton model's ``finalize``)."""

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._values: Dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        _CACHES.append(self)

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        value = self._values.get(key)
        if value is None:
            value = make()
            with self._lock:
                while len(self._values) >= self.limit:
                    self._values.pop(next(iter(self._values)))
                self._values[key] = value
        return value

    def clear(self) -> None:
        with self._lock:
            self._values.clear()


def clear_caches() -> None:
    """Drops every cached tensor (device memory goes back to torch's allocator)."""
    for cache in _CACHES:
        cache.clear()
