"""Step ``kv_restore``: typed planes -> KV ``[layers, 2, kv_heads, tokens, head_dim]``.

The KV is float16, except from the ``native`` layout (``raw``), which restores the engine's own
dtype exactly: float16 or float32 (``KV_DTYPES``). Over Triton it leaves as ``kv`` (float16) or
``kv32`` (float32), the other one empty (``EMPTY_KV`` / ``EMPTY_KV32``).

``restore(decoded, device=None)`` makes (once per layout and settings, cached) the chunk's layout and
runs its ``from_planes_torch``: restore is torch, written once for every device. The planes may be
numpy or a torch tensor on any device; the KV is a torch tensor on ``device`` (default: the planes'
device). Numpy planes with no ``device`` give a numpy array (the host callers' contract: connectors,
evaluation tools), the CPU tensor's own memory. Every layout computes on ``device`` (``qn`` and ``cg``
too: they share ``q8``'s arithmetic or are as short). The planes must have the dtype and shape the
header names; the header must name a layout and version this build reads (else ``ForeignChunk``);
side data is checked on the host before anything is allocated on the device, and KV that is not
finite is a ``CorruptChunk`` (checked on the device: one pass, two numbers back to the host).

Over Triton a ``Decoded`` travels as typed planes, the side sections packed into one byte tensor
(``pack_side`` / ``unpack_side``), and the header as JSON (``descriptor`` / ``from_descriptor``).

``RestoreStep(device).run(info, decoded)`` never raises for a bad chunk: it marks ``info`` failed.

torch is imported on the first restore, not with this module (kv_decode imports it for
``descriptor``).
"""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Dict, List, Tuple, Union

import numpy as np

from ..errors import ConfigError, CorruptChunk, ForeignChunk, KVCodecError, Unsupported
from ..format.header import ChunkHeader
from ..layout import Layout, get_layout
from .chunkinfo import ChunkInfo
from .decode import Decoded, status_of

if TYPE_CHECKING:
    import torch

EMPTY_KV = np.zeros((0, 2, 0, 0, 0), dtype=np.float16)
EMPTY_KV32 = np.zeros((0, 2, 0, 0, 0), dtype=np.float32)
KV_DTYPES = ("float16", "float32")  # the dtypes restore returns
_LAYOUTS: Dict[str, Layout] = {}
KV = Union[np.ndarray, "torch.Tensor"]


def _layout(header: ChunkHeader) -> Layout:
    cache_key = header.layout + json.dumps(header.layout_params, sort_keys=True)
    layout = _LAYOUTS.get(cache_key)
    if layout is None:
        try:
            layout = get_layout(header.layout, **header.layout_params)
        except Unsupported:
            raise ForeignChunk(f"chunk layout {header.layout!r} is not one this build reads") from None
        except (TypeError, ValueError, OverflowError) as exc:
            raise ForeignChunk(f"chunk layout {header.layout} settings {header.layout_params!r} not understood: "
                               f"{exc}"[:300]) from None
        _LAYOUTS[cache_key] = layout
    if header.layout_version != layout.version:
        raise ForeignChunk(f"chunk layout {header.layout} v{header.layout_version}, this build reads v{layout.version}")
    return layout


def restore(decoded: Decoded, device: Any = None) -> KV:
    """KV ``[layers, 2, kv_heads, tokens, head_dim]`` of a decoded chunk: float16, or the engine's
    own float32 for a ``native`` chunk made for it; a torch tensor on ``device`` (``"cuda:0"``, a
    ``torch.device``; default: the planes' device), or numpy for numpy planes and no ``device``."""
    import torch

    from ..layout.tensors import CPU, dtype_name, flat

    header, planes = decoded.header, decoded.planes
    if header is None:
        raise CorruptChunk("no chunk header to restore with")
    layout = _layout(header)
    if dtype_name(planes) != header.planes_dtype.name or tuple(planes.shape) != tuple(header.planes_shape):
        raise CorruptChunk(f"planes are {dtype_name(planes)}{list(planes.shape)}, the header's shape is "
                           f"{header.planes_dtype}{list(header.planes_shape)}")
    host = device is None and isinstance(planes, np.ndarray)
    target = torch.device(device) if device is not None else CPU if host else planes.device
    at = {"token_start": header.token_start} if layout.needs_positions else {}
    try:
        kv = layout.from_planes_torch(planes, decoded.side, header.geometry, target, **at)
    except ConfigError as exc:  # e.g. a codec profile this build does not ship
        raise ForeignChunk(f"chunk layout {header.layout} settings not understood: {exc}") from None
    name = str(kv.dtype).replace("torch.", "")
    if name not in KV_DTYPES:
        raise CorruptChunk(f"layout {header.layout} restored {name} KV, not float16 or float32")
    # side data that parses but does not make finite KV (a writer's bug) is a corrupt chunk, never KV:
    # min and max carry any NaN (torch's reductions propagate it) and show any inf; one read of the
    # KV in memory order, no temporary, two numbers back to the host (a fraction of isfinite's cost)
    if kv.numel():
        lo, hi = torch.aminmax(flat(kv))
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            raise CorruptChunk("restored KV holds values that are not finite")
    return kv.numpy() if host else kv


