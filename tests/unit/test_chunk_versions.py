"""Golden values of what is stored, so that a change which would turn stored chunks into misses, or
let two releases misread each other, fails CI unless it comes with its version bump
(docs/operations.md, "Upgrades and chunk versions"):

- the key scheme: the keys of a fixed token prefix, model and codec identity (unsalted and salted);
  a change here re-keys every stored chunk: bump ``format.keys.KEY_SCHEME_VERSION``;
- every rung's codec identity (chained into its keys): it changes only with the rung's settings or
  its version in ``format.codecs``;
- the container: magic, ``FORMAT_VERSION`` and the header of a fixed chunk (the raw rung's bytes,
  the int8 rung's quantized planes), without the fields that name the writing release or the key.
  Bytes that change under an unchanged identity would be read by an older release as if they were
  its own: bump the rung's version in ``format.codecs`` (or ``FORMAT_VERSION`` for the container),
  then update these values.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from kvcodec.encode import ChunkEncoder
from kvcodec.format.auth import ChunkAuth
from kvcodec.format.codecs import SCHEMES, get_scheme
from kvcodec.format.container import _PREFIX, FORMAT_VERSION, MAGIC
from kvcodec.format.keys import KEY_SCHEME_VERSION, chunk_keys

IDS = list(range(16))
KEYS = ["6bea03f4cd2e/0f02a54acfb8/f1bc69e6bab05587036e83d7f30dcab6b90442cc",
        "6bea03f4cd2e/0f02a54acfb8/d01d66df74398ec3a69b30790b483ebb34a2afa5"]
SALTED = ["6bea03f4cd2e/0f02a54acfb8/b58417f72499a86f863762e867b3bb341962690d",
          "6bea03f4cd2e/0f02a54acfb8/0cffdbb53cb23ae280c8a3a64f81a76a39635ffc"]
IDENTITIES = {
    "cachegen": 'cachegen/v1/cg{"bins":32}/ans{}',
    "int8-zstd": 'int8-zstd/v1/q8/zstd{"level":3}',
    "kvtc": 'kvtc/v1/kvtc{"bits":350,"recent":0,"sink":4}/zstd{"level":19}',
    "kvtc-w": 'kvtc-w/v1/kvtc{"bits":350,"recent":0,"sink":4,"weighted":1}/zstd{"level":19}',
    "lossless8": 'lossless8/v2/q8/hevc{"lossless":true,"preset":"ultrafast","qp":0}',
    "nlevel-zstd": 'nlevel-zstd/v1/qn{"levels":32}/zstd{"level":19}',
    "raw": 'raw/v2/native{"dtype":"float16"}/identity{}',
    "transform-zstd": 'transform-zstd/v1/pca{"kv_balance":2,"step":160}/zstd{"level":19}',
    "video": 'video/v4/pca10{"reorder":1,"sink":4,"step":40,"weighted":1}/hevc{"bit_depth":10,"lossless":false,'
             '"preset":"medium","qp":13,"tune":"mse"}',
    "video-fast": 'video-fast/v1/pca10{"reorder":1,"sink":4,"step":40,"weighted":1}/hevc{"bit_depth":10,'
                  '"lossless":false,"preset":"medium","qp":13,"tune":"mse","x265":"ctu=16:max-tu-size=16:sao=0:info=0"}',
    "video-q8": 'video-q8/v2/q8/hevc{"lossless":false,"preset":"ultrafast","qp":8}',
    "video-tiled": 'video-tiled/v1/pca10{"reorder":1,"sink":4,"step":40,"weighted":1}/hevc{"bit_depth":10,'
                   '"lossless":false,"preset":"medium","qp":13,"tile":4,"tune":"mse","x265":"rdoq-level=1:tskip=1"}',
}
# sha256 of the header (sorted JSON, without writer, tag, header_digest, key_id), and of the sections
RAW_HEADER = "7aa781eb66c464a7a1dc3a4266e5ff83f80de01a62c81c777b43d8a46adc5ffe"
RAW_SECTIONS = "8837e1c97cf860d49cf90a8f73f69f5f05f88c5465b1c5b9df326f272d5757fa"
# int8-zstd: the header without its section table too (zstd's bytes may differ across zstd builds;
# the quantized planes, planes_digest, may not)
INT8_HEADER = "0d4920cd32e5b7ab9887eb0b134fa32679c248edb9fba7395f894d269762164e"
RELEASE_FIELDS = ("writer", "tag", "header_digest", "key_id")


def kv() -> np.ndarray:
    return (np.arange(2 * 2 * 1 * 8 * 16).reshape(2, 2, 1, 8, 16) % 97 / 16).astype(np.float16)


def stored(rung: str):
    scheme = get_scheme(rung)
    key = chunk_keys(IDS[:8], "golden-model", scheme.identity, 8)[0]
    data = ChunkEncoder(scheme, "golden-model", auth=ChunkAuth(b"k" * 32)).encode(kv(), key, 0, 0)
    magic, version, length = _PREFIX.unpack(data[:_PREFIX.size])
    header = json.loads(data[_PREFIX.size:_PREFIX.size + length])
    return magic, version, header, data[_PREFIX.size + length:]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def header_sha(header: dict, *drop: str) -> str:
    kept = {k: v for k, v in header.items() if k not in RELEASE_FIELDS + drop}
    return sha(json.dumps(kept, sort_keys=True).encode())


def test_the_key_scheme_is_pinned():
    assert KEY_SCHEME_VERSION == "kvcodec-keys-v1"
    assert chunk_keys(IDS, "golden-model", "golden-codec", 8) == KEYS, "keys changed: bump KEY_SCHEME_VERSION"
    assert chunk_keys(IDS, "golden-model", "golden-codec", 8, salt="") == KEYS  # the empty salt: the same keys
    assert chunk_keys(IDS, "golden-model", "golden-codec", 8, salt="tenant-a") == SALTED


def test_every_rungs_identity_is_pinned():
    got = {name: get_scheme(name).identity for name in sorted(SCHEMES)}
    assert got == IDENTITIES, "a rung's identity changed: was its version bumped (format/codecs.py)?"


def test_the_container_of_a_fixed_chunk_is_pinned():
    assert (MAGIC, FORMAT_VERSION) == (b"KVCC", 2)
    magic, version, header, sections = stored("raw")
    assert (magic, version) == (MAGIC, FORMAT_VERSION)
    assert "cipher" not in header  # an unencrypted chunk is written as before encryption existed
    assert header_sha(header) == RAW_HEADER, json.dumps(header, sort_keys=True)
    assert sha(sections) == RAW_SECTIONS
    _, _, header, _ = stored("int8-zstd")
    assert header_sha(header, "sections") == INT8_HEADER, json.dumps(header, sort_keys=True)
