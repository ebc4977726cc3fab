"""KV chunk <-> container bytes (kvcodec.encode, serving.decode, serving.restore) for every scheme,
and the schemes themselves."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvcodec.encode import PAYLOAD, ChunkEncoder
from kvcodec.errors import ConfigError, CorruptChunk, ForeignChunk
from kvcodec.format import container
from kvcodec.format.codecs import SCHEMES, get_scheme
from kvcodec.format.container import Container
from kvcodec.format.geometry import Geometry
from kvcodec.layout import get_layout
from kvcodec.serving.decode import ChunkDecoder
from kvcodec.serving.restore import descriptor, from_descriptor, restore

from .conftest import AUTH, on_tiny_profile

MODEL = "org/tiny@abc123"
KEY = "aaaa/bbbb/0123456789abcdef"
# every scheme, those with a codec profile on the synthetic geometry's own (tests/unit/conftest.py)
CASES = {name: on_tiny_profile(scheme) for name, scheme in SCHEMES.items()}


@pytest.fixture(scope="module")
def chunk_kv(make_kv):
    return make_kv(5)


@pytest.fixture(scope="module")
def encoded(chunk_kv, tiny_profile):
    """Each scheme's chunk of the same KV, encoded once for the module."""
    return {name: ChunkEncoder(scheme, MODEL, auth=AUTH).encode(chunk_kv, KEY, chunk_index=2, token_start=512)
            for name, scheme in CASES.items()}


def _q8_round_trip(kv: np.ndarray) -> np.ndarray:
    layout = get_layout("q8")
    planes, side = layout.to_planes(kv)
    return layout.from_planes(planes, side, Geometry.of(kv))


def _rebuild(data: bytes, **header_changes) -> bytes:
    c = container.parse(data, AUTH)
    c.header.update(header_changes)
    return Container(c.header, c.sections).to_bytes(AUTH)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_scheme_restores_float16_kv_of_the_right_shape(name, chunk_kv, encoded):
    decoder = ChunkDecoder(MODEL, auth=AUTH)
    decoded = decoder.decode(encoded[name], key=KEY)
    assert PAYLOAD not in decoded.side
    assert decoded.header.scheme == name
    assert decoded.header.scheme_id == CASES[name].identity
    assert decoded.header.chunk_index == 2 and decoded.header.token_start == 512
    kv = restore(decoded)
    assert kv.dtype == np.float16 and kv.shape == chunk_kv.shape
    assert np.isfinite(kv).all()
    err = np.abs(kv.astype(np.float32) - chunk_kv)
    span = chunk_kv.max(axis=3, keepdims=True) - chunk_kv.min(axis=3, keepdims=True)
    if SCHEMES[name].layout == "cg":  # per-token max-abs over the channels, >= 7 levels a side
        span = np.abs(chunk_kv).max(axis=(2, 4), keepdims=True) * 8 / 14
    if SCHEMES[name].layout == "pca":  # rounding in an orthonormal basis: |err| <= sqrt(C) step / 2 per vector
        layout = get_layout("pca", **CASES[name].layout_params)
        g = Geometry.of(chunk_kv)
        norms = np.linalg.norm(err.transpose(0, 1, 3, 2, 4).reshape(g.layers, 2, g.tokens, -1), axis=-1)
        bound = np.sqrt(g.kv_heads * g.head_dim) * layout.steps(layout.profile) / 2 * 1.05 + 0.05
        assert (norms <= bound[:, :, None]).all(), f"{name}: error {norms.max():.4f} too large"
    elif SCHEMES[name].layout == "kvtc":
        # its bits go to the components the tiny profile was fitted to hold the data; this random KV
        # is not that data, so only: nearer than zeros are (quality on fitted data: test_kvtc.py)
        rel = np.sqrt((err ** 2).mean() / (chunk_kv.astype(np.float32) ** 2).mean())
        assert rel < 0.95, f"{name}: relative RMS error {rel:.3f}"
    elif SCHEMES[name].layout == "pca10":  # lossy HEVC on the coefficients: an error budget, not a bound
        rel = np.sqrt((err ** 2).mean() / (chunk_kv.astype(np.float32) ** 2).mean())
        assert rel < 0.1, f"{name}: relative RMS error {rel:.3f}"
    else:
        assert (err <= span / 8 + 1e-2).all(), f"{name}: error {err.max():.4f} too large"
    decoder.close()


