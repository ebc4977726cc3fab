"""Decoder self-test: an HEVC decoder checked once, at start-up, on reference streams of every
stream profile the video rungs write, instead of hashing every chunk it decodes on the host.

A *stream profile* is what shapes an HEVC stream's syntax for a decoder: bit depth, lossless or
not, x265 preset and tuning. The rungs write three (``PROFILES``, each named after the scheme whose
``codec_params`` it takes, ``format/codecs.py``): ``lossless8`` (HEVC Main, x265 lossless,
ultrafast), ``video-q8`` (HEVC Main, constant QP, ultrafast), ``video`` (HEVC Main10, constant QP,
medium, no psycho-visual tuning). The QP is not part of a profile: it changes values, not the
tools a decoder runs (``stream_profile``).

Reference streams live in ``reference/`` (committed, a few KB each): ``FRAMES`` frames of
``WIDTH`` x ``HEIGHT`` (NVDEC decodes HEVC from 144x144 up; a width that is no multiple of 64 leaves
pitch padding in the decoder's surfaces), made by the project's own encoder path
(``hevc.Hevc.encode``) from planes that reach both ends of the sample range. ``streams.json``
holds, per profile, the settings, the planes' shape and dtype, the stream's SHA-256 and the planes
digest (``encode.planes_digest``) of its software decode (PyAV/FFmpeg), as ingest takes it.
``python -m kvcodec.bitstream.selftest --regenerate`` makes them again (needs PyAV and x265).

- ``verify(decoder) -> {profile: {"ok", "status", "detail"}}`` decodes each reference stream with
  ``decoder`` (the ``hevc`` decoder contract: ``decode(data, width, height, bit_depth)`` -> one
  luma plane per frame, numpy or a torch tensor on a GPU) and compares the planes' digest with the
  reference's: ``status`` is ``ok``, ``mismatch`` or ``error``.
- ``VerifiedDecoders(name, gpu_id=, device_output=, threads=)``: the decoder a ``ChunkDecoder``
  uses, made once by name (``hevc.DECODERS``; ``auto``: NVDEC if it opens, else PyAV) and
  self-tested; ``choose(profile)`` gives the decoder for a profile and whether it passed. A decoder
  that failed a profile is not used for it: ``auto`` falls back to PyAV (self-tested too), any
  other name raises ``Unsupported`` for that profile's chunks (a miss, with the reason).
- ``python -m kvcodec.bitstream.selftest [--decoder nvdec] [--device-output]`` prints the result.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from ..errors import Unsupported

REFERENCE_DIR = Path(__file__).resolve().parent / "reference"
INDEX = "streams.json"
FORMAT = "kvcodec-decoder-selftest/1"
PROFILES = ("lossless8", "video-q8", "video")
FRAMES, HEIGHT, WIDTH = 6, 152, 184

Result = Dict[str, Any]


# -- stream profiles ------------------------------------------------------------------------------
def _key(params: Dict[str, Any]) -> Tuple[bool, int, str, str]:
    """What of an ``hevc`` coder's parameters shapes the stream's syntax (``hevc.Hevc`` defaults)."""
    return (bool(params.get("lossless", True)), int(params.get("bit_depth", 8)), str(params.get("preset", "ultrafast")),
            str(params.get("tune", "")))


def profile_params(name: str) -> Dict[str, Any]:
    """The ``hevc`` parameters of profile ``name``: its scheme's, as the rung writes them."""
    from ..format.codecs import SCHEMES

    return dict(SCHEMES[name].codec_params)


def stream_profile(codec_params: Dict[str, Any]) -> Optional[str]:
    """The profile of a chunk's ``hevc`` parameters, or None where no reference stream covers them
    (such chunks keep the host digest check)."""
    try:
        key = _key(codec_params)
    except (TypeError, ValueError):
        return None
    for name in PROFILES:
        if _key(profile_params(name)) == key:
            return name
    return None


# -- reference streams ----------------------------------------------------------------------------
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


def load_index(directory: Path = REFERENCE_DIR) -> Dict[str, Any]:
    return json.loads((Path(directory) / INDEX).read_text())


def _digest(planes: np.ndarray) -> str:
    from ..encode import planes_digest

    return planes_digest(planes)


