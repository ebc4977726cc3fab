"""Tenants through real tritonservers (docs/operations.md, "Tenants"): a prefix ingested encrypted
under cache salt "tenant-a" (``kvcodec ingest --cache-salt``) is reused by tenant a's requests over
gRPC and HTTP (the ``cache_salt`` input, and Triton's request parameter of that name), and by no one
else: tenant b, and an unsalted request, compute it (0 reused tokens, prefill's answer). The stored
objects hold neither the prompt's token ids nor the KV's bytes in the clear. The chunk key then
rotates: a server with a new key and the old one as previous reuses the encrypted chunks at once (no
cold start), re-encrypting them under the new key."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import pytest

from kvcodec.format import container
from kvcodec.format.auth import ChunkAuth
from kvcodec.format.keys import tenant_id
from kvcodec_client import KVCodecClient
from kvcodec_tools.tritonserver import Ports, TritonServer

from .conftest import REPO, chunk_path, cli, free_ports, key_file, post, text_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

QUESTION = "\n\n# Question: what does this module do?\n# Answer:"
A, B = bytes(range(32)), bytes(range(100, 132))


def _salted_paths(settings, ids, salt: str, rung: str, n: int):
    from kvcodec.engines import model_card
    from kvcodec.format.codecs import get_scheme
    from kvcodec.format.keys import chunk_keys

    card = model_card(settings)
    keys = chunk_keys(ids, card.model_id, get_scheme(rung).for_card(card).identity, settings.chunk_tokens, salt=salt)
    return [settings.store.removeprefix("file://") + f"/{k}.kvc" for k in keys[:n]]


def test_tenants_reuse_only_their_own_encrypted_chunks_over_grpc_and_http(settings, tokenizer, tmp_path, monkeypatch):
    home = tmp_path / "tenants"
    key_file(home / "chunk.key", A)
    base = replace(settings, home=home, store=f"file://{home / 'store'}", key_file=home / "chunk.key",
                   ladder=("int8-zstd", "raw"), adaptive=False, writeback=(), encrypt_chunks=True)
    text = text_of(tokenizer, "calendar.py", 540)
    (home / "context.txt").write_text(text)
    monkeypatch.setenv("KVCODEC_ENCRYPT_CHUNKS", "1")  # the CLI's settings come from the environment too
    cli(base, "ingest", "--text-file", str(home / "context.txt"), "--codec", "int8-zstd,raw", "--cache-salt",
        "tenant-a", "--json", "--quiet")
    ids = tokenizer.encode(text + QUESTION)
    assert not chunk_path(base, ids, 0, "int8-zstd").exists()  # nothing under the unsalted keys

    # (c) the objects in the store: encrypted, no token ids, no KV bytes in the clear
    raw_paths = _salted_paths(base, ids, "tenant-a", "raw", 2)
    stored = sorted((home / "store").glob("**/*.kvc"))
    assert len(stored) == 4 and all(str(p) in map(str, stored) for p in raw_paths)
    ids_bytes = np.asarray(ids[:64], "<i4").tobytes()
    auth = ChunkAuth(A)
    layer = bytes(container.parse(open(raw_paths[0], "rb").read(), auth).sections["payload"])[:4096]
    for path in stored:
        blob = path.read_bytes()
        assert ids_bytes not in blob and layer not in blob, path
        chunk = container.parse(blob, auth)
        assert chunk.encrypted and chunk.header["tenant"] == tenant_id("tenant-a")

    with TritonServer(REPO / "model_repository", base, Ports(*free_ports(3))) as server:
        for protocol, url in (("grpc", server.grpc_url), ("http", server.http_url)):
            client = KVCodecClient(url, protocol)
            prefill = client.generate(ids, 4, reuse=False)
            stranger = client.generate(ids, 4, cache_salt="tenant-b")
            unsalted = client.generate(ids, 4)
            own = client.generate(ids, 4, cache_salt="tenant-a")
            assert stranger.reused_tokens == 0 and unsalted.reused_tokens == 0, (protocol, stranger.stats)
            assert own.reused_tokens == 512, (protocol, own.stats)
            assert stranger.tokens == unsalted.tokens == own.tokens == prefill.tokens, protocol
            assert stranger.ttft_s > own.ttft_s, (protocol, stranger.ttft_s, own.ttft_s)  # b's TTFT is not a hit's
        # Triton's generate endpoint: the salt as a request parameter (a JSON field it does not declare)
        status, answer = post(server, "generate", {"input_ids": ids, "max_tokens": 4, "stream": False, "cache_salt": "tenant-a"})
        assert status == 200 and answer.get("reused_tokens") == 512, answer
        status, answer = post(server, "generate", {"input_ids": ids, "max_tokens": 4, "stream": False, "cache_salt": "tenant-b"})
        assert status == 200 and answer.get("reused_tokens") == 0, answer
        status, answer = post(server, "generate", {"input_ids": ids, "max_tokens": 4, "stream": False, "cache_salt": "x" * 1000})
        assert status == 400 and "cache_salt" in json.dumps(answer), answer

    # (d) the key rotates: B signs and encrypts, A (previous) decrypts and verifies; no cold start
    rotating = replace(base, key_file=key_file(tmp_path / "b.key", B),
                       key_file_previous=key_file(tmp_path / "a.key", A))
    with TritonServer(REPO / "model_repository", rotating, Ports(*free_ports(3))) as server:
        during = KVCodecClient(server.grpc_url, "grpc").generate(ids, 4, cache_salt="tenant-a", codecs="int8-zstd")
        assert during.reused_tokens == 512 and during.stats["signers"] == {"previous": 2}, during.stats
        assert during.tokens == prefill.tokens
        paths = _salted_paths(base, ids, "tenant-a", "int8-zstd", 2)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # re-signed and re-encrypted off the request's path
            try:
                chunks = [container.parse(open(p, "rb").read(), ChunkAuth(B)) for p in paths]
            except Exception:  # noqa: BLE001 - not yet re-signed: A's tag is foreign to B alone
                chunks = []
            if chunks and all(c.signer == "current" and c.encrypted for c in chunks):
                break
            time.sleep(0.5)
        assert chunks and all(c.signer == "current" and c.encrypted for c in chunks)
