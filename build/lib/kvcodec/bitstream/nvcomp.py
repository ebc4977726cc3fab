"""zstd payloads decoded on the GPU with nvCOMP (``nvidia-nvcomp-cu13`` 6.0.0.12, ``nvidia.nvcomp``).

The entropy decoder contract of ``bitstream.simple`` (``decode(frames, size)`` -> ``size`` bytes,
1-D ``uint8``): the payload's standard zstd frames (``Zstd.frames``: one for today's rungs, or
``frame_kb`` pieces) are decoded by nvCOMP's zstd into one ``uint8`` tensor on ``cuda:<gpu_id>``.
The caller (``serving.decode``) checks the planes against the digest taken at ingest, as it does
for every decoder's output: nvCOMP must be bit-exact with the CPU decoder (``ZstdCpuDecoder``).

How, in nvCOMP's documented Python API (``Codec``, ``as_arrays``, DLPack; nvCOMP's Python API
reference and its "Python API Basics" sample; signatures read from the 6.0.0.12 wheel's bindings):

- ``nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW, device_id=gpu_id,
  cuda_stream=<a torch stream of its own>)``, made once: ``RAW`` is a bare zstd frame, no nvCOMP
  header (each frame says its own content size);
- the frames are staged on the host, each at an offset aligned to
  ``codec.get_required_decompression_alignment()`` (16 if in doubt), copied to the device in one
  copy, and wrapped as a batch carved by an offset table (``nvcomp.as_arrays(buffer, offsets,
  sizes, cuda_stream)``); the output tensor is carved the same way (frame ``i`` decodes to bytes
  ``i * frame`` of the planes), so ``codec.decode(batch, out=out_batch)`` writes the planes in place;
- stream order as NVDEC's device output (``bitstream.nvdec``): the codec's stream waits for the
  caller's current stream before, the caller's waits for the codec's after.

Unavailable (``Unsupported``, a clear reason, never an ImportError): nvCOMP not installed; its
import failing (``RuntimeError`` or ``OSError`` without a driver: caught explicitly, as for
PyNvVideoCodec); no CUDA device ``gpu_id`` visible to torch; ``Codec`` refusing to be made
(without a GPU driver 6.0.0.12 raises ``RuntimeError: CUDA Runtime API failure: CUDA driver
version is insufficient``, seen here). A frame nvCOMP rejects is ``CorruptChunk``.

UNTESTED ON HARDWARE: written on a machine without a GPU, checked there to import, to raise
``Unsupported`` without a driver, and (``tests/unit/test_gpu_entropy.py``) to run its framing,
staging and dispatch against a stand-in module; ``tests/gpu/gpu_checks.py``'s ``nvcomp`` check
measures it and compares it with the digests on the GPU machine.
"""
from __future__ import annotations

import threading
from typing import Any, List, Sequence, Tuple

import numpy as np

from ..errors import CorruptChunk, Unsupported


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def staged(frames: Sequence[Any], align: int) -> Tuple[np.ndarray, List[int], List[int]]:
    """The frames in one host buffer, each at an offset aligned to ``align``: (buffer, offsets, sizes)."""
    offsets, sizes, at = [], [], 0
    for frame in frames:
        offsets.append(at)
        sizes.append(len(frame))
        at += -(-len(frame) // align) * align
    buf = np.zeros(max(at, align), dtype=np.uint8)
    for frame, offset, size in zip(frames, offsets, sizes, strict=True):
        buf[offset:offset + size] = np.frombuffer(frame, dtype=np.uint8)
    return buf, offsets, sizes


def out_pieces(size: int, count: int) -> Tuple[List[int], List[int]]:
    """Where frame ``i`` of ``count`` decodes to in ``size`` bytes: equal pieces, the last one shorter."""
    step = -(-size // count) if count else size
    offsets = [i * step for i in range(count)]
    return offsets, [min(step, size - o) for o in offsets]


class NvcompZstdDecoder:
    """zstd frames -> bytes on one GPU, with nvCOMP; one codec (and CUDA stream) per instance."""

    name = "nvcomp"
    device_output = True

    def __init__(self, gpu_id: int = 0) -> None:
        try:
            from nvidia import nvcomp
        except (ImportError, RuntimeError, OSError) as exc:
            raise Unsupported(f"nvCOMP unavailable: {_reason(exc)} (pip install nvidia-nvcomp-cu13)") from None
        try:
            import torch
        except ImportError as exc:
            raise Unsupported(f"nvCOMP decode needs torch: {_reason(exc)}") from None
        if not torch.cuda.is_available() or not 0 <= int(gpu_id) < torch.cuda.device_count():
            raise Unsupported(f"nvCOMP unavailable: no CUDA device {gpu_id} visible to torch")
        self._nvcomp, self._torch = nvcomp, torch
        self.device = torch.device("cuda", int(gpu_id))
        self._lock = threading.Lock()  # a Codec must not be called from two threads at once (nvCOMP's guide)
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
        try:
            self._codec = nvcomp.Codec(algorithm="Zstd", bitstream_kind=nvcomp.BitstreamKind.RAW,
                                       device_id=int(gpu_id), cuda_stream=int(self.stream.cuda_stream))
            self.align = max(1, int(self._codec.get_required_decompression_alignment()))
        except Exception as exc:  # RuntimeError without a driver; anything else the binding raises
            raise Unsupported(f"nvCOMP unavailable: {_reason(exc)}") from None

    def decode(self, frames: Sequence[Any], size: int) -> Any:
        torch, nvcomp = self._torch, self._nvcomp
        if not frames:
            raise CorruptChunk("zstd payload holds no frame")
        host, offsets, sizes = staged(frames, max(self.align, 16))
        out_offsets, out_sizes = out_pieces(int(size), len(frames))
        stream = int(self.stream.cuda_stream)
        with self._lock:
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            try:
                with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                    src = torch.from_numpy(host).to(self.device)
                    out = torch.empty(int(size), dtype=torch.uint8, device=self.device)
                    batch = nvcomp.as_arrays(src, offsets, sizes, cuda_stream=stream)
                    target = nvcomp.as_arrays(out, out_offsets, out_sizes, cuda_stream=stream)
                    decoded = self._codec.decode(batch, out=target)
                    got = [int(n) for n in decoded.buffer_sizes]
            except CorruptChunk:
                raise
            except Exception as exc:  # nvCOMP reports a bad frame as RuntimeError / ValueError
                raise CorruptChunk(f"nvcomp zstd decode failed: {_reason(exc)}") from None
            current.wait_stream(self.stream)
        if got != out_sizes:
            raise CorruptChunk(f"nvcomp decoded {sum(got)} bytes in pieces {got[:4]}..., expected {size}")
        return out

    def close(self) -> None:
        self._codec = None
