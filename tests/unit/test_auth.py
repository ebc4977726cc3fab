"""Chunk authentication (``format.auth``): chunks not signed with the deployment's key are foreign;
the key is made on first use, kept private, and can be shared through a variable."""
from __future__ import annotations

import os
import stat

import pytest

from kvcodec.encode import ChunkEncoder
from kvcodec.errors import ConfigError, CorruptChunk, ForeignChunk
from kvcodec.format import container
from kvcodec.format.auth import ChunkAuth, load_auth
from kvcodec.format.codecs import get_scheme
from kvcodec.serving.chunkinfo import ChunkInfo
from kvcodec.serving.decode import ChunkDecoder, DecodeStep

from .conftest import AUTH

MODEL, KEY = "org/tiny@abc123", "aaaa/bbbb/0123"


@pytest.fixture(scope="module")
def chunks(make_kv):
    """Two chunks of different KV, signed with the tests' key."""
    enc = ChunkEncoder(get_scheme("int8-zstd"), MODEL, auth=AUTH)
    return enc.encode(make_kv(1), KEY, 0, 0), enc.encode(make_kv(2), KEY, 0, 0)


def test_a_chunk_signed_with_another_key_is_foreign(chunks):
    other = ChunkAuth.random()
    with pytest.raises(ForeignChunk, match=f"written with key '{AUTH.key_id}', this key is '{other.key_id}'"):
        ChunkDecoder(MODEL, auth=other).decode(chunks[0], key=KEY)
    ChunkDecoder(MODEL, auth=AUTH).decode(chunks[0], key=KEY)


def test_kv_poisoning_with_valid_checksums_is_foreign(chunks):
    """The header of one chunk (model, key, codec) around the KV of another, every digest valid:
    without the key the writer cannot sign it, and the reader refuses it."""
    mine, theirs = (container.parse(c, AUTH) for c in chunks)
    forged = container.Container(dict(mine.header), dict(theirs.sections)).to_bytes(ChunkAuth.random())
    info = ChunkInfo("s", 0, 1, key=KEY, tokens=256)
    decoded = DecodeStep(MODEL, auth=AUTH).run(info, forged)
    assert info.status == "foreign" and "not signed" in info.reason and decoded.header is None


def test_a_damaged_tag_is_corrupt_and_an_unsigned_old_format_chunk_is_foreign(chunks):
    data = bytearray(chunks[0])
    at = bytes(data).index(b'"tag": "') + len(b'"tag": "')
    data[at] ^= 0x01
    with pytest.raises(CorruptChunk, match="header checksum"):
        container.parse(bytes(data), AUTH)
    v1 = bytearray(chunks[0])
    v1[4:6] = (1).to_bytes(2, "little")
    with pytest.raises(ForeignChunk, match="format version 1"):
        container.parse(bytes(v1), AUTH)


def test_the_key_is_made_on_first_use_private_and_then_reused(tmp_path):
    path = tmp_path / "home" / "chunk.key"
    first = load_auth(path, env={})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(bytes.fromhex(path.read_text())) == 32
    again = load_auth(path, env={})
    assert again.key_id == first.key_id and again.tag(b"x") == first.tag(b"x")
    assert first.tag(b"x") != ChunkAuth.random().tag(b"x")


def test_the_variable_takes_the_files_place(tmp_path):
    shared = "ab" * 32
    a = load_auth(tmp_path / "a.key", env={"KVCODEC_CHUNK_KEY": shared})
    b = load_auth(tmp_path / "b.key", env={"KVCODEC_CHUNK_KEY": shared})
    assert a.key_id == b.key_id == ChunkAuth(bytes.fromhex(shared)).key_id
    assert not (tmp_path / "a.key").exists()  # no file is made when the variable gives the key


@pytest.mark.parametrize("env, message", [
    ({"KVCODEC_CHUNK_KEY": "not-hex"}, "hex digits"),
    ({"KVCODEC_CHUNK_KEY": "abcd"}, "at least 16 bytes"),
])
def test_a_bad_key_variable_is_a_config_error(tmp_path, env, message):
    with pytest.raises(ConfigError, match=message):
        load_auth(tmp_path / "k", env=env)


def test_a_key_file_others_may_read_is_refused(tmp_path):
    path = tmp_path / "chunk.key"
    load_auth(path, env={})
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="may be read by others.*chmod 600"):
        load_auth(path, env={})


def test_the_secret_never_shows():
    auth = ChunkAuth(bytes(range(32)))
    assert bytes(range(32)).hex() not in repr(auth) and auth.key_id in repr(auth)


def test_a_chunk_of_another_geometry_is_foreign_before_it_is_decoded(chunks, make_kv):
    from kvcodec.format.geometry import Geometry

    model = Geometry.of(make_kv(1))
    ChunkDecoder(MODEL, auth=AUTH, geometry=model).decode(chunks[0], key=KEY)
    other = Geometry(layers=model.layers + 1, kv_heads=model.kv_heads, head_dim=model.head_dim, tokens=model.tokens)
    with pytest.raises(ForeignChunk, match="geometry"):
        ChunkDecoder(MODEL, auth=AUTH, geometry=other).decode(chunks[0], key=KEY)
