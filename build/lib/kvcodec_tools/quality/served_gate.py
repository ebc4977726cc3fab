"""The quality gate, asked of a running OpenAI-compatible server (vLLM's), for rows whose KV came
from a lossy store (LMCache's ``fp8``, this project's lossy rungs) in ``kvcodec bench peers``.

``kvcodec rd`` gates a rung on teacher-forced log-probabilities computed from the decoded KV
(mean KL <= ``KL_GATE``, top-1 agreement >= ``TOP1_GATE``). A served row has no such hook: vLLM
skips every cache (local and connector) for a request that asks for ``prompt_logprobs``. So the
gate is asked position by position: the reference server (prefill) answers each prompt greedily
for ``positions`` tokens with its ``top_k`` log-probabilities at each; the server under test is then
asked, at each position ``i``, for one token after the prompt plus the reference's first ``i``
tokens (teacher forcing on the reference's path), with its own ``top_k`` log-probabilities. Its
server holds the prompt's KV as it loaded it (vLLM's prefix cache keeps the loaded blocks), so
every position is computed over the reused KV.

KL(reference || tested) is summed over the reference's ``top_k`` tokens; a token missing from the
tested top ``top_k`` takes the tested ``k``-th log-probability (at most what it has). The verdict
says how much of the reference's probability the ``top_k`` tokens held at the worst position
(``reference_mass_min``): what the sum leaves out is at most one minus that.
"""
from __future__ import annotations

import json
import math
import urllib.request
from typing import Dict, List, Sequence, Tuple

from kvcodec_tools.quality.rd import KL_GATE, TOP1_GATE

TOP_K = 5000
POSITIONS = 16


def _post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())


def tokenize(url: str, text: str) -> List[int]:
    """The server's own token ids of ``text`` (as its completions endpoint makes them)."""
    return list(_post(url, "/tokenize", {"model": "model", "prompt": text})["tokens"])


def _top(entry: Dict[str, float]) -> Dict[int, float]:
    """``{"token_id:42": -0.1, ...}`` -> ``{42: -0.1, ...}``."""
    return {int(k.rsplit(":", 1)[1]): float(v) for k, v in entry.items()}


def _complete(url: str, ids: Sequence[int], max_tokens: int, top_k: int) -> Tuple[List[int], List[Dict[int, float]]]:
    out = _post(url, "/v1/completions", {"model": "model", "prompt": list(ids), "max_tokens": max_tokens,
                                         "temperature": 0.0, "logprobs": top_k, "return_tokens_as_token_ids": True})
    logprobs = out["choices"][0]["logprobs"]
    tokens = [int(t.rsplit(":", 1)[1]) for t in logprobs["tokens"]]
    return tokens, [_top(e) for e in logprobs["top_logprobs"]]


def reference_path(url: str, ids: Sequence[int], positions: int = POSITIONS,
                   top_k: int = TOP_K) -> Tuple[List[int], List[Dict[int, float]]]:
    """The reference's greedy tokens after ``ids`` and its top-``top_k`` log-probabilities at each."""
    return _complete(url, ids, positions, top_k)


def forced(url: str, ids: Sequence[int], path: Sequence[int], top_k: int = TOP_K) -> List[Dict[int, float]]:
    """The tested server's top-``top_k`` log-probabilities at each position of the reference's ``path``."""
    return [_complete(url, list(ids) + list(path[:i]), 1, top_k)[1][0] for i in range(len(path))]


def kl(reference: Dict[int, float], tested: Dict[int, float]) -> float:
    """KL(reference || tested) over the reference's tokens; a token the tested list lacks takes its
    lowest log-probability."""
    floor = min(tested.values())
    return max(0.0, sum(math.exp(lp) * (lp - tested.get(t, floor)) for t, lp in reference.items()))


def verdict(reference: Sequence[Sequence[Dict[int, float]]], tested: Sequence[Sequence[Dict[int, float]]]) -> dict:
    """Mean KL and top-1 agreement over every (prompt, position), and whether both pass the gate."""
    kls, agree, mass = [], [], []
    for ref_positions, test_positions in zip(reference, tested, strict=True):
        for r, t in zip(ref_positions, test_positions, strict=True):
            kls.append(kl(r, t))
            agree.append(max(r, key=r.get) == max(t, key=t.get))
            mass.append(sum(math.exp(lp) for lp in r.values()))
    if not kls:
        raise ValueError("no positions to gate")
    mean_kl, top1 = sum(kls) / len(kls), sum(agree) / len(agree)
    return {"mean_kl": round(mean_kl, 6), "max_kl": round(max(kls), 6), "top1_agreement": round(top1, 4),
            "positions": len(kls), "reference_mass_min": round(min(mass), 6), "kl_gate": KL_GATE, "top1_gate": TOP1_GATE,
            "passes": mean_kl <= KL_GATE and top1 >= TOP1_GATE}
