"""Bits where the model looks: the bit allocation (``layout.allocation``), the KVTC-style layout
(``kvtc``), the transform layouts' ``weighted`` and ``alloc`` parameters, weighted codec profiles,
and the sensitivity fit (``kvcodec_tools.quality.sensitivity``) on a tiny random Llama."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from kvcodec.encode import ChunkEncoder
from kvcodec.errors import ConfigError, CorruptChunk, ForeignChunk
from kvcodec.format.codecs import get_scheme
from kvcodec.format.geometry import Geometry
from kvcodec.layout import get_layout
from kvcodec.layout.allocation import MAX_BITS, MSE, STEP, allocate, allocation
from kvcodec.profiles import _CACHE as PROFILE_CACHE
from kvcodec.profiles import load_profile, read_profile, save_profile
from kvcodec.serving.decode import ChunkDecoder
from kvcodec.serving.restore import restore

from .conftest import AUTH, TINY_PROFILE, on_tiny_profile, structured_kv

torch.set_num_threads(1)
WEIGHTED = "tiny-w1"


@pytest.fixture
def weighted_profile(tiny_profile):
    """``tiny-w1``: the tiny profile plus weights that favour layer 0's values 16x over the rest."""
    with np.load(tiny_profile / f"{TINY_PROFILE}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    weight = np.ones(arrays["variance"].shape, dtype=np.float32)
    weight[0, 1] = 16.0
    arrays["weight"] = weight / np.exp(np.mean(np.log(weight)))
    save_profile(arrays, tiny_profile / f"{WEIGHTED}.npz")
    PROFILE_CACHE.pop(WEIGHTED, None)
    yield load_profile(WEIGHTED)
    PROFILE_CACHE.pop(WEIGHTED, None)


def weighted_profile_dir(p):
    from kvcodec.profiles import find_profile

    return find_profile(p.name)


def _greedy(variance, budget):
    bits = np.zeros(len(variance), dtype=int)
    for _ in range(budget):
        gain = [v * (MSE[b] - MSE[b + 1]) if b < MAX_BITS else -1 for v, b in zip(variance, bits, strict=True)]
        bits[int(np.argmax(gain))] += 1
    return bits


def test_allocate_is_the_greedy_reverse_water_filling():
    rng = np.random.default_rng(3)
    for _ in range(20):
        v = np.sort(rng.lognormal(0, 2, 12))[::-1]
        budget = int(rng.integers(0, 40))
        bits = allocate(v, budget)
        assert bits.sum() == min(budget, MAX_BITS * len(v))
        assert np.array_equal(bits, _greedy(v, budget))
        assert np.all(np.diff(bits) <= 0)  # more variance, at least as many bits
    assert allocate(np.array([0.0, 1.0]), 3).tolist() == [0, 3]
    assert allocate(np.ones(2), 100).tolist() == [MAX_BITS, MAX_BITS]


def test_the_quantizer_table_is_the_gaussian_optimum():
    # the step of b bits is where the mean squared error of a 2**b-level midrise quantizer on a unit
    # Gaussian is least, and that error is the table's (numerically, on a fine grid)
    x = np.linspace(-12, 12, 400001)
    pdf = np.exp(-x * x / 2) / np.sqrt(2 * np.pi)
    dx = x[1] - x[0]

    def mse(b, step):
        half = 2 ** (b - 1)
        idx = np.clip(np.floor(x / step), -half, half - 1)
        return float(np.sum((x - (idx + 0.5) * step) ** 2 * pdf) * dx)

    for b in range(1, MAX_BITS + 1):
        assert mse(b, STEP[b]) == pytest.approx(MSE[b], rel=0.02)
        assert mse(b, STEP[b]) <= min(mse(b, STEP[b] * 0.95), mse(b, STEP[b] * 1.05))


def test_kvtc_round_trip_keeps_sink_and_recent_tokens_exact(tiny_profile):
    g = None
    for start in (0, 256):
        kv = structured_kv(21, token_start=start).astype(np.float16)
        g = Geometry.of(kv)
        layout = get_layout("kvtc", profile=TINY_PROFILE, bits=300, sink=4, recent=16)
        planes, side = layout.to_planes(kv, token_start=start)
        assert planes.dtype == np.uint8 and planes.shape == layout.planes_shape(g) == (4 * 2, 192, 256)
        out = layout.from_planes(planes, side, g, token_start=start)
        assert out.dtype == np.float16 and out.shape == kv.shape
        exact = layout.exact_tokens(start, 256)
        assert exact.tolist() == ([0, 1, 2, 3] if start == 0 else []) + list(range(240, 256))
        assert np.array_equal(out[:, :, :, exact], kv[:, :, :, exact])
        rest = np.setdiff1d(np.arange(256), exact)
        rel = np.mean((out[:, :, :, rest].astype(np.float64) - kv[:, :, :, rest]) ** 2) / np.var(kv.astype(np.float64))
        assert rel < 0.05
    # more bits, less error; the allocation's budget is spent
    kv = structured_kv(22)
    errs = []
    for bits in (100, 200, 400):
        layout = get_layout("kvtc", profile=TINY_PROFILE, bits=bits, sink=0)
        a = allocation(layout.profile, bits, False)
        assert a.bits.sum() == min(bits * a.bits.size // 100, MAX_BITS * a.bits.size)
        planes, side = layout.to_planes(kv, token_start=0)
        errs.append(float(np.mean((layout.from_planes(planes, side, g, token_start=0) - kv) ** 2)))
    assert errs[0] > errs[1] > errs[2]


def test_kvtc_through_the_codec_and_its_failures(tiny_profile):
    kv = structured_kv(23)
    scheme = on_tiny_profile(get_scheme("kvtc", 300))
    assert scheme.layout_params == {"bits": 300, "sink": 4, "recent": 0, "profile": TINY_PROFILE}
    blob = ChunkEncoder(scheme, "m", auth=AUTH).encode(kv, "k", 0, 0)
    out = restore(ChunkDecoder("m", auth=AUTH).decode(blob, key="k"))
    assert out.shape == kv.shape and np.array_equal(out[:, :, :, :4], kv[:, :, :, :4].astype(np.float16))
    assert len(blob) < kv.size * 2 / 3  # smaller than a third of float16
    layout = get_layout("kvtc", profile=TINY_PROFILE, bits=300)
    planes, side = layout.to_planes(kv, token_start=0)
    g = Geometry.of(kv)
    with pytest.raises(CorruptChunk, match="exact tokens"):
        layout.from_planes(planes, dict(side, pca_exact=side["pca_exact"][:-2]), g, token_start=0)
    with pytest.raises(CorruptChunk, match="non-finite"):
        bad = bytearray(side["pca_exact"])
        bad[:2] = np.array([np.inf], dtype=np.float16).tobytes()
        layout.from_planes(planes, dict(side, pca_exact=bytes(bad)), g, token_start=0)
    with pytest.raises(ForeignChunk):
        layout.from_planes(planes, dict(side, pca_profile=b"0" * 32), g, token_start=0)
    with pytest.raises(CorruptChunk):
        layout.from_planes(planes[:-1], side, g, token_start=0)
    for bad_params in ({"bits": 0}, {"bits": 100 * MAX_BITS + 1}, {"sink": -1}, {"recent": 2000}):
        with pytest.raises(ConfigError):
            get_layout("kvtc", profile=TINY_PROFILE, **bad_params)


def test_weighted_steps_are_finer_where_the_weight_is(weighted_profile):
    p = weighted_profile
    kv = structured_kv(24, token_start=512)
    g = Geometry.of(kv)
    plain = get_layout("pca", profile=WEIGHTED, step=200)
    weighted = get_layout("pca", profile=WEIGHTED, step=200, weighted=1)
    f = weighted.factors(p)
    assert np.allclose(f, 1 / np.sqrt(p.weight)) and f[0, 1].max() < f[1:].min()
    assert np.all(plain.factors(p) == 1)
    err = {}
    for name, layout in (("plain", plain), ("weighted", weighted)):
        planes, side = layout.to_planes(kv, token_start=512)
        out = layout.from_planes(planes, side, g, token_start=512).astype(np.float64)
        err[name] = np.mean((out - kv)[0, 1] ** 2), np.mean((out - kv)[1:] ** 2)
    assert err["weighted"][0] < err["plain"][0] / 2  # layer 0's values: 16x the weight, 4x finer
    assert err["weighted"][1] > err["plain"][1]  # paid for elsewhere
    # video: the same scaling before the codec's quantizer
    video = get_layout("pca10", profile=WEIGHTED, step=40, weighted=1, reorder=1)
    planes, side = video.to_planes(kv, token_start=512)
    assert planes.max() <= 1023
    assert np.abs(video.from_planes(planes, side, g, token_start=512) - kv).max() < 0.1
    with np.load(weighted_profile_dir(p)) as z:
        save_profile({k: z[k] for k in z.files if k != "weight"}, weighted_profile_dir(p).parent / "tiny-plain.npz")
    PROFILE_CACHE.pop("tiny-plain", None)
    with pytest.raises(ConfigError, match="no component weights"):
        get_layout("pca", profile="tiny-plain", weighted=1).to_planes(kv, token_start=512)
    with pytest.raises(ConfigError, match="weighted must be"):
        get_layout("pca", profile=WEIGHTED, weighted=2)


def test_alloc_drops_components_given_no_bits(tiny_profile):
    kv = structured_kv(25)
    g = Geometry.of(kv)
    for name in ("pca", "pca10"):
        layout = get_layout(name, profile=TINY_PROFILE, alloc=50)
        a = allocation(layout.profile, 50, False)
        f = layout.factors(layout.profile)
        assert np.array_equal(f == 0, a.bits == 0) and (a.bits == 0).any()
        planes, side = layout.to_planes(kv, token_start=0)
        out = layout.from_planes(planes, side, g, token_start=0)
        assert np.isfinite(out).all()
        # a dropped component restores as the profile's mean: its coefficient is 0
        _, p, coeff = layout.coefficients(out.astype(np.float32), 0)
        dropped = np.broadcast_to((a.bits == 0)[:, :, None, :], coeff.shape)
        assert np.abs(coeff[dropped]).max() < 0.05 * np.abs(coeff).max()
    with pytest.raises(ConfigError, match="alloc must be"):
        get_layout("pca", profile=TINY_PROFILE, alloc=-1)


def test_a_profile_with_bad_weights_is_refused(tiny_profile, tmp_path):
    with np.load(tiny_profile / f"{TINY_PROFILE}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    for weight in (np.ones((1, 2, 3), np.float32), -np.ones(arrays["variance"].shape, np.float32),
                   np.full(arrays["variance"].shape, np.nan, np.float32)):
        path = save_profile(dict(arrays, weight=weight), tmp_path / "bad.npz")
        with pytest.raises(ConfigError, match="weights"):
            read_profile(path)
    unweighted = {k: v for k, v in arrays.items() if k != "weight"}
    assert read_profile(save_profile(unweighted, tmp_path / "plain.npz")).weight is None
    assert read_profile(tiny_profile / f"{TINY_PROFILE}.npz").weight is not None


# --- the sensitivity fit on a tiny random Llama (transformers, CPU) ---

class TinyEngine:
    """What ``kvcodec_tools.quality.sensitivity`` uses of an engine, on a 2-layer random Llama."""

    def __init__(self):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
        self.model = LlamaForCausalLM(cfg).eval()
        self.head_dim, self.device = 16, torch.device("cpu")


class Basis:
    """A stand-in profile: the identity basis on 2 layers x 2 KV heads x 16."""

    layers, channels = 2, 32
    basis = np.broadcast_to(np.eye(32, dtype=np.float32), (2, 2, 32, 32))


def test_component_gains_follow_the_queries_and_the_output_projection():
    from kvcodec_tools.quality.sensitivity import component_gains, query_pair_energy

    engine = TinyEngine()
    ids = list(range(1, 40))
    energy = query_pair_energy(engine, ids, prefix=8)
    assert energy.shape == (2, 4, 8) and (energy > 0).all()
    # the hook saw q_proj's output: recompute layer 0's by hand
    with torch.inference_mode():
        h = engine.model.model.embed_tokens(torch.tensor([ids]))
        h = engine.model.model.layers[0].input_layernorm(h)
        q = engine.model.model.layers[0].self_attn.q_proj(h)[0, 8:].double().reshape(-1, 4, 16)
    want = ((q * q).sum(0)[:, :8] + (q * q).sum(0)[:, 8:]).numpy() / q.shape[0]
    assert np.allclose(energy[0], want, rtol=1e-6)
    s = component_gains(engine, Basis, energy)
    assert s.shape == (2, 2, 32) and np.allclose(s.mean(-1), 1)
    # values, identity basis: component j (KV head g = j // 16, dim d) reaches the output through
    # the 2 query heads of its group: the squared norms of those o_proj columns
    W = engine.model.model.layers[1].self_attn.o_proj.weight.detach().double().numpy()
    raw = np.array([sum(np.sum(W[:, h * 16 + j % 16] ** 2) for h in (2 * (j // 16), 2 * (j // 16) + 1))
                    for j in range(32)])
    assert np.allclose(s[1, 1], raw / raw.mean())
    # keys: dims i and i + 8 of a head share their RoPE pair's query energy
    assert np.allclose(s[:, 0, :8], s[:, 0, 8:16]) and np.allclose(s[:, 0, 16:24], s[:, 0, 24:])


def test_layer_lambdas_find_the_layer_the_output_reads():
    from kvcodec_tools.quality.sensitivity import layer_lambdas

    class ReadsLayer1Values:
        """Logits from the mean of layer 1's values only: noise elsewhere changes nothing."""

        def prefill_chunks(self, ids, chunk):
            rng = np.random.default_rng(len(ids))
            for _ in range(len(ids) // chunk):
                yield rng.normal(size=(2, 2, 1, chunk, 4)).astype(np.float32)

        def continuation_logprobs(self, past, cont):
            logits = np.tile(past[1, 1].mean(axis=(0, 1)) * 50, (len(cont), 2))
            return logits - np.log(np.exp(logits).sum(-1, keepdims=True))

    class Rms:
        layers, channels = 2, 4
        rms = np.ones((2, 2), np.float32)

    lam = layer_lambdas(ReadsLayer1Values(), Rms, [list(range(300))], prefix=256, eps=0.1)
    assert lam[1, 1] > 1e3 * max(lam[0, 0], lam[0, 1], lam[1, 0])
    assert all(x > 0 for x in itertools.chain.from_iterable(lam))


@pytest.mark.parametrize("name", ["pca", "pca10"])
def test_transform_layouts_keep_sink_tokens_exact_in_a_contexts_first_chunk(tiny_profile, name):
    layout = get_layout(name, profile=TINY_PROFILE, sink=4, reorder=1) if name == "pca10" else \
        get_layout(name, profile=TINY_PROFILE, sink=4)
    for start in (0, 256):
        kv = structured_kv(26, token_start=start)
        kv[:, :, :, 0] *= 40  # a sink: far from the rest, it would set the component ranges
        kv = kv.astype(np.float16)
        g = Geometry.of(kv)
        planes, side = layout.to_planes(kv, token_start=start)
        assert ("pca_exact" in side) == (start == 0)
        out = layout.from_planes(planes, side, g, token_start=start)
        if start == 0:
            assert np.array_equal(out[:, :, :, :4], kv[:, :, :, :4])
            plain = get_layout(name, profile=TINY_PROFILE)
            p2, s2 = plain.to_planes(kv, token_start=0)
            err_plain = np.abs(plain.from_planes(p2, s2, g, token_start=0)[:, :, :, 4:] - kv[:, :, :, 4:]).mean()
            assert np.abs(out[:, :, :, 4:] - kv[:, :, :, 4:]).mean() <= err_plain * 1.01
        with pytest.raises(CorruptChunk, match="exact tokens"):
            layout.from_planes(planes, {k: v for k, v in side.items() if k != "pca_exact"}, g, token_start=0)
