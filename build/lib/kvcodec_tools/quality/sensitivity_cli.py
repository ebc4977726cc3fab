"""``kvcodec profile weigh``: add sensitivity weights to a fitted codec profile
(``kvcodec_tools.quality.sensitivity``), from the command line. Apart from the sensitivity fit,
which imports numpy, so that building the ``kvcodec`` parser does not.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvcodec_tools.cli import _settings, common


def cmd_profile_weigh(args) -> int:
    from kvcodec_tools.quality.sensitivity import weigh_codec_profile

    print(json.dumps(weigh_codec_profile(_settings(args), args.base, Path(args.out), args.exponent, args.texts)))
    return 0


def register(sub) -> None:
    """``kvcodec profile weigh`` under ``kvcodec profile``'s subcommands ``sub``."""
    p = sub.add_parser("weigh", help="add sensitivity weights (where the model looks) to a fitted profile")
    common(p)
    p.add_argument("--base", required=True, help="the fitted profile to weigh (its name)")
    p.add_argument("--out", required=True, help="the weighted profile's file (.npz)")
    p.add_argument("--exponent", type=float, default=0.5, help="weights = (layer x component gain) ** this")
    p.add_argument("--texts", type=int, default=3, help="fit texts to measure on")
    p.set_defaults(func=cmd_profile_weigh)
