"""``kvcodec profile fit``: fit a model's codec profile (the PCA basis of the transform layouts)
on the fit texts, which share no file with the eval set (``kvcodec_tools.quality.evalset``)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional


def fit_codec_profile(settings, tokens: int, out: Optional[Path] = None) -> dict:
    """Prefill each fit text (its first ``tokens`` tokens), fit the profile, save it (default: the
    shipped profile the engine's model card names) and return a summary."""
    from kvcodec.engines import open_engine
    from kvcodec.profiles import HERE, fit_profile, read_profile, save_profile
    from kvcodec_tools.quality import evalset

    engine = open_engine(settings)
    texts = evalset.load(evalset.FIT_SET, engine.tokenize, tokens)

    def samples():
        for n, (text, ids) in enumerate(texts, 1):
            print(f"[{n}/{len(texts)}] prefill {text.name} ({len(ids)} tokens)", file=sys.stderr, flush=True)
            for i, kv in enumerate(engine.prefill_chunks(ids, settings.chunk_tokens)):
                yield kv, i * settings.chunk_tokens

    path = save_profile(fit_profile(samples(), engine.rope_theta), out or HERE / f"{engine.card.codec_profile}.npz")
    profile = read_profile(path)
    share = profile.variance[..., :32].sum(-1) / profile.variance.sum(-1)
    return {"profile": str(path), "digest": profile.digest, "bytes": path.stat().st_size,
            "fit_tokens": len(texts) * tokens,
            "variance_in_first_32_components": {"keys": round(float(share[:, 0].mean()), 4),
                                                "values": round(float(share[:, 1].mean()), 4)}}
