"""The transform layout (``pca``, codec ``transform-zstd``): RoPE undone and redone, the PCA codec
profile (fit, file, digest), and the layout's round trip and failure modes."""
from __future__ import annotations

import numpy as np
import pytest

from kvcodec.encode import ChunkEncoder
from kvcodec.engines.model_files import CODEC_PROFILE
from kvcodec.errors import ConfigError, CorruptChunk, ForeignChunk
from kvcodec.format.codecs import get_scheme
from kvcodec.format.geometry import Geometry
from kvcodec.layout import get_layout
from kvcodec.profiles import load_profile, read_profile, save_profile
from kvcodec.profiles.rope import rope, unrope
from kvcodec.serving.decode import ChunkDecoder
from kvcodec.serving.restore import restore
from kvcodec_tools.fuzz import synthetic_profile

from .conftest import AUTH, THETA, TINY_PROFILE, on_tiny_profile, structured_kv


def test_unrope_inverts_rope_at_any_position():
    rng = np.random.default_rng(1)
    k = rng.standard_normal((3, 256, 64))
    for start in (0, 256, 7936):
        assert np.abs(unrope(rope(k, start, THETA), start, THETA) - k).max() < 1e-9
        assert np.abs(rope(unrope(k, start, THETA), start, THETA) - k).max() < 1e-9


def test_unrope_makes_the_same_key_equal_at_every_position():
    # a token's key before RoPE does not depend on its position: after rope + unrope at the
    # positions of two chunks, identical pre-RoPE keys come back identical
    pre = np.tile(np.random.default_rng(2).standard_normal((3, 1, 64)), (1, 256, 1))
    rotated = rope(pre, 512, THETA)
    assert np.abs(rotated[:, 0] - rotated[:, 100]).max() > 0.1  # RoPE moved them apart
    back = unrope(rotated, 512, THETA)
    assert np.abs(back[:, 0] - back[:, 100]).max() < 1e-9


def test_fit_finds_the_directions_the_data_lives_in(tiny_profile):
    p = load_profile(TINY_PROFILE)
    assert (p.layers, p.kv_heads, p.head_dim, p.rope_theta) == (4, 3, 64, THETA)
    share = p.variance[..., :24].sum(-1) / p.variance.sum(-1)
    assert share.min() > 0.85  # keys too: the fit undid RoPE before PCA
    assert np.all(np.diff(p.variance, axis=-1) <= 1e-6)  # components by decreasing variance
    gram = np.einsum("lkci,lkcj->lkij", p.basis, p.basis)
    assert np.abs(gram - np.eye(p.channels)).max() < 5e-3  # orthonormal up to float16 rounding
    # a refit on the same KV gives the same file (sign convention, deterministic arithmetic)
    samples = [(structured_kv(s, token_start=s * 256), s * 256) for s in range(4)]
    again = read_profile(save_profile(synthetic_profile(samples, THETA), tiny_profile / "refit.npz"), TINY_PROFILE)
    assert again.digest == p.digest


def test_round_trip_error_is_bounded_by_the_step(tiny_profile):
    kv = structured_kv(7, token_start=768)
    g = Geometry.of(kv)
    fine, coarse = get_layout("pca", profile=TINY_PROFILE, step=20), get_layout("pca", profile=TINY_PROFILE, step=300)
    for layout in (fine, coarse):
        planes, side = layout.to_planes(kv, token_start=768)
        assert planes.dtype == np.uint8 and planes.shape == layout.planes_shape(g) == (4 * 2 * 2, 192, 256)
        out = layout.from_planes(planes, side, g, token_start=768)
        assert out.dtype == np.float16 and out.shape == kv.shape
        steps = layout.steps(layout.profile)
        err = (out.astype(np.float64) - kv).transpose(0, 1, 3, 2, 4).reshape(4, 2, 256, 192)
        # per vector: |err| <= sqrt(C) * step / 2 (rounding in an orthonormal basis) + float16 rounding
        bound = np.sqrt(192) * steps / 2 * 1.05 + 0.01
        assert (np.linalg.norm(err, axis=-1) <= bound[:, :, None]).all()
    # restoring at the wrong position gives other keys: positions matter
    planes, side = fine.to_planes(kv, token_start=768)
    wrong = fine.from_planes(planes, side, g, token_start=0)
    assert np.abs(wrong[:, 0].astype(np.float32) - kv[:, 0]).max() > 0.1
    assert np.abs(wrong[:, 1].astype(np.float32) - kv[:, 1]).max() < 0.05


def test_coarser_steps_store_fewer_bytes_and_chunks_restore_at_their_position(tiny_profile):
    kv = structured_kv(8, token_start=768)
    sizes = {}
    for step in (20, 100, 300):
        scheme = on_tiny_profile(get_scheme("transform-zstd", step))
        blob = ChunkEncoder(scheme, "m", auth=AUTH).encode(kv, "k", 3, 768)
        d = ChunkDecoder("m", auth=AUTH).decode(blob, key="k")
        out = restore(d)
        assert out.shape == kv.shape
        assert np.abs(out.astype(np.float32) - kv).max() < 0.5
        sizes[step] = len(blob)
    assert sizes[20] > sizes[100] > sizes[300]