@pytest.mark.parametrize("name", ["lossless8", "int8-zstd"])
def test_lossless_8bit_schemes_restore_exactly_the_q8_round_trip(name, chunk_kv, encoded):
    decoded = ChunkDecoder(MODEL, auth=AUTH).decode(encoded[name], key=KEY)
    kv = restore(decoded)
    want = _q8_round_trip(chunk_kv)
    assert np.array_equal(kv.view(np.uint16), want.view(np.uint16)), (
        f"{name}: {int((kv != want).sum())} values differ from the q8 round trip")


def test_raw_restores_the_float16_of_the_input_exactly(chunk_kv, encoded):
    decoded = ChunkDecoder(MODEL, auth=AUTH).decode(encoded["raw"], key=KEY)
    kv = restore(decoded)
    assert np.array_equal(kv.view(np.uint16), chunk_kv.astype(np.float16).view(np.uint16))


def _raw_chunk(kv: np.ndarray, kv_dtype: str) -> bytes:
    return ChunkEncoder(get_scheme("raw", kv_dtype=kv_dtype), MODEL, auth=AUTH).encode(kv, KEY, 2, 512)


@pytest.mark.parametrize("dtype, bits", [("float32", np.uint32), ("float16", np.uint16)])
def test_raw_round_trips_the_engines_own_kv_bit_exactly(dtype, bits, chunk_kv):
    """The engine's KV in its own dtype (float32 on CPU, float16 on GPU): encode -> container ->
    decode -> restore, directly and over the kv_decode -> kv_restore wire, gives its bits back."""
    kv = chunk_kv.astype(dtype)
    decoded = ChunkDecoder(MODEL, auth=AUTH).decode(_raw_chunk(kv, dtype), key=KEY)
    assert decoded.header.layout == "native" and decoded.header.layout_params == {"dtype": dtype}
    for out in (restore(decoded), restore(_over_the_wire(decoded))):
        assert out.dtype == np.dtype(dtype) and out.shape == kv.shape
        assert np.array_equal(out.view(bits), kv.view(bits))


def test_raw_of_float32_kv_is_another_identity_and_key_than_of_float16():
    from kvcodec.format.keys import chunk_keys

    f16, f32 = get_scheme("raw", kv_dtype="float16"), get_scheme("raw", kv_dtype="float32")
    assert f16.identity == 'raw/v2/native{"dtype":"float16"}/identity{}' == get_scheme("raw").identity
    assert f32.identity == 'raw/v2/native{"dtype":"float32"}/identity{}'
    ids = list(range(600))
    assert not set(chunk_keys(ids, MODEL, f16.identity, 256)) & set(chunk_keys(ids, MODEL, f32.identity, 256))
    assert get_scheme("int8-zstd", kv_dtype="float32") is SCHEMES["int8-zstd"]  # only raw stores the dtype


def test_a_card_binds_the_kv_dtype_and_the_profile_for_every_caller():
    from kvcodec.engines import ModelCard
    from kvcodec.format.ladder import parse_ladder, parse_rung

    card = ModelCard(name="m", model_id=MODEL, layers=4, kv_heads=3, head_dim=64, vocab_size=10, max_context=64,
                     codec_profile="tiny-v1", kv_dtype="float32")
    assert parse_rung("raw", card) == get_scheme("raw", kv_dtype="float32") == get_scheme("raw").for_card(card)
    assert parse_rung("transform-zstd:80", card) == get_scheme("transform-zstd", 80, profile="tiny-v1")
    assert [s.identity for s in parse_ladder("raw,int8-zstd", card)] == [
        get_scheme("raw", kv_dtype="float32").identity, get_scheme("int8-zstd").identity]
    assert ModelCard(name="m", model_id=MODEL, layers=1, kv_heads=1, head_dim=4, vocab_size=10,
                     max_context=64).kv_dtype == "float16"  # the default
    with pytest.raises(ConfigError, match="kv_dtype 'bfloat16'"):
        ModelCard(name="m", model_id=MODEL, layers=1, kv_heads=1, head_dim=4, vocab_size=10, max_context=64,
                  kv_dtype="bfloat16")


