"""HEVC stream profiles: what of a chunk's ``hevc`` settings shapes its stream's syntax for a decoder.

A *stream profile* is bit depth, lossless or not, x265 preset and tuning, and those of a scheme's
x265 coding tools that the stream signals to its decoder (``SYNTAX_TOOLS``: block and transform
sizes, SAO, sign hiding, intra smoothing, transform skip; not the encoder's search effort such as
``rd`` or ``rdoq-level``). The rungs write four (``STREAM_PROFILES``, each named after the scheme whose
``codec_params`` it takes, ``format/codecs.py``): ``lossless8`` (HEVC Main, x265 lossless,
ultrafast), ``video-q8`` (HEVC Main, constant QP, ultrafast), ``video`` (HEVC Main10, constant QP,
medium, no psycho-visual tuning) and ``video-tiled`` (``video``'s with transform skip, in few large
frames). The QP is not part of a profile: it changes values, not the tools a decoder runs; nor is
the tiling (``tile``): it changes the frame size, which every decoder takes per stream.

- ``stream_profile(codec_params)``: the profile of a chunk's settings, or None where no reference
  stream covers them (such chunks keep the host digest check, ``serving.decode``);
- ``profile_params(name)``: the ``hevc`` parameters a profile's reference stream is made with.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

STREAM_PROFILES = ("lossless8", "video-q8", "video", "video-tiled")
# x265 tools (``hevc.TOOLS``) that set flags or sizes in the stream's parameter sets
SYNTAX_TOOLS = frozenset({"ctu", "min-cu-size", "max-tu-size", "tu-intra-depth", "sao", "signhide",
                          "strong-intra-smoothing", "tskip", "amp"})


def stream_key(params: Dict[str, Any]) -> Tuple[bool, int, str, str, str]:
    """What of an ``hevc`` coder's parameters shapes the stream's syntax (``hevc.Hevc`` defaults)."""
    tools = [t for t in str(params.get("x265", "")).split(":") if t.partition("=")[0] in SYNTAX_TOOLS]
    return (bool(params.get("lossless", True)), int(params.get("bit_depth", 8)), str(params.get("preset", "ultrafast")),
            str(params.get("tune", "")), ":".join(sorted(tools)))


def profile_params(name: str) -> Dict[str, Any]:
    """The ``hevc`` parameters of profile ``name``: its scheme's, as the rung writes them."""
    from ..format.codecs import SCHEMES

    return dict(SCHEMES[name].codec_params)


def stream_profile(codec_params: Dict[str, Any]) -> Optional[str]:
    """The profile of a chunk's ``hevc`` parameters, or None where no reference stream covers them."""
    try:
        key = stream_key(codec_params)
    except (TypeError, ValueError):
        return None
    for name in STREAM_PROFILES:
        if stream_key(profile_params(name)) == key:
            return name
    return None
