"""Decoder self-test: an HEVC decoder checked once, at start-up, on a reference stream of every
stream profile the video rungs write (``bitstream.stream_profiles``), instead of hashing every chunk it
decodes on the host.

Reference streams live in ``reference/`` (committed, a few KB each), made from ``FRAMES`` planes of
``WIDTH`` x ``HEIGHT`` (NVDEC decodes HEVC from 144x144 up; a width that is no multiple of 64 leaves
pitch padding in the decoder's surfaces) by the project's own encoder path (``hevc.Hevc.encode``,
tiled into one larger frame where the profile's rung tiles, ``bitstream.tiling``) from planes that
reach both ends of the sample range. ``streams.json`` holds, per profile, the settings, the stream's
frame shape (``shape``) and dtype, the planes' shape before tiling (``planes_shape``), the stream's
SHA-256 and the digest (``format.container.planes_digest``) of its software decode's frames (PyAV/FFmpeg).
``python -m kvcodec_tools.decoder_selftest --regenerate`` makes them again (needs PyAV and x265).

- ``verify(decoder) -> {profile: {"ok", "status", "detail"}}`` decodes each reference stream with
  ``decoder`` (the ``hevc`` decoder contract: ``decode(data, width, height, bit_depth)`` -> one
  luma plane per frame, numpy or a torch tensor on a GPU) and compares the frames' digest with the
  reference's: ``status`` is ``ok``, ``mismatch`` or ``error``; never raises.
- ``reference_planes(bit_depth)`` and ``reference_frames(entry)``: what the streams were made from.

What a ``ChunkDecoder`` does with the results (which decoder is used for which profile) is
``bitstream.verified``.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, Sequence

import numpy as np

from .host import to_host
from .stream_profiles import STREAM_PROFILES

REFERENCE_DIR = Path(__file__).resolve().parent / "reference"
INDEX = "streams.json"
FORMAT = "kvcodec-decoder-selftest/2"  # 2: tiled profiles' streams hold the tiled frames
FRAMES, HEIGHT, WIDTH = 6, 152, 184

Result = Dict[str, Any]


def reference_planes(bit_depth: int, frames: int = FRAMES, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """Deterministic planes for a reference stream, different in every frame: a flat background
    (cheap to code losslessly) and a block of noise; in the first two frames also a ramp over the
    whole range and patches at both ends of it (0 and 255 or 1023)."""
    top = (1 << bit_depth) - 1
    rng = np.random.default_rng(20261204 + bit_depth)
    ramp = np.arange(128) * top // 127
    out = np.empty((frames, height, width), np.int64)
    for f in range(frames):
        out[f] = top * (1 + f) // (frames + 1)
        out[f, 40:48, 40 + 8 * f:48 + 8 * f] = rng.integers(0, top + 1, (8, 8))
        if f < 2:
            out[f, 64:72, 8:136] = ramp if f == 0 else ramp[::-1]
            out[f, -8:, :16] = top if f == 0 else 0
            out[f, :8, -16:] = 0 if f == 0 else top
    return out.astype(np.uint16 if bit_depth > 8 else np.uint8)


def reference_frames(entry: Dict[str, Any]) -> np.ndarray:
    """The frames a reference stream was encoded from (its planes, tiled as its profile tiles)."""
    from .hevc import Hevc

    bit_depth = int(entry["bit_depth"])
    planes = reference_planes(bit_depth, *entry.get("planes_shape", entry["shape"]))
    tiling = Hevc(**entry["codec_params"]).tiling(planes.shape)
    return planes if tiling is None else tiling.tile(planes, fill=1 << (bit_depth - 1))


def load_index(directory: Path = REFERENCE_DIR, index: str = INDEX) -> Dict[str, Any]:
    return json.loads((Path(directory) / index).read_text())


def _digest(planes: np.ndarray) -> str:
    from ..format.container import planes_digest

    return planes_digest(planes)


class Mismatch(Exception):
    """A reference decoded, but not to the reference's frames (status ``mismatch``)."""


