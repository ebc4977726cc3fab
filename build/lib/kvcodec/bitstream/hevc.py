"""HEVC planes codec: x265 encode in software, decode by PyAV (FFmpeg) or NVDEC.

Each plane becomes one luma frame of a raw Annex-B HEVC stream, 4:2:0 with the chroma planes
held at mid-grey, every frame an intra picture (the first IDR, the rest I pictures forced per frame
with ``pict_type``, so that x265 keeps the HEVC Main profile: ``keyint=1`` would make it signal the
"Main Intra" range-extension profile; ``forced-idr=1`` in ``x265-params`` is not an x265 option and
x265 ignores it, ``perf/results/README.md``), so the
stream stays within what NVDEC decodes (HEVC Main, 8-bit, or Main10 for ``bit_depth=10``, whose
planes are ``uint16`` samples 0..1023; not monochrome). ``lossless=True`` gives x265's lossless mode (bit-exact);
otherwise ``qp`` sets a constant quantizer. Frame order is the stream order (raw streams carry
no timestamps). ``x265`` sets x265's coding tools (``"rd=2:info=0"``: ``TOOLS`` names those a scheme
may set; what keeps every frame an intra picture is not among them), measured for speed, size
and distortion by ``perf/kvcodec_tools/encode_speed.py``.

``tile`` (Mpixel, 0: off, the default) tiles the planes into few large frames before encoding and
back after decoding (``bitstream.tiling``: the arrangement follows from the planes' shape, so the
header's ``planes_shape`` and digest stay the planes'); ``stream_shape(planes_shape)`` is the
stream's ``(frames, height, width)`` and ``decode_with(decoder, data, planes_shape)`` decodes with
any decoder of the contract above (a self-tested one: ``serving.decode``) and untiles, on the
host or on the decoder's device.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, List, Optional, Tuple

import numpy as np

from ..errors import CorruptChunk
from . import BitstreamCoder
from .decoders import DECODERS, make_decoder  # noqa: F401  (the factory; DECODERS here for its importers)
from .tiling import Tiling

LARGE_FRAME = 1 << 19  # pixels (half a Mpixel): a frame PyAV decodes with slice threads


class PyAVDecoder:
    """Software HEVC decode with FFmpeg through PyAV."""

    name = "pyav"

    def __init__(self, threads: int = 1) -> None:
        import av

        self._av = av
        self._threads = int(threads)

    def decode(self, data: bytes, width: int, height: int, bit_depth: int = 8) -> List[np.ndarray]:
        av = self._av
        ctx = av.CodecContext.create("hevc", "r")
        ctx.thread_count = self._threads
        # Small frames: frame threads (every frame is an intra picture, so frames decode side by side;
        # PyAV's default, slice threads only, is 1.6x slower at 2 threads). Large frames (tiled, one
        # or a few a chunk): slice threads, x265's wavefront rows in parallel (frame threads leave a
        # single frame on one thread: 1.84x slower at 2 threads, perf/results/tiling.json).
        ctx.thread_type = "SLICE" if width * height >= LARGE_FRAME else "AUTO"
        out: List[np.ndarray] = []
        try:
            for packet in ctx.parse(data) + ctx.parse(None):
                out.extend(_luma(f, width, height, bit_depth) for f in ctx.decode(packet))
            out.extend(_luma(f, width, height, bit_depth) for f in ctx.decode(None))
        except av.error.FFmpegError as exc:
            raise CorruptChunk(f"hevc decode failed: {exc}") from None
        return out

    def close(self) -> None:
        pass


PIX_FMT = {8: "yuv420p", 10: "yuv420p10le"}
# x265 options a scheme may set in ``x265`` (coding tools: speed against size and distortion).
# The structure of the stream is not among them: keyint, forced IDR, no B frames, repeated
# headers, 4:2:0 and the profile stay as ``Hevc.x265_params`` fixes them (NVDEC must decode it).
TOOLS = frozenset({
    "rd", "rdoq-level", "ctu", "min-cu-size", "max-tu-size", "tu-intra-depth", "sao", "signhide",
    "strong-intra-smoothing", "rskip", "rskip-edge-threshold", "fast-intra", "tskip", "tskip-fast",
    "early-skip", "b-intra", "rect", "amp", "limit-modes", "limit-tu", "info", "splitrd-skip",
})
_VALUE = re.compile(r"^[0-9A-Za-z.]+$")


def x265_tools(spec: str) -> str:
    """``spec`` ("name=value:name=value") checked against ``TOOLS`` and in one canonical form
    (sorted by name), so that equal settings give equal scheme identities."""
    tools = {}
    for item in (p for p in str(spec).split(":") if p):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or name not in TOOLS or not _VALUE.match(value):
            raise ValueError(f"hevc x265 option {item!r} is not one of name=value with name in "
                             f"{', '.join(sorted(TOOLS))}")
        if name in tools:
            raise ValueError(f"hevc x265 option {name!r} is set twice in {spec!r}")
        tools[name] = value
    return ":".join(f"{k}={tools[k]}" for k in sorted(tools))
SAMPLE = {8: np.uint8, 10: np.uint16}


def _luma(frame, width: int, height: int, bit_depth: int = 8) -> np.ndarray:
    if frame.width != width or frame.height != height:
        raise CorruptChunk(f"decoded frame is {frame.width}x{frame.height}, expected {width}x{height}")
    if frame.format.name != PIX_FMT[bit_depth]:
        raise CorruptChunk(f"decoded frame is {frame.format.name}, expected {PIX_FMT[bit_depth]}")
    plane = frame.planes[0]
    dtype = np.dtype(SAMPLE[bit_depth])
    rows = np.frombuffer(plane, dtype=dtype).reshape(height, plane.line_size // dtype.itemsize)
    return rows[:, :width]


class Hevc(BitstreamCoder):
    name = "hevc"
    RUNTIME_OPTIONS = ("decoder", "threads")

    def __init__(self, lossless: bool = True, qp: int = 0, preset: str = "ultrafast", decoder: str = "pyav",
                 threads: int = 1, bit_depth: int = 8, tune: str = "", x265: str = "", tile: int = 0) -> None:
        # Only what shapes the bitstream goes into params (and so into headers and keys); an
        # 8-bit stream keeps the parameters (and the chunk keys) it had before 10-bit existed.
        if int(bit_depth) not in PIX_FMT:
            raise ValueError(f"hevc bit_depth must be 8 or 10, got {bit_depth}")
        extra = {"bit_depth": 10} if int(bit_depth) == 10 else {}
        if tune:
            extra["tune"] = str(tune)
        tools = x265_tools(x265)
        if tools:  # only when set: the identities of schemes without it stay as they were
            extra["x265"] = tools
        if not isinstance(tile, int) or isinstance(tile, bool) or not 0 <= tile <= 64:
            raise ValueError(f"hevc tile must be 0..64 Mpixel per frame, got {tile!r}")
        if tile:  # likewise
            extra["tile"] = int(tile)
        super().__init__(lossless=bool(lossless), qp=int(qp), preset=str(preset), **extra)
        self.bit_depth = int(bit_depth)
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
        if self.params.get("tune") == "mse":  # no psycho-visual tuning: these planes are data
            parts += ["psy-rd=0", "psy-rdoq=0", "aq-mode=0", "cutree=0"]
        if self.params.get("x265"):  # after the preset's and the tune's: these win
            parts.append(self.params["x265"])
        return ":".join(parts)

    def tiling(self, planes_shape: Tuple[int, int, int]) -> Optional[Tiling]:
        """How planes of ``planes_shape`` are laid out in frames (None: one plane a frame)."""
        return Tiling.of(planes_shape, self.params["tile"]) if self.params.get("tile") else None

    def stream_shape(self, planes_shape: Tuple[int, int, int]) -> Tuple[int, int, int]:
        """The stream's ``(frames, height, width)`` for planes of ``planes_shape``."""
        tiling = self.tiling(planes_shape)
        return tiling.frame_shape if tiling is not None else tuple(int(v) for v in planes_shape)

    def encode(self, planes: np.ndarray) -> bytes:
        tiling = self.tiling(planes.shape)
        if tiling is not None:
            if planes.dtype != SAMPLE[self.bit_depth]:
                raise ValueError(f"{self.bit_depth}-bit hevc planes must be {np.dtype(SAMPLE[self.bit_depth]).name}, "
                                 f"got {planes.dtype}")
            planes = tiling.tile(planes, fill=1 << (self.bit_depth - 1))
        return self._encode_frames(planes)

    def _encode_frames(self, planes: np.ndarray) -> bytes:
        import av

        frames, height, width = planes.shape
        if height % 8 or width % 8:
            raise ValueError(f"hevc planes must be multiples of 8 in size, got {width}x{height}")
        dtype = SAMPLE[self.bit_depth]
        if planes.dtype != dtype:
            raise ValueError(f"{self.bit_depth}-bit hevc planes must be {np.dtype(dtype).name}, got {planes.dtype}")
        ctx = av.CodecContext.create("libx265", "w")
        ctx.width, ctx.height = width, height
        ctx.pix_fmt = PIX_FMT[self.bit_depth]
        ctx.time_base = Fraction(1, 30)
        ctx.framerate = Fraction(30, 1)
        ctx.thread_count = self._threads
        ctx.options = {"preset": self.params["preset"], "x265-params": self.x265_params()}
        buf = np.full((height * 3 // 2, width), 1 << (self.bit_depth - 1), dtype=dtype)
        packets = []
        for i in range(frames):
            buf[:height] = planes[i]
            frame = av.VideoFrame.from_ndarray(buf, format=PIX_FMT[self.bit_depth])
            frame.pts = i
            frame.pict_type = av.video.frame.PictureType.I  # an intra picture (I; the first is IDR)
            packets.extend(ctx.encode(frame))
        packets.extend(ctx.encode(None))
        return b"".join(bytes(p) for p in packets)

    def decode(self, data: bytes, shape: Tuple[int, int, int]) -> np.ndarray:
        return self.decode_with(self.decoder, data, shape)

    def decode_with(self, decoder: Any, data: Any, shape: Tuple[int, int, int]) -> Any:
        """Planes ``shape`` from ``data`` decoded by ``decoder`` (``decode(data, width, height,
        bit_depth)`` -> frames, numpy or torch tensors on a device), untiled where tiled: a numpy
        array, or a tensor on the decoder's device."""
        tiling = self.tiling(shape)
        frames, height, width = tiling.frame_shape if tiling is not None else shape
        out = decoder.decode(data, width, height, self.bit_depth)
        if len(out) != frames:
            raise CorruptChunk(f"hevc stream held {len(out)} frames, expected {frames}")
        if not out or isinstance(out[0], np.ndarray):
            stacked = np.stack(out) if out else np.zeros((0, height, width), SAMPLE[self.bit_depth])
        else:
            import torch

            stacked = torch.stack(list(out))
        return stacked if tiling is None else tiling.untile(stacked)

    def close(self) -> None:
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None
