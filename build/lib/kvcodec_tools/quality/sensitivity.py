"""``kvcodec profile weigh``: where the model looks. Per (layer, K|V, PCA component), how much an
error there moves the model's output, fitted on the fit texts (never the eval set).

Two factors, multiplied:

- **Per (layer, K|V), measured:** white Gaussian noise of ``eps`` times that (layer, K|V)'s RMS is
  added to every prefix token's K (or V) of one layer, and the mean KL of the next-token
  distributions over the continuation is read (``engine.continuation_logprobs``). KL per unit of
  squared error (summed over the ``C`` channels of a token) is that layer's ``lambda``. Noise that is
  white in the channels is white on the orthonormal PCA basis too, and in the roped keys as in the
  unroped ones.
- **Per component within a (layer, K|V), from the weights and the queries:**
  - values: an error ``u`` (a unit component, all KV heads side by side) on a value vector reaches
    the residual stream through each query head ``h`` of its group as ``W_o[:, h] u_g``: the gain is
    ``sum_h |W_o[:, h] u_{g(h)}|^2``;
  - keys (before RoPE): an error ``u`` changes the logit of query ``q`` by ``q^T R u`` for the
    relative rotation ``R`` between the two positions. Over rotations, each RoPE pair ``(i, i +
    head_dim / 2)`` keeps its energy and the cross terms average out, so the expected squared change
    is ``1/2 sum_h sum_pairs E|q_{h,pair}|^2 |u_{g(h),pair}|^2``: the queries' energy per RoPE pair
    (``q_proj``'s output, before RoPE, over the continuation tokens) weighs the component.
  Each is normalized to mean 1 over the components of its (layer, K|V).

``weight[l, k, j] = lambda[l, k] * s[l, k, j]``, then divided by its geometric mean over all
entries (so a weighted step of the same size spends about the bits an unweighted one does). A
weighted transform layout quantizes component ``j`` with a step ``1 / sqrt(weight)`` times the
uniform one (reverse water-filling on the weighted error). Only for the transformers engine's
Llama-type models (``q_proj``, ``o_proj``, rotate-half RoPE).
"""
from __future__ import annotations

import sys
from dataclasses import replace
from typing import Dict, List, Sequence

import numpy as np


