"""Prefix-chained chunk keys (kvcodec.format.keys)."""
from __future__ import annotations

import numpy as np
import pytest

from kvcodec.format.keys import chunk_keys, reusable_chunks

CHUNK = 256
MODEL = "org/model@rev1"
CODEC = "lossless8/v1/q8/hevc{}"


def _ids(n: int, seed: int = 0) -> list:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


def test_keys_are_deterministic_and_path_safe():
    ids = _ids(3 * CHUNK)
    a = chunk_keys(ids, MODEL, CODEC, CHUNK)
    b = chunk_keys(list(ids), MODEL, CODEC, CHUNK)
    c = chunk_keys(np.asarray(ids, dtype=np.int64), MODEL, CODEC, CHUNK)
    assert a == b == c
    assert len(a) == 3 and len(set(a)) == 3
    for key in a:
        tag_model, tag_codec, digest = key.split("/")
        assert len(tag_model) == 12 and len(tag_codec) == 12 and len(digest) == 40
        assert key == key.lower() and all(ch in "0123456789abcdef/" for ch in key)
    # every key of one (model, codec) shares the same grouping prefix
    assert len({k.rsplit("/", 1)[0] for k in a}) == 1


def test_keys_of_a_prefix_are_the_first_keys_of_the_longer_sequence():
    ids = _ids(5 * CHUNK + 17)
    full = chunk_keys(ids, MODEL, CODEC, CHUNK)
    assert len(full) == 5
    for n in (CHUNK, 2 * CHUNK, 2 * CHUNK + 100, 4 * CHUNK):
        part = chunk_keys(ids[:n], MODEL, CODEC, CHUNK)
        assert part == full[: n // CHUNK]


@pytest.mark.parametrize("changed", [0, 1, 3])
def test_one_changed_token_changes_keys_from_its_chunk_on(changed):
    ids = _ids(4 * CHUNK)
    other = list(ids)
    pos = changed * CHUNK + 123
    other[pos] += 1
    a, b = chunk_keys(ids, MODEL, CODEC, CHUNK), chunk_keys(other, MODEL, CODEC, CHUNK)
    assert a[:changed] == b[:changed]
    for i in range(changed, 4):
        assert a[i] != b[i], f"chunk {i} key unchanged after token {pos} changed"


@pytest.mark.parametrize("field", ["model_id", "codec_id", "chunk_tokens"])
def test_identity_changes_every_key(field):
    ids = _ids(4 * CHUNK)
    base = dict(model_id=MODEL, codec_id=CODEC, chunk_tokens=128)
    changed = dict(base)
    changed[field] = {"model_id": MODEL + "x", "codec_id": "video/v1/q8/hevc{}", "chunk_tokens": 256}[field]
    a = chunk_keys(ids, **base)
    b = chunk_keys(ids, **changed)
    assert not set(a) & set(b), f"a key survived a change of {field}"


def test_token_ids_are_hashed_as_int32_values_not_python_objects():
    ids = _ids(CHUNK)
    assert chunk_keys(ids, MODEL, CODEC, CHUNK) == chunk_keys(np.asarray(ids, dtype=np.int32), MODEL, CODEC, CHUNK)


def test_only_full_chunks_are_keyed():
    assert chunk_keys(_ids(CHUNK - 1), MODEL, CODEC, CHUNK) == []
    assert len(chunk_keys(_ids(CHUNK), MODEL, CODEC, CHUNK)) == 1
    assert len(chunk_keys(_ids(2 * CHUNK - 1), MODEL, CODEC, CHUNK)) == 1
    assert chunk_keys([], MODEL, CODEC, CHUNK) == []


def test_max_chunks_limits_the_keys():
    ids = _ids(4 * CHUNK)
    full = chunk_keys(ids, MODEL, CODEC, CHUNK)
    assert chunk_keys(ids, MODEL, CODEC, CHUNK, max_chunks=2) == full[:2]
    assert chunk_keys(ids, MODEL, CODEC, CHUNK, max_chunks=0) == []
    assert chunk_keys(ids, MODEL, CODEC, CHUNK, max_chunks=10) == full


@pytest.mark.parametrize("bad", [0, -256])
def test_chunk_tokens_must_be_positive(bad):
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_keys(_ids(10), MODEL, CODEC, bad)


@pytest.mark.parametrize("n, want", [(0, 0), (1, 0), (256, 0), (257, 1), (512, 1), (513, 2)])
def test_reusable_chunks_leaves_one_token_to_compute(n, want):
    assert reusable_chunks(n, CHUNK) == want