def test_an_old_float16_raw_chunk_is_foreign(encoded):
    """raw v1 (layout fp16, always float16): never read as the engine's own bytes."""
    data = _rebuild(encoded["raw"], scheme_id="raw/v1/fp16/identity{}", layout="fp16", layout_params={},
                    layout_version=1)
    with pytest.raises(ForeignChunk, match="codec"):
        ChunkDecoder(MODEL, auth=AUTH).decode(data, key=KEY)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64", 32])
def test_restore_refuses_a_raw_dtype_it_does_not_read(dtype, chunk_kv):
    decoded = ChunkDecoder(MODEL, auth=AUTH).decode(_raw_chunk(chunk_kv, "float32"), key=KEY)
    text, side = descriptor(decoded)
    d = json.loads(text)
    d["header"]["layout_params"]["dtype"] = dtype
    with pytest.raises(ForeignChunk, match="dtype"):
        restore(from_descriptor(json.dumps(d), side, decoded.planes))


def test_restore_refuses_raw_planes_of_the_other_dtype(chunk_kv):
    """float16 planes under a header that says float32 are half the width: corrupt, never reinterpreted."""
    decoded = ChunkDecoder(MODEL, auth=AUTH).decode(_raw_chunk(chunk_kv, "float16"), key=KEY)
    text, side = descriptor(decoded)
    d = json.loads(text)
    d["header"]["layout_params"]["dtype"] = "float32"
    with pytest.raises(CorruptChunk, match="float32 planes"):
        restore(from_descriptor(json.dumps(d), side, decoded.planes))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_restore_refuses_kv_that_is_not_finite_in_either_dtype(dtype, value, chunk_kv):
    kv = chunk_kv.astype(dtype)
    kv[1, 0, 2, 17, 5] = value
    decoded = ChunkDecoder(MODEL, auth=AUTH).decode(_raw_chunk(kv, dtype), key=KEY)
    with pytest.raises(CorruptChunk, match="not finite"):
        restore(decoded)
    kv[1, 0, 2, 17, 5] = np.finfo(dtype).max  # the largest finite value is fine
    assert restore(ChunkDecoder(MODEL, auth=AUTH).decode(_raw_chunk(kv, dtype), key=KEY)).dtype == np.dtype(dtype)


def _over_the_wire(decoded, planes=None):
    """``decoded`` as kv_restore receives it from kv_decode: header JSON, side bytes, typed planes."""
    text, side = descriptor(decoded)
    return from_descriptor(text.encode(), side, decoded.planes if planes is None else planes)


def test_restore_accepts_planes_as_they_travel_between_steps(chunk_kv, encoded):
    decoded = ChunkDecoder(MODEL, auth=AUTH).decode(encoded["int8-zstd"], key=KEY)
    assert np.array_equal(restore(_over_the_wire(decoded)), restore(decoded))


def test_video_q8_is_lossy_but_close(chunk_kv, encoded):
    decoded = ChunkDecoder(MODEL, auth=AUTH).decode(encoded["video-q8"], key=KEY)
    kv = restore(decoded).astype(np.float32)
    q8 = _q8_round_trip(chunk_kv).astype(np.float32)
    step = (chunk_kv.max(axis=3, keepdims=True) - chunk_kv.min(axis=3, keepdims=True)) / 255
    levels = np.abs(kv - q8) / np.maximum(step, 1e-6)
    assert levels.mean() < 2.0, f"video-q8: mean error {levels.mean():.2f} q8 levels"