class Damaged(Exception):
    """A reference file that is not what its index says (status ``error``)."""


def checked(check: Callable[[], str]) -> Result:
    """One reference check, timed: ``check()`` returns what it decoded (``uint16[6, 152, 184]``) or
    raises ``Mismatch``; anything else it raises is an ``error`` result, never a crash of the
    caller's start-up. Shared with ``entropy_selftest``."""
    t0 = time.perf_counter()
    try:
        got = check()
    except Mismatch as exc:
        return {"ok": False, "status": "mismatch", "detail": str(exc)}
    except Damaged as exc:
        return {"ok": False, "status": "error", "detail": str(exc)}
    except Exception as exc:  # noqa: BLE001 - every failure is the result
        return {"ok": False, "status": "error", "detail": f"{type(exc).__name__}: {str(exc).strip()[:200]}"}
    return {"ok": True, "status": "ok", "detail": f"{got} in {(time.perf_counter() - t0) * 1000:.1f} ms"}


def reference_bytes(entry: Dict[str, Any], directory: Path, sha_key: str, what: str) -> bytes:
    """The reference file of ``entry``; ``Damaged`` if its SHA-256 is not ``entry[sha_key]``."""
    data = (Path(directory) / entry["file"]).read_bytes()
    if hashlib.sha256(data).hexdigest() != entry[sha_key]:
        raise Damaged(f"reference {what} {entry['file']} is damaged")
    return data


def verify_all(decoder: Any, directory: Path, index: str, profiles: Sequence[str],
               one: Callable[[Any, Dict[str, Any], Path], Result], what: str) -> Dict[str, Result]:
    """``one(decoder, entry, directory)`` for each of ``profiles`` in the index file ``index``; an
    unreadable index is an ``error`` for every profile."""
    try:
        entries = load_index(directory, index)["profiles"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        detail = f"reference {what} unreadable in {directory}: {type(exc).__name__}: {exc}"[:300]
        return {name: {"ok": False, "status": "error", "detail": detail} for name in profiles}
    return {name: one(decoder, entries.get(name) or {}, directory) for name in profiles}


def verify_one(decoder: Any, entry: Dict[str, Any], directory: Path = REFERENCE_DIR) -> Result:
    def check() -> str:
        data = reference_bytes(entry, directory, "stream_sha256", "stream")
        frames, height, width = entry["shape"]
        planes = to_host(decoder.decode(data, width, height, int(entry["bit_depth"])))
        got = f"{planes.dtype.name}{list(planes.shape)}"
        if got != f"{entry['dtype']}{list(entry['shape'])}":
            raise Mismatch(f"decoded {got}, expected {entry['dtype']}{entry['shape']}")
        if _digest(planes) != entry["planes_digest"]:
            raise Mismatch(_differing(planes, entry))
        return got

    return checked(check)


def _differing(planes: np.ndarray, entry: Dict[str, Any]) -> str:
    """How a mismatching decode differs: per frame statistics, and for a lossless stream how many
    samples differ from the frames it was made from (lossy ones' decodes are not stored)."""
    frames = ", ".join(f"frame {i}: min {int(p.min())} max {int(p.max())} mean {float(p.mean()):.2f}"
                       for i, p in enumerate(planes))
    detail = f"planes digest differs from the reference's ({frames})"
    if entry["codec_params"].get("lossless"):
        want = reference_frames(entry)
        detail += f"; {int((planes != want).sum())} of {want.size} samples differ from the encoded planes"
    return detail


def verify(decoder: Any, directory: Path = REFERENCE_DIR) -> Dict[str, Result]:
    """Each profile's reference stream decoded by ``decoder`` against its digest."""
    return verify_all(decoder, directory, INDEX, STREAM_PROFILES, verify_one, "streams")