def query_pair_energy(engine, ids: Sequence[int], prefix: int) -> np.ndarray:
    """E|q_{h,pair}|^2 per layer, query head and RoPE pair over the tokens after ``prefix``:
    float64 ``[layers, heads, head_dim // 2]`` (``q_proj``'s output: before RoPE)."""
    import torch

    model = engine.model
    cfg = model.config
    heads, dim = cfg.num_attention_heads, engine.head_dim
    sums: Dict[int, np.ndarray] = {}
    hooks = []
    for layer, block in enumerate(model.model.layers):
        def hook(_m, _inp, out, layer=layer):
            q = out[0].detach().double().reshape(-1, heads, dim)[prefix:]
            e = (q * q).sum(0)  # [heads, dim]
            pairs = (e[:, : dim // 2] + e[:, dim // 2:]).cpu().numpy()
            sums[layer] = sums.get(layer, 0) + pairs / max(1, q.shape[0])
        hooks.append(block.self_attn.q_proj.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([list(ids)], device=engine.device))
    finally:
        for h in hooks:
            h.remove()
    return np.stack([sums[l] for l in range(len(model.model.layers))])


def component_gains(engine, profile, pair_energy: np.ndarray) -> np.ndarray:
    """``s[l, k, j]``: keys from the queries' pair energy, values from ``o_proj``; float64
    ``[layers, 2, C]``, each (layer, K|V) normalized to mean 1."""
    model = engine.model
    cfg = model.config
    heads, kv_heads, dim = cfg.num_attention_heads, cfg.num_key_value_heads, engine.head_dim
    group = heads // kv_heads
    half = dim // 2
    L, C = profile.layers, profile.channels
    s = np.zeros((L, 2, C))
    for l in range(L):
        u = profile.basis[l].astype(np.float64).reshape(2, kv_heads, dim, C)  # [K|V, g, d, j]
        # keys: 1/2 sum_h sum_i P[h, i] (u[g, i]^2 + u[g, i + half]^2)
        upair = u[0, :, :half] ** 2 + u[0, :, half:] ** 2  # [g, half, C]
        P = pair_energy[l].reshape(kv_heads, group, half).sum(1)  # [g, half]
        s[l, 0] = 0.5 * np.einsum("gi,gij->j", P, upair)
        W = model.model.layers[l].self_attn.o_proj.weight.detach().double().cpu().numpy()  # [hidden, heads*dim]
        for h in range(heads):
            g = h // group
            out = W[:, h * dim:(h + 1) * dim] @ u[1, g]  # [hidden, C]
            s[l, 1] += (out * out).sum(0)
    return s / s.mean(axis=-1, keepdims=True)


def layer_lambdas(engine, profile, texts: List[List[int]], prefix: int, eps: float, seed: int = 0) -> np.ndarray:
    """``lambda[l, k]``: mean KL over the continuation per unit of squared error per token (summed
    over channels), from white noise of ``eps`` x RMS on one (layer, K|V) at a time; float64
    ``[layers, 2]``, the mean over ``texts``."""
    rng = np.random.default_rng(seed)
    L = profile.layers
    lam = np.zeros((L, 2))
    for n, ids in enumerate(texts, 1):
        past = np.concatenate(list(engine.prefill_chunks(ids[:prefix], 256)), axis=3).astype(np.float32)
        cont = ids[prefix:]
        ref = engine.continuation_logprobs(past, cont)
        for l in range(L):
            for k in range(2):
                sigma = eps * float(profile.rms[l, k])
                noisy = past.copy()
                noisy[l, k] += rng.normal(0.0, sigma, size=noisy[l, k].shape).astype(np.float32)
                new = engine.continuation_logprobs(noisy, cont)
                kl = float(np.mean(np.sum(np.exp(ref) * (ref - new), axis=-1)))
                lam[l, k] += max(kl, 1e-12) / (sigma * sigma * profile.channels)
            print(f"[{n}/{len(texts)}] layer {l}: lambda K {lam[l, 0] / n:.3e} V {lam[l, 1] / n:.3e}",
                  file=sys.stderr, flush=True)
    return lam / len(texts)


def fit_weights(engine, profile, texts: List[List[int]], prefix: int = 768, eps: float = 0.1) -> Dict[str, np.ndarray]:
    """The per-component weights of ``profile`` on ``texts`` (token ids, each longer than ``prefix``)."""
    energy = np.mean([query_pair_energy(engine, ids, prefix) for ids in texts], axis=0)
    s = component_gains(engine, profile, energy)
    lam = layer_lambdas(engine, profile, texts, prefix, eps)
    w = lam[:, :, None] * s
    w = w / np.exp(np.mean(np.log(np.maximum(w, 1e-30))))
    return {"weight": w.astype(np.float32), "lambda": lam.astype(np.float32), "gain": s.astype(np.float32)}


def weigh_codec_profile(settings, base: str, out, exponent: float = 0.5, texts: int = 3, prefix: int = 768,
                        continuation: int = 64, eps: float = 0.1, engine=None, base_path=None) -> dict:
    """``kvcodec profile weigh``: the codec profile ``base`` (its PCA fit, unchanged) plus the weights
    ``(lambda * s) ** exponent`` fitted on the first ``texts`` fit texts, saved to ``out``; a summary.

    The exponent tempers the model: 0.5 measured better than 1 on four eval texts with
    ``transform-zstd`` at step 160 (3.89x at mean KL 0.0067 against 3.84x at 0.0087; unweighted
    3.73x at 0.0074), see ``perf/results/README.md``. ``engine`` (already loaded) and ``base_path``
    (the base profile's file) spare a second load and the search (``kvcodec profile fit --model``)."""
    from pathlib import Path

    from kvcodec.engines import open_engine
    from kvcodec.profiles import find_profile, read_profile, save_profile
    from kvcodec_tools.quality import evalset

    engine = engine or open_engine(replace(settings, writeback=()))
    path = Path(base_path) if base_path else find_profile(base)
    profile = read_profile(path, base)
    ids = [i for _, i in evalset.load(evalset.FIT_SET[:texts], engine.tokenize, prefix + continuation)]
    fitted = fit_weights(engine, profile, ids, prefix, eps)
    w = np.power(fitted["weight"].astype(np.float64), float(exponent))
    w = w / np.exp(np.mean(np.log(w)))
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "weight"}
    arrays["weight"] = w.astype(np.float32)
    saved = save_profile(arrays, Path(out))
    lam = fitted["lambda"]
    return {"profile": str(saved), "digest": read_profile(saved).digest, "base": base, "exponent": exponent,
            "fit_texts": [t.name for t in evalset.FIT_SET[:texts]], "prefix": prefix, "eps": eps,
            "lambda_keys_over_values": round(float(lam[:, 0].mean() / lam[:, 1].mean()), 4),
            "weight_range": [round(float(w.min()), 4), round(float(w.max()), 4)]}
