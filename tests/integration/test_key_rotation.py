"""Rotating the chunk key without a cold start, through real tritonservers (docs/operations.md,
"Rotating the chunk key"): chunks ingested with key A are foreign to a server with key B alone; a
server with B and previous A reuses them (the model's own tokens), counts them by key, and re-signs
them in the store; after that a server with B alone reuses them too."""
from __future__ import annotations

import time
from dataclasses import replace

from kvcodec.format import container
from kvcodec.format.auth import ChunkAuth
from kvcodec_client import KVCodecClient
from kvcodec_tools.tritonserver import Ports, TritonServer

from .conftest import REPO, chunk_path, cli, free_ports, key_file, metric_values, text_of

QUESTION = "\n\n# Question: what does this module do?\n# Answer:"
A, B = bytes(range(32)), bytes(range(100, 132))


def _ask(settings, ids):
    """A new server's reuse answer, its prefill answer, and its reuse-by-key counters."""
    with TritonServer(REPO / "model_repository", settings, Ports(*free_ports(3))) as server:
        client = KVCodecClient(server.grpc_url, "grpc")
        result, prefill = client.generate(ids, 4, reuse=True), client.generate(ids, 4, reuse=False)
        counts = metric_values(f"http://127.0.0.1:{server.ports.metrics}/metrics", "kvcodec_reused_chunks_total")
    return result, prefill, counts


def test_rotation_keeps_reuse_and_re_signs(settings, tokenizer, tmp_path):
    home = tmp_path / "rotation"
    key_file(home / "chunk.key", A)  # ingest signs with A (the home's key file)
    base = replace(settings, home=home, store=f"file://{home / 'store'}", key_file=home / "chunk.key",
                   ladder=("int8-zstd",), adaptive=False, writeback=())
    text = text_of(tokenizer, "calendar.py", 540)
    (home / "context.txt").write_text(text)
    cli(base, "ingest", "--text-file", str(home / "context.txt"), "--codec", "int8-zstd", "--json", "--quiet")
    ids = tokenizer.encode(text + QUESTION)
    chunks = [chunk_path(base, ids, i, "int8-zstd") for i in range(2)]
    b_alone = replace(base, key_file=key_file(tmp_path / "b.key", B))
    rotating = replace(b_alone, key_file_previous=key_file(tmp_path / "a.key", A))

    before, _, _ = _ask(b_alone, ids)  # B alone, before the rotation: A's chunks are foreign
    assert before.reused_tokens == 0 and "foreign" in before.stats["miss_reason"]

    during, prefill, counts = _ask(rotating, ids)  # B signs, A verifies
    assert during.reused_tokens == 512 and during.stats["signers"] == {"previous": 2}
    assert counts == {'kvcodec_reused_chunks_total{key="previous"}': 2.0}, counts
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # re-signed off the request's path
        signers = [_signer(path, ChunkAuth(B)) for path in chunks]
        if signers == ["current", "current"]:
            break
        time.sleep(0.5)
    assert signers == ["current", "current"]

    after, _, _ = _ask(b_alone, ids)  # A dropped: the re-signed chunks are still reused
    assert after.reused_tokens == 512 and after.stats["signers"] == {"current": 2}
    assert after.tokens == during.tokens == prefill.tokens


def _signer(path, auth: ChunkAuth) -> str:
    try:
        return container.parse(path.read_bytes(), auth).signer
    except Exception:
        return ""