def test_a_chunk_of_another_profile_file_is_foreign(tiny_profile):
    kv = structured_kv(9)
    layout = get_layout("pca", profile=TINY_PROFILE, step=100)
    planes, side = layout.to_planes(kv, token_start=0)
    side = dict(side, pca_profile=b"0" * 32)
    with pytest.raises(ForeignChunk, match=f"another {TINY_PROFILE} codec profile"):
        layout.from_planes(planes, side, Geometry.of(kv), token_start=0)


def test_the_profile_must_fit_the_model(tiny_profile):
    kv = np.zeros((2, 2, 3, 256, 64), dtype=np.float32)
    with pytest.raises(ConfigError, match="not this model's 2 x 3 x 64"):
        get_layout("pca", profile=TINY_PROFILE).to_planes(kv)
    with pytest.raises(ConfigError, match="not found"):
        get_layout("pca", profile="nope-v9").to_planes(kv)
    with pytest.raises(ConfigError, match="step must be"):
        get_layout("pca", step=0)


def test_the_shipped_profile_is_smollm2s():
    p = load_profile(CODEC_PROFILE)  # the profile SmolLM2's model card names
    assert (p.layers, p.kv_heads, p.head_dim, p.rope_theta) == (30, 3, 64, 100000.0)
    assert get_scheme("transform-zstd", profile=CODEC_PROFILE).layout_params["profile"] == CODEC_PROFILE
    assert "profile" not in get_scheme("transform-zstd").layout_params  # the codec table names none
    # most of the variance in few components, keys (before RoPE) more than values
    share = p.variance[..., :32].sum(-1) / p.variance.sum(-1)
    assert share[:, 0].mean() > 0.7 and share[:, 1].mean() > 0.5


# --- pca10: the coefficients as 10-bit samples for the video codec (scheme "video") ---

@pytest.mark.parametrize("reorder", [0, 1])
def test_pca10_round_trip_error_is_bounded_by_the_scaled_step(tiny_profile, reorder):
    kv = structured_kv(11, token_start=256)
    g = Geometry.of(kv)
    layout = get_layout("pca10", profile=TINY_PROFILE, step=40, reorder=reorder)
    planes, side = layout.to_planes(kv, token_start=256)
    assert planes.dtype == np.uint16 and planes.shape == layout.planes_shape(g) == (4 * 2, 192, 256)
    assert planes.max() <= 1023
    shift = np.frombuffer(side["pca_shift"], dtype=np.uint8).reshape(4, 2, 192)
    assert shift.max() <= 15 and ("pca_order" in side) == bool(reorder)
    out = layout.from_planes(planes, side, g, token_start=256)
    assert out.dtype == np.float16 and out.shape == kv.shape
    # per vector: |err| <= |step * 2^shift / 2| over the components (orthonormal basis) + float16
    step = layout.steps(layout.profile)[:, :, None] * np.exp2(shift)
    bound = np.sqrt((step ** 2).sum(-1)) / 2 * 1.05 + 0.01
    err = (out.astype(np.float64) - kv).transpose(0, 1, 3, 2, 4).reshape(4, 2, 256, 192)
    assert (np.linalg.norm(err, axis=-1) <= bound[:, :, None]).all()


def test_pca10_reorder_chains_neighbours_and_restore_undoes_it(tiny_profile):
    kv = structured_kv(12)
    layout = get_layout("pca10", profile=TINY_PROFILE, reorder=1)
    planes, side = layout.to_planes(kv, token_start=0)
    order = np.frombuffer(side["pca_order"], dtype="<u2")
    assert sorted(order.tolist()) == list(range(256)) and order[0] == 0
    # neighbouring columns are closer than in token order
    cols = planes.astype(np.float64).reshape(-1, 256)
    plain = get_layout("pca10", profile=TINY_PROFILE).to_planes(kv, token_start=0)[0].astype(np.float64).reshape(-1, 256)
    assert np.abs(np.diff(cols, axis=1)).mean() < np.abs(np.diff(plain, axis=1)).mean()
    g = Geometry.of(kv)
    a = layout.from_planes(planes, side, g, token_start=0)
    b = get_layout("pca10", profile=TINY_PROFILE).from_planes(*get_layout("pca10", profile=TINY_PROFILE).to_planes(kv, token_start=0), g, token_start=0)
    assert np.abs(a.astype(np.float32) - b).max() < 0.02  # the same values, put back in place


@pytest.mark.parametrize("damage, match", [
    ({"pca_order": np.zeros(256, "<u2").tobytes()}, "not a permutation"),
    ({"pca_order": b"\x00\x01"}, "not a permutation"),
    ({"pca_shift": b"\x10" * (4 * 2 * 192)}, "shift above 15"),
    ({"pca_shift": b"\x00"}, "malformed"),
])
def test_pca10_bad_side_data_is_corrupt(tiny_profile, damage, match):
    kv = structured_kv(13)
    layout = get_layout("pca10", profile=TINY_PROFILE, reorder=1)
    planes, side = layout.to_planes(kv, token_start=0)
    with pytest.raises(CorruptChunk, match=match):
        layout.from_planes(planes, dict(side, **damage), Geometry.of(kv), token_start=0)
    with pytest.raises(CorruptChunk, match="uint16"):
        layout.from_planes(planes.astype(np.uint8), side, Geometry.of(kv), token_start=0)
    with pytest.raises(ConfigError, match="reorder"):
        get_layout("pca10", reorder=2)
