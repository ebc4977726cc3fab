"""One composition of reads and writes (kvcodec.compose): every home of the connector builds them
there, and what is built has the local tier, re-signing through it and write-back pricing."""
from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import numpy as np
import pytest

from kvcodec.compose import open_reads, open_writes
from kvcodec.engines import ModelCard
from kvcodec.format import container
from kvcodec.format.auth import ChunkAuth
from kvcodec.format.keys import chunk_keys
from kvcodec.format.ladder import parse_ladder
from kvcodec.settings import Settings
from kvcodec.store.tiered import TieredStore

from .test_pipeline import CHUNK, MODEL, context  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]
CARD = ModelCard(name="tiny", model_id=MODEL, layers=2, kv_heads=3, head_dim=64, vocab_size=32_000,
                 max_context=4096, kv_dtype="float32")
# What builds a read or write path; only kvcodec.compose may call these in a home of the connector.
BUILDERS = {"Fetcher", "ReSigner", "open_for_settings", "open_sink", "open_store", "DecodeStep", "ChunkReader",
            "ReadPath", "sink_for_settings"}
HOMES = sorted((REPO / "model_repository").glob("*/1/model.py")) + sorted(
    (REPO / "backends" / "kvcodec" / "engines").glob("*.py")) + [REPO / "backends/kvcodec/serving/readpath.py"]


def _calls(path: Path) -> set:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return out


@pytest.mark.parametrize("path", HOMES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_home_builds_its_reads_and_writes_through_compose(path):
    """kv_fetch, kv_decode, llm, vLLM's standalone connector, TensorRT-LLM's scheduler, prefetcher and
    worker: none assembles a fetcher, a decoder, a re-signer, a store or a sink of its own (ReadPath is
    built from compose's reads by the vLLM connector only)."""
    allowed = {"ReadPath"} if path.name == "vllm_connector.py" else set()
    assert not (_calls(path) & BUILDERS) - allowed, sorted((_calls(path) & BUILDERS) - allowed)


@pytest.fixture
def home(tmp_path):
    key = tmp_path / "chunk.key"
    key.write_text(bytes(range(32)).hex() + "\n")
    os.chmod(key, 0o600)
    previous = tmp_path / "previous.key"
    previous.write_text(bytes(range(100, 132)).hex() + "\n")
    os.chmod(previous, 0o600)
    return tmp_path


def _settings(home: Path, **extra) -> Settings:
    return Settings.load({"home": str(home), "store": f"file://{home / 'remote'}",
                          "local_store": f"file://{home / 'local'}", "ladder": "int8-zstd",
                          "writeback": "int8-zstd", "chunk_tokens": str(CHUNK), "key_file": str(home / "chunk.key"),
                          **extra}, env={})


def test_write_back_from_settings_fills_the_local_tier_and_prices_each_rung(home, context):  # noqa: F811
    ids, kv = context
    sink = open_writes(_settings(home), CARD)
    try:
        assert sink.for_prompt(ids)([(0, 0, kv[:, :, :, :CHUNK])]) == 1 and sink.flush(60)
    finally:
        sink.close()
    rung = parse_ladder(["int8-zstd"], CARD)[0].identity
    key = chunk_keys(ids, MODEL, rung, CHUNK)[0]
    assert (home / "remote" / f"{key}.kvc").is_file() and (home / "local" / f"{key}.kvc").is_file()
    costs = json.loads((home / "costs.json").read_text())  # the deployment's cost model learned the rung
    assert costs["rungs"][rung]["bytes_per_token"] > 0, costs


def test_reads_from_settings_share_one_store_behind_the_local_tier_and_re_sign_through_it(home, context):  # noqa: F811
    ids, kv = context
    settings = _settings(home, key_file_previous=str(home / "previous.key"))
    old = ChunkAuth(bytes(range(100, 132)))  # a chunk signed with the previous key, stored remotely
    plain = Settings.load({"home": str(home), "store": f"file://{home / 'remote'}", "ladder": "int8-zstd",
                           "writeback": "int8-zstd", "chunk_tokens": str(CHUNK), "key_file": str(home / "chunk.key")},
                          env={})
    sink = open_writes(plain, CARD, auth=old)
    sink.for_prompt(ids)([(0, 0, kv[:, :, :, :CHUNK])])
    assert sink.flush(60)
    sink.close()
    reads = open_reads(settings, CARD)
    try:
        assert isinstance(reads.store, TieredStore)
        assert reads.fetcher.store is reads.store and reads.fetcher.costs is reads.costs
        assert reads.resigner is not None and reads.resigner.store is reads.store
        fetched = list(reads.fetcher.fetch(ids, "s"))
        step = reads.decode_step()
        try:
            info, data = fetched[0]
            decoded = step.run(info, data)
            assert decoded.signer == "previous"
        finally:
            step.close()
        assert reads.resigner.flush(30)
        key = info.key
        local = (home / "local" / f"{key}.kvc").read_bytes()
        assert container.parse(local, ChunkAuth(bytes(range(32)))).signer == "current"  # the local copy too
    finally:
        reads.close()
    assert np.isfinite(kv).all()