def host_array(planes: Any) -> np.ndarray:
    """Planes as a host numpy array: numpy as it is, a torch tensor copied from its device."""
    if isinstance(planes, np.ndarray):
        return planes
    import torch

    planes = planes.detach().cpu()
    if planes.dtype == torch.uint16:  # through int16: numpy conversion of uint16 is recent in torch
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


def regenerate(directory: Path = REFERENCE_DIR, log=print) -> Dict[str, Any]:
    """Encode every profile's reference stream with the project's encoder and write it with its
    digests (the software decode's, as ingest takes them) to ``directory``."""
    import av

    from .hevc import Hevc, PyAVDecoder

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    index: Dict[str, Any] = {"format": FORMAT, "made_with": {"av": av.__version__}, "profiles": {}}
    for name in PROFILES:
        params = profile_params(name)
        coder = Hevc(**params)
        planes = reference_planes(coder.bit_depth)
        data = coder.encode(planes)
        decoded = np.stack(PyAVDecoder().decode(data, WIDTH, HEIGHT, coder.bit_depth))
        if coder.lossless and not np.array_equal(decoded, planes):
            raise RuntimeError(f"{name}: the lossless reference stream does not decode to its planes")
        (directory / f"{name}.hevc").write_bytes(data)
        index["profiles"][name] = {
            "file": f"{name}.hevc", "codec_params": params, "bit_depth": coder.bit_depth,
            "shape": list(decoded.shape), "dtype": decoded.dtype.name, "bytes": len(data),
            "stream_sha256": hashlib.sha256(data).hexdigest(), "planes_digest": _digest(decoded)}
        log(f"{name}: {len(data)} bytes, {decoded.dtype.name}{list(decoded.shape)}")
    (directory / INDEX).write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return index


