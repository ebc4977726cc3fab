"""``kvcodec profile fit``: fit a model's codec profile (the PCA basis of the transform layouts)
on the fit texts, which share no file with the eval set (``kvcodec_tools.quality.evalset``).

It also weighs the profile (``kvcodec profile weigh``'s sensitivity weights, which ``video`` and
``kvtc-w`` need; ``weigh=False``: the PCA only) and saves it where the model's card looks for it:
for a model folder (``--model DIR``) ``<model_cache>/profiles/<profile>.npz``
(``kvcodec.engines.model_files``), for the embedded model the shipped file. The
profile is the model's, not the engine's: it is fitted on the reference engine (``transformers``)
and serves both.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from kvcodec_tools.cli import _settings, common


def fit_codec_profile(settings, tokens: int, out: Optional[Path] = None, weigh: Optional[bool] = None) -> dict:
    """Prefill each fit text (its first ``tokens`` tokens), fit the profile, save it (default: the
    shipped profile the embedded model's card names, or a model folder's cached profile), weigh it
    unless ``weigh`` is False, and return a summary with the times taken."""
    from kvcodec.engines import model_files, open_engine
    from kvcodec.profiles import HERE, fit_profile, read_profile, save_profile
    from kvcodec_tools.quality import evalset

    t0 = time.perf_counter()
    settings = replace(settings, engine="transformers", writeback=())
    engine = open_engine(settings)
    folder = settings.model is not None and engine.card.codec_profile != model_files.CODEC_PROFILE
    weigh = True if weigh is None else weigh
    if out is None:
        out = (model_files.profile_path(settings.model_cache, engine.card.codec_profile) if folder
               else HERE / f"{engine.card.codec_profile}.npz")
    chunk = settings.chunk_tokens
    tokens = min(tokens, engine.card.max_context // chunk * chunk)
    texts = evalset.load(evalset.FIT_SET, engine.tokenize, tokens)
    loaded_s = time.perf_counter() - t0

    def samples():
        for n, (text, ids) in enumerate(texts, 1):
            print(f"[{n}/{len(texts)}] prefill {text.name} ({len(ids)} tokens)", file=sys.stderr, flush=True)
            for i, kv in enumerate(engine.prefill_chunks(ids, chunk)):
                yield kv, i * chunk

    t = time.perf_counter()
    path = save_profile(fit_profile(samples(), engine.rope_theta), out)
    fit_s = time.perf_counter() - t
    summary = {}
    weigh_s = 0.0
    if weigh:
        from kvcodec_tools.quality.sensitivity import weigh_codec_profile

        t = time.perf_counter()
        summary["weights"] = weigh_codec_profile(settings, engine.card.codec_profile, path, engine=engine,
                                                 base_path=path)
        weigh_s = time.perf_counter() - t
    profile = read_profile(path)
    share = profile.variance[..., :32].sum(-1) / profile.variance.sum(-1)
    return {"profile": str(path), "model_id": engine.card.model_id, "digest": profile.digest,
            "bytes": path.stat().st_size, "fit_tokens": len(texts) * tokens, "weighted": profile.weight is not None,
            "seconds": {"load": round(loaded_s, 2), "fit": round(fit_s, 2), "weigh": round(weigh_s, 2),
                        "total": round(time.perf_counter() - t0, 2)},
            "variance_in_first_32_components": {"keys": round(float(share[:, 0].mean()), 4),
                                                "values": round(float(share[:, 1].mean()), 4)}, **summary}


# -- kvcodec profile fit ---------------------------------------------------------------------------
def cmd_profile_fit(args) -> int:
    print(json.dumps(fit_codec_profile(_settings(args), args.tokens, Path(args.out) if args.out else None,
                                       weigh=args.weigh)))
    return 0


def register(sub) -> None:
    """``kvcodec profile fit`` under ``kvcodec profile``'s subcommands ``sub``."""
    p = sub.add_parser("fit", help="fit the PCA profile on the fit texts (outside the eval set) and weigh it; "
                                   "with --model, cached for that model")
    common(p)
    p.add_argument("--out", help="default: backends/kvcodec/profiles/<the model card's profile>.npz; with --model, "
                                 "<model cache>/profiles/<the model card's profile>.npz")
    p.add_argument("--weigh", action=argparse.BooleanOptionalAction, default=None,
                   help="add the sensitivity weights (video and kvtc-w need them; default on)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of each fit text")
    p.set_defaults(func=cmd_profile_fit)
