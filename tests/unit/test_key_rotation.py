"""Key rotation (``format.auth`` previous keys, ``serving.resign``): a previous key verifies but
never signs; a chunk it verified is reported and re-signed with the current key; without it the
same chunk is foreign. The end-to-end rotation through a real server:
tests/integration/test_key_rotation.py."""
from __future__ import annotations

import os

import pytest

from kvcodec.encode import ChunkEncoder
from kvcodec.errors import ConfigError, ForeignChunk
from kvcodec.format import container
from kvcodec.format.auth import ChunkAuth, load_auth
from kvcodec.format.codecs import get_scheme
from kvcodec.serving.chunkinfo import ChunkInfo
from kvcodec.serving.decode import DecodeStep
from kvcodec.serving.resign import ReSigner
from kvcodec.serving.stats import RequestStats
from kvcodec.store.memory import MemoryStore

MODEL, KEY = "org/tiny@abc123", "aaaa/bbbb/0123"
A, B = bytes(range(32)), bytes(range(100, 132))


@pytest.fixture(scope="module")
def signed_with_a(make_kv):
    return ChunkEncoder(get_scheme("int8-zstd"), MODEL, auth=ChunkAuth(A)).encode(make_kv(1), KEY, 0, 0)


def test_a_previous_key_verifies_but_never_signs(signed_with_a):
    rotated = ChunkAuth(B, previous=[A])
    assert container.parse(signed_with_a, rotated).signer == "previous"
    with pytest.raises(ForeignChunk):
        container.parse(signed_with_a, ChunkAuth(B))  # B alone: foreign, as before rotation
    resigned = container.resign(signed_with_a, rotated)
    again = container.parse(resigned, ChunkAuth(B))  # now B alone reads it
    assert again.signer == "current" and again.header == container.parse(signed_with_a, ChunkAuth(A)).header
    assert bytes(again.sections["payload"]) == bytes(container.parse(signed_with_a, ChunkAuth(A)).sections["payload"])
    with pytest.raises(ForeignChunk):
        container.parse(resigned, ChunkAuth(A))  # signed with B only
    assert rotated.key_id == ChunkAuth(B).key_id and rotated.previous_ids == [ChunkAuth(A).key_id]


def test_decode_reports_the_signer_and_hands_previous_chunks_to_the_resigner(signed_with_a):
    store = MemoryStore("rotation")
    store.put(KEY, signed_with_a)
    rotated = ChunkAuth(B, previous=[A])
    resigner = ReSigner(store, rotated)
    step = DecodeStep(MODEL, auth=rotated, resign=resigner.offer)
    info = ChunkInfo("s", 0, 1, key=KEY, tokens=256)
    out = step.run(info, store.get(KEY))
    assert info.ok and info.signer == out.signer == "previous"
    assert resigner.flush(10) and resigner.stats()["stored"] == 1
    assert container.parse(store.get(KEY), ChunkAuth(B)).signer == "current"  # re-signed in the store
    assert not resigner.offer(KEY, signed_with_a)  # once per key per process
    current = ChunkInfo("s", 0, 1, key=KEY, tokens=256)
    step.run(current, store.get(KEY))
    assert current.signer == "current"
    assert RequestStats.from_chunks([info], 256, "").signers == {"previous": 1}
    resigner.close()


def test_previous_keys_come_from_the_variable_or_a_private_file(tmp_path):
    key_file = tmp_path / "chunk.key"
    env = {"KVCODEC_CHUNK_KEY": B.hex(), "KVCODEC_CHUNK_KEY_PREVIOUS": f"{A.hex()}, {bytes(range(50, 82)).hex()}"}
    auth = load_auth(key_file, env)
    assert auth.key_id == ChunkAuth(B).key_id and len(auth.previous_ids) == 2
    previous = tmp_path / "previous.keys"
    previous.write_text(A.hex() + "\n")
    os.chmod(previous, 0o600)
    assert load_auth(key_file, {"KVCODEC_CHUNK_KEY": B.hex()}, previous).previous_ids == [ChunkAuth(A).key_id]
    os.chmod(previous, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_auth(key_file, {"KVCODEC_CHUNK_KEY": B.hex()}, previous)
    with pytest.raises(ConfigError, match="hex"):
        load_auth(key_file, {"KVCODEC_CHUNK_KEY": B.hex(), "KVCODEC_CHUNK_KEY_PREVIOUS": "zz"})
    assert load_auth(key_file, {"KVCODEC_CHUNK_KEY": B.hex()}).previous_ids == []
