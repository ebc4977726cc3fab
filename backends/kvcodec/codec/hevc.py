"""HEVC planes codec: x265 encode in software, decode by PyAV (FFmpeg) or NVDEC.

Each plane becomes one luma frame of a raw Annex-B HEVC stream, 8-bit 4:2:0 with the chroma
planes held at 128, every frame an IDR picture (forced per frame, so that x265 keeps the HEVC
Main profile: ``keyint=1`` would make it signal the "Main Intra" range-extension profile), so the
stream stays within what NVDEC decodes (HEVC Main, 8-bit, not monochrome). ``lossless=True`` gives x265's lossless mode (bit-exact);
otherwise ``qp`` sets a constant quantizer. Frame order is the stream order (raw streams carry
no timestamps).
"""
from __future__ import annotations

from fractions import Fraction
from typing import List, Tuple

import numpy as np

from ..errors import CorruptChunk, Unsupported
from ..registry import Registry
from . import BitstreamCodec

DECODERS: Registry = Registry("hevc decoder")
DECODERS.register("pyav", "kvcodec.codec.hevc:PyAVDecoder")
DECODERS.register("nvdec", "kvcodec.codec.nvdec:NvdecDecoder")


class PyAVDecoder:
    """Software HEVC decode with FFmpeg through PyAV."""

    name = "pyav"

    def __init__(self, threads: int = 1) -> None:
        import av

        self._av = av
        self._threads = int(threads)

    def decode(self, data: bytes, width: int, height: int) -> List[np.ndarray]:
        av = self._av
        ctx = av.CodecContext.create("hevc", "r")
        ctx.thread_count = self._threads
        out: List[np.ndarray] = []
        try:
            for packet in ctx.parse(data) + ctx.parse(None):
                out.extend(_luma(f, width, height) for f in ctx.decode(packet))
            out.extend(_luma(f, width, height) for f in ctx.decode(None))
        except av.error.FFmpegError as exc:
            raise CorruptChunk(f"hevc decode failed: {exc}") from None
        return out

    def close(self) -> None:
        pass


def _luma(frame, width: int, height: int) -> np.ndarray:
    if frame.width != width or frame.height != height:
        raise CorruptChunk(f"decoded frame is {frame.width}x{frame.height}, expected {width}x{height}")
    plane = frame.planes[0]
    rows = np.frombuffer(plane, dtype=np.uint8).reshape(height, plane.line_size)
    return rows[:, :width]


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


class Hevc(BitstreamCodec):
    name = "hevc"
    RUNTIME_OPTIONS = ("decoder", "threads")

    def __init__(self, lossless: bool = True, qp: int = 0, preset: str = "ultrafast", decoder: str = "pyav",
                 threads: int = 1) -> None:
        # Only what shapes the bitstream goes into params (and so into headers and keys).
        super().__init__(lossless=bool(lossless), qp=int(qp), preset=str(preset))
        self._threads = int(threads)
        self._decoder_name = decoder
        self._decoder = None

    @property
    def lossless(self) -> bool:
        return self.params["lossless"]

    @property
    def decoder(self):
        if self._decoder is None:
            self._decoder = make_decoder(self._decoder_name, self._threads)
        return self._decoder

    def x265_params(self) -> str:
        parts = ["log-level=error", "keyint=600", "min-keyint=600", "scenecut=0", "forced-idr=1", "bframes=0",
                 "repeat-headers=1"]
        parts.append("lossless=1" if self.params["lossless"] else f"qp={self.params['qp']}")
        return ":".join(parts)

    def encode(self, planes: np.ndarray) -> bytes:
        import av

        frames, height, width = planes.shape
        if height % 8 or width % 8:
            raise ValueError(f"hevc planes must be multiples of 8 in size, got {width}x{height}")
        ctx = av.CodecContext.create("libx265", "w")
        ctx.width, ctx.height = width, height
        ctx.pix_fmt = "yuv420p"
        ctx.time_base = Fraction(1, 30)
        ctx.framerate = Fraction(30, 1)
        ctx.thread_count = self._threads
        ctx.options = {"preset": self.params["preset"], "x265-params": self.x265_params()}
        buf = np.full((height * 3 // 2, width), 128, dtype=np.uint8)
        packets = []
        for i in range(frames):
            buf[:height] = planes[i]
            frame = av.VideoFrame.from_ndarray(buf, format="yuv420p")
            frame.pts = i
            frame.pict_type = av.video.frame.PictureType.I  # an IDR picture (forced-idr=1)
            packets.extend(ctx.encode(frame))
        packets.extend(ctx.encode(None))
        return b"".join(bytes(p) for p in packets)

    def decode(self, data: bytes, shape: Tuple[int, int, int]) -> np.ndarray:
        frames, height, width = shape
        out = self.decoder.decode(data, width, height)
        if len(out) != frames:
            raise CorruptChunk(f"hevc stream held {len(out)} frames, expected {frames}")
        return np.stack(out)

    def close(self) -> None:
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None
