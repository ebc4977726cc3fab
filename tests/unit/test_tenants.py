"""Tenants below Triton: cache salts key chunks apart, chunks are encrypted per tenant, and what a
stranger gets is a miss (kvcodec.format.keys, format.auth, format.container, connector.save, serving.fetch)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvcodec.connector.save import ChunkSaver
from kvcodec.connector.sink import WriteBackSink
from kvcodec.errors import BadRequest, CorruptChunk, ForeignChunk
from kvcodec.format import container
from kvcodec.format.auth import ChunkAuth, tenant_key
from kvcodec.format.container import Container, parse, resign
from kvcodec.format.keys import MAX_SALT_CHARS, chunk_keys, tenant_id
from kvcodec.format.ladder import parse_ladder
from kvcodec.serving.decode import DecodeStep
from kvcodec.serving.request import Reply, Request
from kvcodec.store.memory import MemoryStore

from .test_pipeline import CHUNK, MODEL, context, through_steps  # noqa: F401  (fixtures)

MASTER = bytes(range(32))
OTHER = bytes(range(100, 132))


def _ids(n: int, seed: int = 0) -> list:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


# -- keys ----------------------------------------------------------------------------------------
def test_a_salt_keys_every_chunk_apart_and_the_empty_salt_keeps_todays_keys():
    ids = _ids(3 * CHUNK)
    plain = chunk_keys(ids, MODEL, "raw/v1", CHUNK)
    assert chunk_keys(ids, MODEL, "raw/v1", CHUNK, salt="") == plain  # stored chunks are still found
    a = chunk_keys(ids, MODEL, "raw/v1", CHUNK, salt="tenant-a")
    b = chunk_keys(ids, MODEL, "raw/v1", CHUNK, salt="tenant-b")
    assert not set(a) & set(plain) and not set(a) & set(b) and not set(b) & set(plain)
    assert chunk_keys(ids[:2 * CHUNK], MODEL, "raw/v1", CHUNK, salt="tenant-a") == a[:2]  # still a prefix chain
    assert [k.rsplit("/", 1)[0] for k in a] == [k.rsplit("/", 1)[0] for k in plain]  # same shape: gc groups them
    with pytest.raises(ValueError, match="at most"):
        chunk_keys(ids, MODEL, "raw/v1", CHUNK, salt="x" * (MAX_SALT_CHARS + 1))
    assert tenant_id("") == "" and tenant_id("a") != tenant_id("b") and len(tenant_id("a")) == 16


def test_a_request_checks_its_salt_and_carries_it_to_the_llm_step(tmp_path):
    from kvcodec.engines import ModelCard

    card = ModelCard(name="tiny", model_id=MODEL, vocab_size=50_000, max_context=4096, layers=2, kv_heads=3, head_dim=64)
    reply = Reply(cache_salt="tenant-a")
    assert Reply.from_json(reply.to_json()).cache_salt == "tenant-a"  # travels in params
    req = Request(np.arange(10, dtype=np.int32), 4, reply=reply).validate(card)
    assert req.salt == "tenant-a"
    with pytest.raises(BadRequest, match="cache_salt"):
        Request(np.arange(10, dtype=np.int32), 4, reply=Reply(cache_salt="x" * 1000)).validate(card)


# -- encryption ----------------------------------------------------------------------------------
def _chunk(tenant: str = "") -> Container:
    header = {"model_id": MODEL, "key": "ab/cd/ef", "planes_shape": [2, 16, 16], "planes_digest": "d" * 32}
    if tenant:
        header["tenant"] = tenant
    return Container(header, {"q8_min": bytes(range(16)), "payload": bytes(range(256)) * 4})


def test_an_encrypted_chunk_holds_nothing_of_its_planes_in_the_clear_and_reads_back_whole():
    auth = ChunkAuth(MASTER, encrypt=True)
    c = _chunk(tenant_id("tenant-a"))
    data = c.to_bytes(auth)
    assert bytes(range(256)) not in data and bytes(range(16)) not in data  # neither section
    assert b"d" * 32 not in data  # nor the digest of the planes (it would confirm a guessed prompt)
    back = parse(data, auth)
    assert back.encrypted and back.header["planes_digest"] == "d" * 32
    assert {k: bytes(v) for k, v in back.sections.items()} == c.sections
    assert back.digests["payload"] == container._digest(c.sections["payload"])  # the plaintext's digest
    assert parse(data, ChunkAuth(MASTER)).encrypted  # a reader decrypts whatever its own setting says
    plain = c.to_bytes(ChunkAuth(MASTER))
    assert bytes(range(256)) in plain and not parse(plain, auth).encrypted  # the setting is the writer's


def test_a_flipped_byte_anywhere_in_an_encrypted_section_is_corrupt_not_kv():
    """The ciphertext's digest is not recomputed on read (AES-GCM authenticates it): every altered
    byte of every section must still be caught, as corruption (its copy is replaced on write-back)."""
    auth = ChunkAuth(MASTER, encrypt=True)
    data = _chunk(tenant_id("tenant-a")).to_bytes(auth)
    body = len(data) - sum(len(s) for s in _chunk().sections.values()) - 3 * 28 - 64  # the sections' start, about
    for at in range(body, len(data), 97):
        altered = bytearray(data)
        altered[at] ^= 0x01
        with pytest.raises((CorruptChunk, ForeignChunk)) as caught:
            parse(bytes(altered), auth)
        if at >= len(data) - 1024:  # inside the payload's ciphertext
            assert caught.type is CorruptChunk, at


def test_a_tenants_key_opens_its_own_chunks_only():
    auth = ChunkAuth(MASTER, encrypt=True)
    a, b = tenant_id("tenant-a"), tenant_id("tenant-b")
    blob = auth.seal(a, b"aad", b"secret kv")
    assert auth.unseal(a, b"aad", blob) == b"secret kv"
    with pytest.raises(ForeignChunk):
        auth.unseal(b, b"aad", blob)  # another tenant's key
    with pytest.raises(ForeignChunk):
        auth.unseal(a, b"other aad", blob)  # moved to another header
    with pytest.raises(ForeignChunk):
        ChunkAuth(OTHER).unseal(a, b"aad", blob)  # another master
    assert tenant_key(MASTER, a) != tenant_key(MASTER, b) != tenant_key(OTHER, b)
    # the tenant keys are the AES keys themselves: a leaked one decrypts that tenant and nothing else
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    leaked = AESGCM(tenant_key(MASTER, a))
    assert leaked.decrypt(blob[:12], blob[12:], b"aad") == b"secret kv"
    other = auth.seal(b, b"aad", b"b's kv")
    with pytest.raises(Exception):  # noqa: B017 - cryptography's InvalidTag
        leaked.decrypt(other[:12], other[12:], b"aad")


def test_a_chunk_relabelled_to_another_tenant_or_altered_is_never_kv():
    auth = ChunkAuth(MASTER, encrypt=True)
    data = _chunk(tenant_id("tenant-a")).to_bytes(auth)
    relabelled = data.replace(tenant_id("tenant-a").encode(), tenant_id("tenant-b").encode())
    with pytest.raises((ForeignChunk, CorruptChunk)):
        parse(relabelled, auth)
    with pytest.raises(ForeignChunk):
        parse(data, ChunkAuth(OTHER))  # encrypted (and signed) under another master key


def test_rotation_a_previous_master_decrypts_and_never_encrypts():
    old = ChunkAuth(OTHER, encrypt=True)
    data = _chunk(tenant_id("tenant-a")).to_bytes(old)
    rotating = ChunkAuth(MASTER, previous=[OTHER], encrypt=True)
    back = parse(data, rotating)
    assert back.signer == "previous" and back.encrypted and bytes(back.sections["payload"]) == bytes(range(256)) * 4
    again = resign(data, rotating)  # re-signed and re-encrypted with the current key
    assert bytes(range(256)) not in again
    after = parse(again, ChunkAuth(MASTER))  # the previous key dropped: still read
    assert after.signer == "current" and after.encrypted
    # a chunk that was encrypted stays encrypted when re-signed by a process that does not encrypt
    assert parse(resign(data, ChunkAuth(MASTER, previous=[OTHER])), ChunkAuth(MASTER)).encrypted
    with pytest.raises(ForeignChunk):
        parse(data, ChunkAuth(MASTER))  # without the previous key: a miss


# -- through the read and write paths ------------------------------------------------------------
@pytest.fixture
def saved(context):  # noqa: F811
    """int8-zstd chunks of the context written back by tenant a, encrypted."""
    ids, kv = context
    store = MemoryStore("tenants")
    auth = ChunkAuth(MASTER, encrypt=True)
    saver = ChunkSaver(store, MODEL, parse_ladder(["int8-zstd"]), CHUNK, auth=auth)
    sink = WriteBackSink(saver)
    n = kv.shape[3] // CHUNK
    assert sink.for_prompt(ids, "tenant-a")([(i, i * CHUNK, kv[:, :, :, i * CHUNK:(i + 1) * CHUNK]) for i in range(n)]) == n
    assert sink.flush(60)
    yield store, auth, ids, kv
    sink.close()


def test_a_salted_write_back_is_found_by_its_tenant_only(saved):
    from kvcodec.serving.fetch import Fetcher

    store, auth, ids, kv = saved
    f = Fetcher(store, MODEL, ["int8-zstd"], CHUNK)
    assert f.plan(ids) is None  # unsalted
    assert f.plan(ids, salt="tenant-b") is None  # a stranger: a miss, the prompt is computed
    plan = f.plan(ids, salt="tenant-a")
    assert plan is not None and plan.n_chunks == 3
    infos = list(f.fetch(ids, "s", salt="tenant-b"))
    assert [i.status for i, _ in infos] == ["none"]
    fetched = list(f.fetch(ids, "s", salt="tenant-a"))
    restored = through_steps(fetched, DecodeStep(MODEL, auth=auth))
    assert all(info.ok for info, _ in restored)
    got = np.concatenate([r for _, r in restored], axis=3)
    assert np.allclose(got, kv[:, :, :, :got.shape[3]], atol=0.05 * float(np.abs(kv).max()))


def test_the_store_holds_no_token_ids_nor_kv_bytes_in_the_clear(saved, context):  # noqa: F811
    store, auth, ids, kv = saved
    # what the raw rung stores of the first chunk, in the clear: the pattern to search for
    clear = MemoryStore("tenants-clear")
    raw = ChunkSaver(clear, MODEL, parse_ladder(["raw"]), CHUNK, auth=ChunkAuth(MASTER))
    raw.save(raw.keys(ids, 0), 0, 0, kv[:, :, :, :CHUNK])
    (clear_blob,) = [clear.get(e.key) for e in clear.scan()]
    layer = bytes(parse(clear_blob, auth).sections["payload"])[:4096]  # the raw rung's bytes (of layer 0)
    assert layer in clear_blob  # the search finds them where they are in the clear
    encrypted = MemoryStore("tenants-raw")
    saver = ChunkSaver(encrypted, MODEL, parse_ladder(["raw"]), CHUNK, auth=auth)
    saver.save(saver.keys(ids, 0, "tenant-a"), 0, 0, kv[:, :, :, :CHUNK], tenant=tenant_id("tenant-a"))
    ids_bytes = np.asarray(ids[:64], "<i4").tobytes()
    blobs = [store.get(e.key) for e in store.scan()] + [encrypted.get(e.key) for e in encrypted.scan()]
    assert len(blobs) == 4
    for blob in blobs:
        assert ids_bytes not in blob and layer not in blob
        _, _, n = container._PREFIX.unpack_from(blob)
        header = json.loads(blob[container._PREFIX.size:container._PREFIX.size + n])
        assert header["cipher"] == "aes-256-gcm" and "planes_digest" not in header
        assert header["tenant"] == tenant_id("tenant-a")


def test_the_tenants_bench_times_decryption_on_real_chunks(context):  # noqa: F811
    """``kvcodec bench tenants``' in-process part: the decrypt rate on encrypted chunks, and the
    parse of a chunk encrypted and of the same chunk in the clear (timed: reported, not compared)."""
    from kvcodec_tools.tenants_bench import decrypt_speed

    ids, kv = context
    auth = ChunkAuth(MASTER, encrypt=True)
    store = MemoryStore("tenants-bench")
    saver = ChunkSaver(store, MODEL, parse_ladder(["raw"]), CHUNK, auth=auth)
    for i in range(2):
        saver.save(saver.keys(ids, i, "t"), i, i * CHUNK, kv[:, :, :, i * CHUNK:(i + 1) * CHUNK], tenant=tenant_id("t"))
    chunks = [store.get(e.key) for e in store.scan()]
    speed = decrypt_speed(chunks, auth, reps=3)
    assert speed["chunks"] == 2 and speed["decrypt_mb_s"] > 10
    assert speed["parse_ms_encrypted"] > 0 and speed["parse_ms_clear"] > 0  # timings: reported, not compared
    with pytest.raises(ForeignChunk):
        decrypt_speed(chunks, ChunkAuth(OTHER), reps=1)  # only a holder of the key can time it
