"""The model's view of the x265 candidates: the mean KL and top-1 of
``kvcodec_tools.quality.evaluate.compare`` with each candidate's codec params, on texts of the
eval set, at the same QP (``kl_rows``).
"""
from __future__ import annotations

from typing import Any, Dict, Sequence

import numpy as np

from .encode_common import Candidate, codec_params


def kl_rows(engine, scheme, candidates: Sequence[Candidate], texts: Sequence[int], prefix: int) -> Dict[str, Any]:
    """Mean KL and top-1 (``kvcodec_tools.quality.evaluate.compare``) per candidate, means over ``texts``."""
    from dataclasses import replace

    from kvcodec_tools.quality import evalset
    from kvcodec_tools.quality.evaluate import compare, reference

    out: Dict[str, Dict[str, Any]] = {c.name: {"per_text": {}} for c in candidates}
    for t in texts:
        text = evalset.EVAL_SET[t]
        (_, ids), = evalset.load([text], engine.tokenize, prefix + 64)
        ref = reference(engine, ids, prefix, 64)
        for c in candidates:
            r = compare(engine, ref, replace(scheme, codec_params=codec_params(c)))
            out[c.name]["per_text"][text.name] = {"mean_kl": r.mean_kl, "top1": r.top1_agreement,
                                                  "ratio_vs_fp16": r.ratio_vs_fp16, "greedy": r.greedy_match_tokens}
            print(f"  KL {text.name} {c.name}: {r.mean_kl:.6f} top-1 {r.top1_agreement:.3f} "
                  f"ratio {r.ratio_vs_fp16:.3f}", flush=True)
    for row in out.values():
        per = list(row["per_text"].values())
        row["mean_kl"] = round(float(np.mean([p["mean_kl"] for p in per])), 6)
        row["top1"] = round(float(np.mean([p["top1"] for p in per])), 4)
    return out
