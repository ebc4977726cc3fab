"""The decoder factory: decoders by name, from lazy registries (a heavy dependency is imported
only when its entry is chosen; a duplicate name raises).

- ``DECODERS``: HEVC decoders, the contract of ``hevc.PyAVDecoder`` (``decode(data, width, height,
  bit_depth)`` -> one luma plane per frame): ``pyav`` (FFmpeg), ``nvdec`` (PyNvVideoCodec on an
  NVIDIA GPU), ``pyav-process`` (PyAV in a process of its own, ``bitstream.isolated``).
- ``make_decoder(name, threads)``: ``auto`` picks NVDEC when it opens here, else PyAV (a coder's
  own decoder, ``hevc.Hevc.decoder``).
- ``open_decoder(name, threads=, gpu_id=, device_output=, timeout_s=)``: decoder ``name`` given the
  options its class takes (``threads`` for PyAV, ``gpu_id`` and ``device_output`` for NVDEC,
  ``timeout_s`` for ``pyav-process``); ``Unsupported`` if it cannot be made (a self-tested
  decoder, ``bitstream.verified``).

- ``ENTROPY_DECODERS``: decoders of the ``zstd`` coder's frames, the contract of
  ``simple.ZstdCpuDecoder`` (``decode(frames, size)`` -> the planes' bytes): ``cpu``
  (python-zstandard) and ``nvcomp`` (nvCOMP on an NVIDIA GPU, ``bitstream.nvcomp``);
  ``open_entropy_decoder(name, gpu_id=)`` makes one (``auto``: nvCOMP where it opens, else the CPU),
  ``Unsupported`` when it cannot be made.
"""
from __future__ import annotations

import inspect
from typing import Any

from ..errors import Unsupported
from ..registry import Registry

DECODERS: Registry = Registry("hevc decoder")
DECODERS.register("pyav", "kvcodec.bitstream.hevc:PyAVDecoder")
DECODERS.register("nvdec", "kvcodec.bitstream.nvdec:NvdecDecoder")
DECODERS.register("pyav-process", "kvcodec.bitstream.isolated:ProcessDecoder")


def make_decoder(name: str, threads: int = 1):
    """``auto`` picks NVDEC when it can be opened here, else PyAV."""
    if name == "auto":
        try:
            return DECODERS.get("nvdec")()
        except Unsupported:
            return DECODERS.get("pyav")(threads=threads)
    if name == "pyav":
        return DECODERS.get("pyav")(threads=threads)
    return DECODERS.get(name)()


def open_decoder(name: str, *, threads: int = 1, gpu_id: int = 0, device_output: bool = False,
                 timeout_s: float = 30.0) -> Any:
    """Decoder ``name`` of ``DECODERS``, given the options its class takes. Raises ``Unsupported``
    if it cannot be made."""
    cls = DECODERS.get(name)
    offered = {"threads": threads, "gpu_id": gpu_id, "device_output": device_output, "timeout_s": timeout_s}
    params = inspect.signature(cls).parameters
    try:
        return cls(**{k: v for k, v in offered.items() if k in params})
    except ImportError as exc:
        raise Unsupported(f"decoder {name} unavailable: {exc}") from None


ENTROPY_DECODERS: Registry = Registry("entropy decoder")
ENTROPY_DECODERS.register("cpu", "kvcodec.bitstream.simple:ZstdCpuDecoder")
ENTROPY_DECODERS.register("nvcomp", "kvcodec.bitstream.nvcomp:NvcompZstdDecoder")


def open_entropy_decoder(name: str, *, gpu_id: int = 0) -> Any:
    """Entropy decoder ``name`` of ``ENTROPY_DECODERS`` (``auto``: ``nvcomp`` if it opens, else
    ``cpu``), given ``gpu_id`` where its class takes one. Raises ``Unsupported`` if it cannot be made."""
    if name == "auto":
        try:
            return open_entropy_decoder("nvcomp", gpu_id=gpu_id)
        except Unsupported:
            return open_entropy_decoder("cpu")
    cls = ENTROPY_DECODERS.get(name)
    params = inspect.signature(cls).parameters
    try:
        return cls(**({"gpu_id": gpu_id} if "gpu_id" in params else {}))
    except ImportError as exc:
        raise Unsupported(f"entropy decoder {name} unavailable: {exc}") from None