# -- the wire form between the kv_decode and kv_restore steps --------------------------------------
def pack_side(side: Dict[str, bytes]) -> Tuple[List[Tuple[str, int]], np.ndarray]:
    """The side sections as (name, length) pairs and one uint8 array."""
    index = [(name, len(body)) for name, body in side.items()]
    data = np.frombuffer(b"".join(side.values()), dtype=np.uint8) if side else np.zeros(0, np.uint8)
    return index, data


def unpack_side(index: Any, data: np.ndarray) -> Dict[str, bytes]:
    try:
        pairs = [(str(name), int(length)) for name, length in index]
    except (TypeError, ValueError):
        raise CorruptChunk(f"bad side index in restore descriptor: {index!r}") from None
    if any(n < 0 for _, n in pairs) or sum(n for _, n in pairs) != data.size:
        raise CorruptChunk("side sections do not add up to the side data")
    out, offset = {}, 0
    for name, n in pairs:
        out[name] = data[offset:offset + n].tobytes()
        offset += n
    return out


def descriptor(decoded: Decoded) -> Tuple[str, np.ndarray]:
    """(header JSON with the side index, side bytes): what kv_decode sends besides the planes."""
    if decoded.header is None:
        return "", np.zeros(0, np.uint8)
    index, data = pack_side(decoded.side)
    return json.dumps({"header": decoded.header.to_dict(), "side": index}, separators=(",", ":")), data


def from_descriptor(text: Any, side: np.ndarray, planes: KV) -> Decoded:
    """The ``Decoded`` that ``descriptor`` described (an empty text: an empty chunk)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", "replace")
    if not text:
        return Decoded.empty()
    try:
        d = json.loads(text)
        header, index = d["header"], d["side"]
    except (TypeError, ValueError, KeyError) as exc:
        raise CorruptChunk(f"restore descriptor unreadable: {exc}") from None
    return Decoded(ChunkHeader.from_dict(header), planes, unpack_side(index, side))


class RestoreStep:
    """Planes -> KV ``[layers, 2, kv_heads, tokens, head_dim]`` (float16, or float32 from ``raw``) on
    ``device`` (``restore``'s: ``None`` keeps numpy planes numpy and tensors where they are); a
    failed chunk gives the numpy ``EMPTY_KV``."""

    def __init__(self, device: Any = None) -> None:
        self.device = device

    def close(self) -> None:
        """Drops the tensors the layouts keep per device (profile bases, RoPE tables)."""
        from ..layout.tensors import clear_caches

        clear_caches()

    def run_described(self, info: ChunkInfo, text: Any, side: np.ndarray, planes: KV) -> KV:
        """``run`` on the wire form that kv_decode sent (a bad descriptor marks the chunk failed)."""
        try:
            decoded = from_descriptor(text, side, planes)
        except (KVCodecError, ValueError) as exc:
            info.fail(status_of(exc), f"restore: {exc}")
            decoded = Decoded.empty()
        return self.run(info, decoded)

    def run(self, info: ChunkInfo, decoded: Decoded) -> KV:
        if not info.ok or decoded.header is None:
            return EMPTY_KV
        t0 = time.perf_counter()
        try:
            kv = restore(decoded, self.device)
            if kv.shape[3] != info.tokens:
                raise ForeignChunk(f"chunk holds {kv.shape[3]} tokens, expected {info.tokens}")
        except (KVCodecError, ValueError) as exc:
            info.fail(status_of(exc), f"restore: {exc}")
            kv = EMPTY_KV
        info.s["restore"] = time.perf_counter() - t0
        info.t["restored"] = time.time()
        return kv