def test_10bit_planes_travel_typed_and_restore_the_same(encoded):
    decoded = ChunkDecoder(MODEL, auth=AUTH).decode(encoded["video"], key=KEY)
    assert decoded.planes.dtype == np.uint16 and decoded.header.to_dict()["planes_dtype"] == "uint16"
    assert np.array_equal(restore(_over_the_wire(decoded)), restore(decoded))
    with pytest.raises(CorruptChunk, match="shape"):
        restore(_over_the_wire(decoded, decoded.planes[:, :, :-2]))
    with pytest.raises(CorruptChunk, match="uint8"):  # planes of the wrong sample type
        restore(_over_the_wire(decoded, decoded.planes.astype(np.uint8)))
    text, side = descriptor(decoded)
    with pytest.raises(CorruptChunk, match="dtype"):
        from_descriptor(text.replace('"planes_dtype":"uint16"', '"planes_dtype":"float64"'), side, decoded.planes)


def test_a_chunk_of_another_model_is_foreign(encoded):
    with pytest.raises(ForeignChunk, match="model_id"):
        ChunkDecoder("org/other@abc123", auth=AUTH).decode(encoded["int8-zstd"], key=KEY)


def test_a_wrong_expected_key_is_foreign(encoded):
    decoder = ChunkDecoder(MODEL, auth=AUTH)
    with pytest.raises(ForeignChunk, match="key"):
        decoder.decode(encoded["int8-zstd"], key=KEY[:-1] + "0")
    decoder.decode(encoded["int8-zstd"])  # no key given: no key check


@pytest.mark.parametrize("tamper", [
    {"scheme_id": "lossless8/v2/q8/hevc{}"},
    {"scheme_id": SCHEMES["lossless8"].identity},  # scheme says int8-zstd
    {"scheme": "int9-zstd"},
    {"scheme": "raw"},
    {"codec_params": {"level": 9}},  # no longer matches the scheme_id
    {"codec_params": "level=3"},
])
def test_a_tampered_codec_identity_is_foreign(tamper, encoded):
    data = _rebuild(encoded["int8-zstd"], **tamper)
    with pytest.raises(ForeignChunk, match="codec"):
        ChunkDecoder(MODEL, auth=AUTH).decode(data, key=KEY)


def test_codec_params_this_build_cannot_take_are_foreign(encoded):
    params = dict(SCHEMES["int8-zstd"].codec_params, window=5)
    scheme_id = get_scheme("int8-zstd").identity.replace('{"level":3}', '{"level":3,"window":5}')
    data = _rebuild(encoded["int8-zstd"], codec_params=params, scheme_id=scheme_id)
    with pytest.raises(ForeignChunk, match="not understood"):
        ChunkDecoder(MODEL, auth=AUTH).decode(data, key=KEY)


@pytest.mark.parametrize("tamper, error", [
    ({"layout": "q4"}, ForeignChunk),
    ({"layout_version": 2}, ForeignChunk),
    ({"geometry": {"layers": 4}}, CorruptChunk),
])
def test_restore_rejects_a_header_it_does_not_read(tamper, error, encoded):
    decoded = ChunkDecoder(MODEL, auth=AUTH).decode(encoded["int8-zstd"], key=KEY)
    text, side = descriptor(decoded)
    d = json.loads(text)
    d["header"].update(tamper)
    with pytest.raises(error):
        restore(from_descriptor(json.dumps(d), side, decoded.planes))


@pytest.mark.parametrize("shape", [None, [8, 256], [8, 0, 192], ["a", 1, 1]])
def test_bad_planes_shape_in_header_is_corrupt(shape, encoded):
    data = _rebuild(encoded["int8-zstd"], planes_shape=shape)
    with pytest.raises(CorruptChunk, match="planes shape"):
        ChunkDecoder(MODEL, auth=AUTH).decode(data, key=KEY)


def test_a_chunk_without_payload_is_corrupt(encoded):
    data = container.parse(encoded["int8-zstd"], AUTH).without(PAYLOAD).to_bytes(AUTH)
    with pytest.raises(CorruptChunk, match="payload"):
        ChunkDecoder(MODEL, auth=AUTH).decode(data, key=KEY)


