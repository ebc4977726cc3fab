"""HEVC decode on the GPU's NVDEC engine through PyNvVideoCodec 2.2.4.

Same contract as ``hevc.PyAVDecoder``: a raw Annex-B HEVC stream (Main 8-bit or Main10 4:2:0,
all intra, from x265) goes in as a buffer; one luma plane ``[height, width]`` per frame comes out,
in stream order: uint8 for 8-bit streams, uint16 samples 0..1023 for Main10. No container and no
demuxer: the whole stream goes to the decoder as one packet (the NVDEC parser finds the NAL units
itself), then an empty packet signals end of stream so that the frames still held back for
display are flushed. The decoder reuses its output buffers on the next call, so each frame's luma
plane is copied out of them at once. Two output modes, chosen when the decoder is made:

- host (the default, ``device_output=False``): frames land in host memory (NV12 for 8-bit; P016
  for 10-bit, the 10 bits in the high bits of 16-bit little-endian samples, shifted down here),
  packed, pitch == width; planes are numpy arrays.
- device (``NvdecDecoder(gpu_id, device_output=True)``): the decoder is made with
  ``usedevicememory=True`` on the caller's GPU (kv_decode: the model instance's), in the CUDA
  primary context (the one torch uses) with a torch stream of its own; each frame is taken as a
  torch tensor through DLPack (``torch.from_dlpack(frame)``, zero-copy), its luma rows sliced,
  copied (and for P016 shifted right by 6) on the device: planes are torch tensors on
  ``cuda:<gpu_id>`` (uint8, or ``torch.uint16``). Stream order: the decoder's stream waits for
  the caller's current stream before each ``Decode`` (earlier reads of its buffers are done), the
  caller's stream waits for the decoder's after it (the frames are written), so no host
  synchronisation is needed.

``device_output`` is a class attribute too: ``serving.decode`` skips the host digest only for
planes of a decoder that says its output is on the device and that passed its start-up
self-test (``bitstream.selftest``) for the stream's profile.

UNTESTED ON HARDWARE: written against PyNvVideoCodec 2.2.4 as documented (NVIDIA's programming
guide, "Creating a Decoder" and "Interoperability"; the samples shipped in the wheel:
samples/advanced/decode_with_cuda_control.py for an application's context and stream,
decode_from_memory_buffer.py, samples/utils/Utils.py for the frame accessors) and as inspected
in the 2.2.4 wheel (pybind11 docstrings and signatures in the .so). The machine it was written on
has no NVIDIA GPU, so it has only been checked to import, to raise ``Unsupported`` when no driver
is present, and to run its control flow against a stand-in module. Feeding a hand-built
PacketData is not in NVIDIA's samples (they demux with CreateDemuxer, which also takes a read
callback); if it misbehaves on hardware, that callback demuxer is the fallback. In device mode the
DLPack tensor's shape for P016 (16-bit words, or bytes twice as wide) is read either way.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any, List, Optional, Tuple

import numpy as np

from ..errors import CorruptChunk, Unsupported

# Decode surfaces are sized for this at creation; a larger stream re-creates the decoder.
_DEFAULT_MAX = 2048


def chroma_420(nvc: Any) -> Any:
    """PyNvVideoCodec's member of cudaVideoChromaFormat for 4:2:0. 2.2.4 has no ``YUV420`` there
    (seen on the H200: AttributeError); its names are not in the binding's strings, so the member
    is found by name among the enum's members."""
    enum = nvc.cudaVideoChromaFormat
    for name, member in getattr(enum, "__members__", {}).items():
        if "420" in str(name):
            return member
    raise AttributeError("cudaVideoChromaFormat has no 4:2:0 member: "
                         f"{sorted(getattr(enum, '__members__', {}))}")


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