# -- the self-test --------------------------------------------------------------------------------
def verify_one(decoder: Any, entry: Dict[str, Any], directory: Path = REFERENCE_DIR) -> Result:
    t0 = time.perf_counter()
    try:
        data = (Path(directory) / entry["file"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["stream_sha256"]:
            return {"ok": False, "status": "error", "detail": f"reference stream {entry['file']} is damaged"}
        frames, height, width = entry["shape"]
        planes = to_host(decoder.decode(data, width, height, int(entry["bit_depth"])))
        got = f"{planes.dtype.name}{list(planes.shape)}"
        if got != f"{entry['dtype']}{list(entry['shape'])}":
            return {"ok": False, "status": "mismatch", "detail": f"decoded {got}, expected {entry['dtype']}{entry['shape']}"}
        if _digest(planes) != entry["planes_digest"]:
            return {"ok": False, "status": "mismatch", "detail": _differing(planes, entry)}
    except Exception as exc:  # every failure is the result, never a crash of the caller's start-up
        return {"ok": False, "status": "error", "detail": f"{type(exc).__name__}: {str(exc).strip()[:200]}"}
    return {"ok": True, "status": "ok", "detail": f"{got} in {(time.perf_counter() - t0) * 1000:.1f} ms"}


def _differing(planes: np.ndarray, entry: Dict[str, Any]) -> str:
    """How a mismatching decode differs: per frame statistics, and for a lossless stream how many
    samples differ from the planes it was made from (lossy ones' decodes are not stored)."""
    frames = ", ".join(f"frame {i}: min {int(p.min())} max {int(p.max())} mean {float(p.mean()):.2f}"
                       for i, p in enumerate(planes))
    detail = f"planes digest differs from the reference's ({frames})"
    if entry["codec_params"].get("lossless"):
        want = reference_planes(int(entry["bit_depth"]), *entry["shape"])
        detail += f"; {int((planes != want).sum())} of {want.size} samples differ from the encoded planes"
    return detail


def verify(decoder: Any, directory: Path = REFERENCE_DIR) -> Dict[str, Result]:
    """Each profile's reference stream decoded by ``decoder`` against its digest."""
    try:
        entries = load_index(directory)["profiles"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        detail = f"reference streams unreadable in {directory}: {type(exc).__name__}: {exc}"[:300]
        return {name: {"ok": False, "status": "error", "detail": detail} for name in PROFILES}
    return {name: verify_one(decoder, entries.get(name) or {}, directory) for name in PROFILES}


def open_decoder(name: str, *, threads: int = 1, gpu_id: int = 0, device_output: bool = False,
                 timeout_s: float = 30.0) -> Any:
    """Decoder ``name`` of ``hevc.DECODERS``, given the options its class takes (``threads`` for
    PyAV, ``gpu_id`` and ``device_output`` for NVDEC, ``timeout_s`` for ``pyav-process``). Raises
    ``Unsupported`` if it cannot be made."""
    from .hevc import DECODERS

    cls = DECODERS.get(name)
    offered = {"threads": threads, "gpu_id": gpu_id, "device_output": device_output, "timeout_s": timeout_s}
    params = inspect.signature(cls).parameters
    try:
        return cls(**{k: v for k, v in offered.items() if k in params})
    except ImportError as exc:
        raise Unsupported(f"decoder {name} unavailable: {exc}") from None


class VerifiedDecoders:
    """The HEVC decoder of one ``ChunkDecoder``, made once and self-tested per stream profile.
    ``isolate``: PyAV runs in a process of its own (``pyav-process``, ``bitstream.isolated``),
    each chunk within ``timeout_s``."""

    def __init__(self, name: str = "pyav", *, threads: int = 1, gpu_id: int = 0, device_output: bool = False,
                 directory: Path = REFERENCE_DIR, isolate: bool = False, timeout_s: float = 30.0) -> None:
        self.name = name
        self.decoders: Dict[str, Any] = {}  # registry name -> decoder, in order of preference
        self.results: Dict[str, Dict[str, Result]] = {}  # registry name -> profile -> result
        self.unavailable: Dict[str, str] = {}  # registry name -> why it could not be made
        candidates = ["nvdec", "pyav"] if name == "auto" else [name]
        if isolate:
            candidates = ["pyav-process" if c == "pyav" else c for c in candidates]
        for candidate in candidates:
            try:
                decoder = open_decoder(candidate, threads=threads, gpu_id=gpu_id, device_output=device_output,
                                       timeout_s=timeout_s)
            except Unsupported as exc:
                self.unavailable[candidate] = str(exc)
                continue
            self.decoders[candidate] = decoder
            self.results[candidate] = verify(decoder, directory)
            if all(r["ok"] for r in self.results[candidate].values()):
                break  # auto: PyAV is made only where NVDEC failed a profile or would not open

    @property
    def verified_profiles(self) -> set:
        """The profiles some decoder here passed."""
        return {p for r in self.results.values() for p, v in r.items() if v["ok"]}

    def summary(self) -> Dict[str, Any]:
        """For the log: per decoder and profile, ok or what went wrong; decoders that would not open."""
        out: Dict[str, Any] = {d: {p: v["detail"] if v["ok"] else f"{v['status']}: {v['detail']}" for p, v in r.items()}
                               for d, r in self.results.items()}
        out.update({d: f"unavailable: {why}" for d, why in self.unavailable.items()})
        return out

    def choose(self, profile: Optional[str]) -> Tuple[Any, bool]:
        """(decoder, verified) for chunks of ``profile``: the first decoder that passed it; for a
        profile with no reference stream (None), the first decoder, unverified."""
        if profile is None and self.decoders:
            return next(iter(self.decoders.values())), False
        for candidate, decoder in self.decoders.items():
            if self.results[candidate].get(profile, {}).get("ok"):
                return decoder, True
        why = [f"{d}: unavailable ({reason})" for d, reason in self.unavailable.items()]
        why += [f"{d}: {r[profile]['status']} ({r[profile]['detail']})" for d, r in self.results.items() if profile in r]
        raise Unsupported(f"no {self.name} decoder passed its start-up self-test for HEVC stream profile "
                          f"{profile}: {'; '.join(why) or 'none made'}"[:400])

    def close(self) -> None:
        for decoder in self.decoders.values():
            decoder.close()
        self.decoders.clear()


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcodec.bitstream.selftest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--regenerate", action="store_true", help=f"encode the reference streams again into {REFERENCE_DIR}")
    ap.add_argument("--decoder", default="pyav", help="decoder to self-test: pyav, nvdec, auto (default pyav)")
    ap.add_argument("--gpu-id", type=int, default=0)
    ap.add_argument("--device-output", action="store_true", help="NVDEC output kept in device memory")
    args = ap.parse_args(argv)
    if args.regenerate:
        regenerate()
        return 0
    decoders = VerifiedDecoders(args.decoder, gpu_id=args.gpu_id, device_output=args.device_output)
    try:
        print(json.dumps(decoders.summary(), indent=1))
        return 0 if decoders.verified_profiles == set(PROFILES) else 1
    finally:
        decoders.close()


if __name__ == "__main__":
    sys.exit(main())
