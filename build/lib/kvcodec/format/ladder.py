"""Rung specs: how users name a codec at a quality, and the ladder a server fetches from.

A rung spec is ``NAME`` or ``NAME:QUALITY`` (``video:12`` is the video codec at QP 12). A ladder
is a comma list of specs in preference order (best quality first): ingest stores one copy of each
chunk per rung, and the fetcher chooses a rung per chunk among those stored.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

from ..errors import ConfigError
from .codecs import Scheme, get_scheme

# The server's default ladder and ingest's default rungs: every one passes the quality gate
# (``perf/results/rd.json``); the adaptive fetcher chooses among them per chunk. ``kvtc-w`` took
# ``transform-zstd``'s place: more compression at a lower KL, and a faster decode.
DEFAULT_LADDER = ("kvtc-w", "video", "int8-zstd", "raw")


def parse_rung(spec: str, card: Optional[Any] = None) -> Scheme:
    """The scheme a rung spec names, bound to the model's ``card`` (``engines.ModelCard``: its
    codec profile and KV dtype, ``Scheme.for_card``); unbound without one (validation only)."""
    spec = spec.strip()
    name, sep, quality = spec.partition(":")
    if not name:
        raise ConfigError(f"empty codec name in {spec!r}")
    q: Optional[int] = None
    if sep:
        try:
            q = int(quality)
        except ValueError:
            raise ConfigError(f"codec {spec!r}: quality must be an integer, got {quality!r}") from None
    scheme = get_scheme(name, q)
    return scheme if card is None else scheme.for_card(card)


def parse_ladder(specs: str | Sequence[str], card: Optional[Any] = None) -> List[Scheme]:
    """Schemes of a comma list (or a sequence) of rung specs, bound to ``card`` (``parse_rung``);
    duplicates are errors."""
    items = [s for s in (specs.split(",") if isinstance(specs, str) else specs) if s.strip()]
    if not items:
        raise ConfigError(f"no codec named in {specs!r}")
    out: List[Scheme] = []
    for spec in items:
        scheme = parse_rung(spec, card)
        if any(s.identity == scheme.identity for s in out):
            raise ConfigError(f"codec {spec.strip()!r} is named twice")
        out.append(scheme)
    return out


def rung_name(scheme: Scheme) -> str:
    """The spec that names ``scheme`` (its quality shown when it is not the default)."""
    from .codecs import BOUND_PARAMS, SCHEMES

    base = SCHEMES.get(scheme.name)
    if base is None or scheme.quality_param is None:
        return scheme.name
    params, default = ((scheme.layout_params, base.layout_params) if scheme.quality_in == "layout"
                       else (scheme.codec_params, base.codec_params))
    if {k: v for k, v in params.items() if k not in BOUND_PARAMS} == \
            {k: v for k, v in default.items() if k not in BOUND_PARAMS}:
        return scheme.name
    return f"{scheme.name}:{params[scheme.quality_param]}"