@pytest.mark.parametrize("name", ["lossless8", "raw"])
def test_a_flipped_payload_byte_is_corrupt(name, encoded):
    bad = bytearray(encoded[name])
    bad[len(bad) // 2 + 7] ^= 0x10
    with pytest.raises(CorruptChunk):
        ChunkDecoder(MODEL, auth=AUTH).decode(bytes(bad), key=KEY)


def test_a_rewrapped_truncated_hevc_payload_is_corrupt(encoded):
    """A valid container around half an HEVC stream: the decode itself must fail."""
    c = container.parse(encoded["lossless8"], AUTH)
    c.sections[PAYLOAD] = c.sections[PAYLOAD][: len(c.sections[PAYLOAD]) // 2]
    with pytest.raises(CorruptChunk, match="frames"):
        ChunkDecoder(MODEL, auth=AUTH).decode(c.to_bytes(AUTH), key=KEY)


def test_the_decoder_makes_one_codec_per_scheme(encoded):
    decoder = ChunkDecoder(MODEL, auth=AUTH)
    for _ in range(2):
        for name in ("int8-zstd", "raw"):
            decoder.decode(encoded[name], key=KEY)
    assert len(decoder._codecs) == 2
    decoder.close()
    assert decoder._codecs == {}


def test_get_scheme_quality_sets_the_qp_and_changes_the_identity():
    base = get_scheme("video")
    tuned = get_scheme("video", quality=20)
    qp = base.codec_params["qp"]
    assert tuned.codec_params["qp"] == 20 and qp == SCHEMES["video"].codec_params["qp"] != 20
    assert tuned.identity != base.identity and '"qp":20' in tuned.identity
    assert get_scheme("video") is SCHEMES["video"]  # the registered scheme is not changed
    assert get_scheme("int8-zstd", quality=9).codec_params == {"level": 9}
    assert get_scheme("video", quality=qp).identity == base.identity


def test_quality_chosen_for_video_reaches_the_encoder(chunk_kv):
    enc = ChunkEncoder(get_scheme("video", quality=30), MODEL, auth=AUTH)
    assert enc.codec.params["qp"] == 30 and "qp=30" in enc.codec.x265_params()


@pytest.mark.parametrize("name", ["lossless8", "raw"])
def test_quality_on_a_scheme_without_one_raises(name):
    with pytest.raises(ConfigError, match=name):
        get_scheme(name, quality=10)


def test_unknown_codec_name_raises_config_error():
    with pytest.raises(ConfigError, match="'h266'.*cachegen, int8-zstd, kvtc, kvtc-w, lossless8, nlevel-zstd, raw, transform-zstd, video"):
        get_scheme("h266")


def test_scheme_identities_are_distinct_and_name_their_parts():
    ids = {name: s.identity for name, s in SCHEMES.items()}
    assert len(set(ids.values())) == len(ids)
    assert ids["lossless8"] == 'lossless8/v2/q8/hevc{"lossless":true,"preset":"ultrafast","qp":0}'


def test_the_default_ladder_holds_only_rungs_that_pass_the_quality_gate():
    from kvcodec.format.ladder import DEFAULT_LADDER

    gated = {"kvtc-w", "transform-zstd", "video", "int8-zstd", "raw"}  # pass in perf/results/rd.json; lossless8 does not
    assert set(DEFAULT_LADDER) <= gated and "lossless8" not in DEFAULT_LADDER


def test_raw_planes_are_checked_against_the_payload_digest_without_hashing_twice(encoded):
    """For the identity coder the planes are the payload: their digest is the payload's section
    digest, already verified by the container check, so the decoder compares the two strings."""
    c = container.parse(encoded["raw"], AUTH)
    assert c.header["planes_digest"] == c.digests[PAYLOAD]
    ChunkDecoder(MODEL, auth=AUTH).decode(encoded["raw"], key=KEY)
    with pytest.raises(CorruptChunk, match="digest taken at ingest"):
        ChunkDecoder(MODEL, auth=AUTH).decode(_rebuild(encoded["raw"], planes_digest="00" * 16), key=KEY)