class NvdecDecoder:
    """Hardware HEVC decode with NVDEC (PyNvVideoCodec); one decoder session per instance."""

    name = "nvdec"
    device_output = False  # where decoded planes are: host numpy (False) or torch tensors on the GPU

    def __init__(self, gpu_id: int = 0, device_output: bool = False) -> None:
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
        self._cuda: Optional[_Cuda] = _Cuda(self._gpu_id) if device_output else None
        self.device_output = self._cuda is not None
        try:
            self._open()
        except Unsupported:
            if self._cuda is not None:
                self._cuda.close()
            raise
        try:
            # GetDecoderCaps(gpuid=, codec=, chromaformat=, bitdepth=) -> dict with width_min,
            # height_min, width_max, height_max: samples/advanced/decode.py and key names in the .so.
            self._limits = dict(nvc.GetDecoderCaps(gpuid=self._gpu_id, codec=nvc.cudaVideoCodec.HEVC,
                                                   chromaformat=chroma_420(nvc), bitdepth=8))
        except Exception:  # only used for a clearer error on sizes NVDEC cannot take
            self._limits = None

    def _open(self) -> None:
        nvc = self._nvc
        # Keyword names and order from the pybind11 signature/docstring of CreateDecoder in
        # PyNvVideoCodec_130.so ("use_device_memory: decoder output surface is in device memory if
        # true else on host memory"); same call in samples/advanced/decode_reconfigure.py
        # (maxwidth/maxheight) and decode_from_memory_buffer.py (cudacontext=0, cudastream=0: the
        # library makes its own). Device output: the programming guide's "Creating a Decoder" and
        # samples/advanced/decode_with_cuda_control.py pass the application's context (the
        # device's retained primary context) and stream handles with usedevicememory=True.
        context, stream = self._cuda.handles() if self._cuda is not None else (0, 0)
        try:
            self._dec = nvc.CreateDecoder(gpuid=self._gpu_id, codec=nvc.cudaVideoCodec.HEVC,
                                          cudacontext=context, cudastream=stream,
                                          usedevicememory=self.device_output,
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

    def _decode_batch(self, pkt: Any, width: int, height: int, bit_depth: int) -> List[Any]:
        """One ``Decode`` call's frames, each luma plane copied out of the decoder's buffers."""
        # Decode(PacketData) -> list of DecodedFrame (pybind11 docstring; all samples).
        if self._cuda is None:
            return [self._luma(f, width, height, bit_depth) for f in self._dec.Decode(pkt)]
        with self._cuda.ordered():
            frames = self._dec.Decode(pkt)
        return [self._cuda.luma(f, width, height, bit_depth) for f in frames]

    def decode(self, data: bytes, width: int, height: int, bit_depth: int = 8) -> List[Any]:
        buf = np.frombuffer(data, dtype=np.uint8)
        out: List[Any] = []
        if not buf.size:
            return out
        with self._lock:
            self._ensure(width, height)
            try:
                out.extend(self._decode_batch(self._packet(buf), width, height, bit_depth))
                out.extend(self._decode_batch(self._packet(None), width, height, bit_depth))
            except Exception as exc:
                self._dec = None  # parser state unknown: start a fresh session next call
                if isinstance(exc, CorruptChunk):
                    raise
                raise CorruptChunk(f"nvdec decode failed: {_reason(exc)}") from None
            self._dims = (width, height)
        return out

    def close(self) -> None:
        # Dropping the last reference destroys the decoder session (and a context it made itself).
        with self._lock:
            self._dec = None
            if self._cuda is not None:
                self._cuda.close()


class _Cuda:
    """Device output's CUDA side: the GPU's primary context (torch's), a torch stream for the
    decoder, the ordering between it and the caller's stream, and frames -> luma tensors."""

    def __init__(self, gpu_id: int) -> None:
        try:
            import torch
        except ImportError as exc:
            raise Unsupported(f"NVDEC device output needs torch: {_reason(exc)}") from None
        if not torch.cuda.is_available() or not 0 <= gpu_id < torch.cuda.device_count():
            raise Unsupported(f"NVDEC device output: no CUDA device {gpu_id} visible to torch")
        self.torch = torch
        self.device = torch.device("cuda", gpu_id)
        with torch.cuda.device(self.device):
            torch.cuda.init()
            self.stream = torch.cuda.Stream(self.device)
        try:
            # The driver API's cuDevicePrimaryCtxRetain (libcuda, from the driver): the context
            # torch's runtime API works in, so the decoder's buffers are addressable from torch.
            self._lib = ctypes.CDLL("libcuda.so.1")
            self._dev = ctypes.c_int()
            ctx = ctypes.c_void_p()
            _ck(self._lib.cuDeviceGet(ctypes.byref(self._dev), gpu_id), "cuDeviceGet")
            _ck(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self._dev), "cuDevicePrimaryCtxRetain")
        except (OSError, AttributeError) as exc:
            raise Unsupported(f"NVDEC device output: {_reason(exc)}") from None
        self.context: Optional[int] = ctx.value

    def handles(self) -> Tuple[int, int]:
        """(CUcontext, CUstream) as integers, for CreateDecoder."""
        return int(self.context or 0), int(self.stream.cuda_stream)

    @contextlib.contextmanager
    def ordered(self):
        """Around a ``Decode`` call: the decoder's stream after the caller's work (which may still
        read the previous frames' buffers), the caller's stream after the decoder's."""
        current = self.torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with self.torch.cuda.device(self.device):
            yield
        current.wait_stream(self.stream)

    def luma(self, frame: Any, width: int, height: int, bit_depth: int) -> Any:
        """The frame's luma plane as a new tensor on the device (uint8, or uint16 for P016)."""
        torch = self.torch
        t = torch.from_dlpack(frame)  # zero-copy view of the decoder's buffer (guide: Interoperability)
        if t.device != self.device:
            raise CorruptChunk(f"NVDEC frame is on {t.device}, expected {self.device}")
        while t.dim() > 2 and t.shape[-1] == 1:  # (rows, width, 1) -> (rows, width)
            t = t.squeeze(-1)
        if t.dim() == 1 and t.numel() % (height * 3 // 2) == 0:  # a packed frame exported flat
            t = t.view(height * 3 // 2, -1)
        wide = bit_depth > 8
        if wide and t.dtype == torch.uint8 and t.dim() == 2 and t.shape[1] >= 2 * width and t.stride(1) == 1:
            t = t[:, :2 * width].view(torch.int16)  # P016 exported as bytes: two per sample
        elif wide and t.dtype in (torch.uint16, torch.int16):
            t = t.view(torch.int16)  # torch's uint16 has few kernels; the shift is done on int16
        elif wide or t.dtype != torch.uint8:
            raise CorruptChunk(f"NVDEC frame is {t.dtype}, expected {'P016' if wide else 'NV12'}")
        if t.dim() != 2 or t.shape[0] < height or t.shape[1] < width:
            raise CorruptChunk(f"NVDEC frame is {list(t.shape)}, expected at least {height}x{width} luma rows")
        y = t[:height, :width]  # NV12 / P016: the luma rows first, then the interleaved chroma
        if not wide:
            return y.clone(memory_format=torch.contiguous_format)
        # P016: 10 bits at the top of each 16-bit word; >> on int16 is arithmetic, hence the mask
        return ((y >> (16 - bit_depth)) & ((1 << bit_depth) - 1)).view(torch.uint16)

    def close(self) -> None:
        if self.context is not None:
            release = getattr(self._lib, "cuDevicePrimaryCtxRelease_v2", None) or self._lib.cuDevicePrimaryCtxRelease
            release(self._dev)
            self.context = None


def _ck(status: int, call: str) -> None:
    if status != 0:
        raise Unsupported(f"NVDEC device output: {call} failed with CUDA driver error {status}")
