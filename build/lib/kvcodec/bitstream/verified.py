"""The fallback policy: which self-tested HEVC decoder a ``ChunkDecoder`` uses for which profile.

``VerifiedDecoders(name, gpu_id=, device_output=, threads=, isolate=, timeout_s=)``: the decoder a
``ChunkDecoder`` uses, made once by name (``bitstream.decoders``; ``auto``: NVDEC if it opens,
else PyAV) and self-tested on every stream profile (``bitstream.selftest.verify``).
``choose(profile)`` gives the decoder for a profile and whether it passed. A decoder that failed a
profile is not used for it: ``auto`` falls back to PyAV (self-tested too), any other name raises
``Unsupported`` for that profile's chunks (a miss, with the reason). ``isolate``: PyAV runs in a
process of its own (``pyav-process``, ``bitstream.isolated``), each chunk within ``timeout_s``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ..errors import Unsupported
from .decoders import open_decoder
from .selftest import REFERENCE_DIR, Result, verify


class VerifiedDecoders:
    """The HEVC decoder of one ``ChunkDecoder``, made once and self-tested per stream profile."""

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
    def verified_stream_profiles(self) -> set:
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
