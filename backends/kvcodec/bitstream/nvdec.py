"""HEVC decode on the GPU's NVDEC engine through PyNvVideoCodec 2.2.4.

Same contract as ``hevc.PyAVDecoder``: a raw Annex-B HEVC stream (Main 8-bit or Main10 4:2:0,
all intra, from x265) goes in as a buffer; one luma array ``[height, width]`` per frame comes out,
in stream order: uint8 for 8-bit streams, uint16 samples 0..1023 for Main10. No container and no
demuxer: the whole stream goes to the decoder as one packet (the NVDEC parser finds the NAL units
itself), then an empty packet signals end of stream so that the frames still held back for
display are flushed. Frames come back in host memory (NV12 for 8-bit; P016 for 10-bit, the 10
bits in the high bits of 16-bit little-endian samples, shifted down here), packed, pitch ==
width; the luma plane is copied out at once, since the decoder reuses its buffers on the next
call. Keeping frames in device memory (``usedevicememory=True``) is the GPU-path issue's work.

UNTESTED ON HARDWARE: written against the API as inspected in the 2.2.4 wheel (samples,
pybind11 docstrings and signatures in the .so) and public code that uses it; the machine it was
written on has no NVIDIA GPU, so it has only been checked to import, to raise ``Unsupported``
when no driver is present, and to run its control flow against a stand-in module. Feeding a
hand-built PacketData is not in NVIDIA's samples (they demux with CreateDemuxer, which also
takes a read callback); if it misbehaves on hardware, that callback demuxer is the fallback.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, List, Optional, Tuple

import numpy as np

from ..errors import CorruptChunk, Unsupported

# Decode surfaces are sized for this at creation; a larger stream re-creates the decoder.
_DEFAULT_MAX = 2048


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


class NvdecDecoder:
    """Hardware HEVC decode with NVDEC (PyNvVideoCodec); one decoder session per instance."""

    name = "nvdec"

    def __init__(self, gpu_id: int = 0) -> None:
        try:
            # Without a driver the package's __init__ raises RuntimeError (libnvidia-encode.so.1
            # not found), checked here with the 2.2.4 wheel; not ImportError.
            import PyNvVideoCodec as nvc
        except (ImportError, RuntimeError, OSError) as exc:
            raise Unsupported(f"NVDEC unavailable: {_reason(exc)}") from None
        self._nvc: Any = nvc
        self._gpu_id = int(gpu_id)
        self._lock = threading.Lock()
        self._max: Tuple[int, int] = (_DEFAULT_MAX, _DEFAULT_MAX)
        self._dims: Optional[Tuple[int, int]] = None  # size of the last stream decoded
        self._limits: Optional[dict] = None
        self._dec: Any = None
        self._open()
        try:
            # GetDecoderCaps(gpuid=, codec=, chromaformat=, bitdepth=) -> dict with width_min,
            # height_min, width_max, height_max: samples/advanced/decode.py and key names in the .so.
            self._limits = dict(nvc.GetDecoderCaps(gpuid=self._gpu_id, codec=nvc.cudaVideoCodec.HEVC,
                                                   chromaformat=nvc.cudaVideoChromaFormat.YUV420, bitdepth=8))
        except Exception:  # only used for a clearer error on sizes NVDEC cannot take
            self._limits = None

    def _open(self) -> None:
        nvc = self._nvc
        try:
            # Keyword names and order from the pybind11 signature/docstring of CreateDecoder in
            # PyNvVideoCodec_130.so; same call in samples/advanced/decode_reconfigure.py
            # (maxwidth/maxheight) and decode_from_memory_buffer.py (cudacontext=0, cudastream=0:
            # the library makes its own context). usedevicememory=False: frames land in host memory.
            self._dec = nvc.CreateDecoder(gpuid=self._gpu_id, codec=nvc.cudaVideoCodec.HEVC,
                                          cudacontext=0, cudastream=0, usedevicememory=False,
                                          maxwidth=self._max[0], maxheight=self._max[1])
        except Exception as exc:
            raise Unsupported(f"NVDEC unavailable: {_reason(exc)}") from None
        self._dims = None

    def _packet(self, buf: Optional[np.ndarray]) -> Any:
        # PacketData() with bsl_data (address) and bsl (size) set by hand; an empty PacketData()
        # (bsl == 0) flushes. Fields from the .so (PacketData: key, pts, dts, pos, bsl, bsl_data,
        # decode_flag, ...) and public code feeding raw bitstreams to CreateDecoder().Decode().
        pkt = self._nvc.PacketData()
        if buf is not None:
            pkt.bsl_data = int(buf.ctypes.data)
            pkt.bsl = int(buf.size)
        return pkt

    def _luma(self, frame: Any, width: int, height: int, bit_depth: int = 8) -> np.ndarray:
        # GetPtrToPlane(0) is the host address of the packed NV12 frame, framesize() its byte
        # count: samples/utils/Utils.py get_frame_data (host-memory branch). 10-bit streams come
        # out as P016 (the Read Me's "YUV 4:2:0 (10 bit)" surface): 16-bit little-endian samples
        # with the 10 bits at the top, so the sample is the word shifted right by 6.
        wide = bit_depth > 8
        size = int(frame.framesize())
        if size != width * height * 3 // 2 * (2 if wide else 1):
            raise CorruptChunk(f"decoded frame holds {size} bytes, expected {width}x{height} "
                               f"{'P016' if wide else 'NV12'}")
        if not wide:
            raw = (ctypes.c_uint8 * (width * height)).from_address(int(frame.GetPtrToPlane(0)))
            return np.frombuffer(raw, dtype=np.uint8).reshape(height, width).copy()
        raw = (ctypes.c_uint16 * (width * height)).from_address(int(frame.GetPtrToPlane(0)))
        return (np.frombuffer(raw, dtype="<u2").reshape(height, width) >> (16 - bit_depth)).astype(np.uint16)

    def _ensure(self, width: int, height: int) -> None:
        lim = self._limits
        if lim and not (lim.get("width_min", 0) <= width <= lim.get("width_max", width)
                        and lim.get("height_min", 0) <= height <= lim.get("height_max", height)):
            raise Unsupported(f"NVDEC cannot decode {width}x{height} HEVC on GPU {self._gpu_id} "
                              f"(min {lim.get('width_min')}x{lim.get('height_min')})")
        if self._dec is None or width > self._max[0] or height > self._max[1]:
            self._max = (max(self._max[0], width), max(self._max[1], height))
            self._dec = None
            self._open()
        elif self._dims is not None and self._dims != (width, height):
            # As samples/advanced/decode_reconfigure.py does between streams of different sizes.
            self._dec.setReconfigParams(width, height)

    def decode(self, data: bytes, width: int, height: int, bit_depth: int = 8) -> List[np.ndarray]:
        buf = np.frombuffer(data, dtype=np.uint8)
        out: List[np.ndarray] = []
        if not buf.size:
            return out
        with self._lock:
            self._ensure(width, height)
            try:
                # Decode(PacketData) -> list of DecodedFrame (pybind11 docstring; all samples).
                # Each batch is copied before the next Decode call may reuse its buffers.
                out.extend(self._luma(f, width, height, bit_depth) for f in self._dec.Decode(self._packet(buf)))
                out.extend(self._luma(f, width, height, bit_depth) for f in self._dec.Decode(self._packet(None)))
            except Exception as exc:
                self._dec = None  # parser state unknown: start a fresh session next call
                if isinstance(exc, CorruptChunk):
                    raise
                raise CorruptChunk(f"nvdec decode failed: {_reason(exc)}") from None
            self._dims = (width, height)
        return out

    def close(self) -> None:
        # Dropping the last reference destroys the decoder session and the CUDA context it made.
        with self._lock:
            self._dec = None
