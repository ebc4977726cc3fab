"""Capacity and the scale-out stores below any server: gc's order and chain rule on the memory and
file stores (real chunk containers on prefix chains), the URL forms of the TLS and S3 stores, and
the size and age flags of ``kvcodec store``. The same against real servers:
tests/integration/test_store_capacity.py, test_store_s3.py, test_store_tls.py."""
from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest

from kvcodec.encode import ChunkEncoder
from kvcodec.errors import ConfigError
from kvcodec.format.auth import ChunkAuth
from kvcodec.format.codecs import get_scheme
from kvcodec.format.keys import chunk_keys
from kvcodec.store import Entry, open_store
from kvcodec.store.capacity import gc, read_header, usage
from kvcodec.store.http import HttpStore
from kvcodec.store.memory import MemoryStore
from kvcodec.store.redis_store import RedisStore
from kvcodec.store.s3 import S3Store
from kvcodec_tools.store_cli import parse_age, parse_size

C = 8
AUTH = ChunkAuth(b"u" * 32)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for name in ("KVCODEC_STORE_TOKEN", "KVCODEC_STORE_CA_FILE"):
        monkeypatch.delenv(name, raising=False)


def kv(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(-512, 512, (2, 2, 1, C, 16)) / 16).astype(np.float16)


def store_chain(store, ids, model="m", rung="raw"):
    scheme = get_scheme(rung)
    enc = ChunkEncoder(scheme, model, auth=AUTH)
    keys = chunk_keys(ids, model, scheme.identity, C)
    for i, k in enumerate(keys):
        if not store.exists(k):
            store.put(k, enc.encode(kv(i), k, i, i * C))
    return keys


def intact(present, chains) -> bool:
    for keys in chains:
        held = [k in present for k in keys]
        n = held.index(False) if False in held else len(held)
        if any(held[n:]):
            return False
    return True


def test_headers_are_read_from_the_container_prefix(tmp_path):
    store = open_store(f"file://{tmp_path}")
    keys = store_chain(store, list(range(3 * C)))
    header = read_header(store, keys[2])
    assert header["chunk_index"] == 2 and header["model_id"] == "m" and header["key"] == keys[2]
    store.put("some/other", b"not a chunk at all")
    assert read_header(store, "some/other") is None and read_header(store, "not/there") is None


def test_gc_on_a_tree_of_chains_keeps_every_remaining_chain_intact(tmp_path):
    store = open_store(f"file://{tmp_path}")
    rng = np.random.default_rng(1)
    trunk = rng.integers(0, 1000, 8 * C).tolist()
    chains = [store_chain(store, trunk)]
    for cut in (1, 3, 5):  # branches off the trunk after 1, 3 and 5 chunks
        chains.append(store_chain(store, trunk[:cut * C] + rng.integers(0, 1000, 3 * C).tolist()))
    now = time.time()
    for e in store.scan():  # random use times
        t = now - rng.uniform(0, 86400)
        os.utime(store._path(e.key), (t, t))
    total = usage(store)["bytes"]
    for limit in (total * 3 // 4, total // 2, total // 5, 1):
        report = gc(store, max_bytes=limit)
        present = {e.key for e in store.scan()}
        assert report["met"] and sum(e.size for e in store.scan()) <= limit
        assert intact(present, chains), f"a chain lost a middle chunk at limit {limit}"


def test_usage_counts_per_model_and_rung():
    store = MemoryStore(f"cap-{uuid.uuid4().hex}")
    store_chain(store, list(range(2 * C)), "a", "raw")
    store_chain(store, list(range(3 * C)), "b", "int8-zstd")
    u = usage(store)
    assert u["chunks"] == 5 and u["bytes"] == sum(e.size for e in store.scan())
    assert sorted((g["model"], g["rung"], g["chunks"]) for g in u["groups"]) == [("a", "raw", 2), ("b", "int8-zstd", 3)]
    assert isinstance(next(iter(store.scan())), Entry)


def test_gc_needs_a_sane_limit():
    store = MemoryStore(f"cap-{uuid.uuid4().hex}")
    for kwargs, match in (({}, "needs a limit"), ({"max_bytes": -1}, "max_bytes"), ({"older_than_s": -5}, "older_than")):
        with pytest.raises(ConfigError, match=match):
            gc(store, **kwargs)


def test_tls_and_s3_url_forms():
    h = open_store("https://store.example:8443/kv")
    assert isinstance(h, HttpStore) and h.url == "https://store.example:8443/kv" and h._tls is not None
    assert HttpStore("https://store.example/kv").port == 443 and HttpStore("http://store.example/kv")._tls is None
    r = open_store("rediss://:pw@cache.example:6380/2")
    assert isinstance(r, RedisStore) and r.tls and r.url == "rediss://:***@cache.example:6380/2"
    assert r._common_kwargs()["ssl"] is True and not open_store("redis://h:1").tls
    s = open_store("s3://kv-bucket/prefix/a")
    assert isinstance(s, S3Store) and (s.bucket, s.prefix) == ("kv-bucket", "prefix/a")


def test_the_ca_bundle_comes_from_the_argument_or_the_environment(tmp_path, monkeypatch):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")  # not a certificate
    with pytest.raises(ConfigError, match="CA bundle"):
        HttpStore("https://h/kv", ca_file=str(ca))  # read at once: a bad bundle is a config error
    monkeypatch.setenv("KVCODEC_STORE_CA_FILE", str(tmp_path / "missing.pem"))
    for url in ("https://h/kv", "rediss://:p@h:1/0", "s3://bucket/kv"):
        with pytest.raises(ConfigError, match="CA bundle"):
            open_store(url)
    assert open_store("http://h/kv") is not None  # plain stores do not read it


@pytest.mark.parametrize("text, value", [("123", 123), ("2K", 2048), ("1.5M", 1572864), ("20G", 20 << 30),
                                         ("1TiB", 1 << 40), ("500mb", 500 << 20)])
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text, value", [("90", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800), ("2w", 1209600)])
def test_ages(text, value):
    assert parse_age(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1", "5x"])
def test_bad_sizes_and_ages(text):
    with pytest.raises(ValueError):
        parse_size(text)
    with pytest.raises(ValueError):
        parse_age(text)


def test_boto3_and_redis_load_only_when_their_store_is_used():
    import subprocess
    import sys

    code = ("import sys; from kvcodec.store import open_store; s = open_store('s3://bucket/kv'); "
            "r = open_store('rediss://:p@h:1/0'); print('boto3' in sys.modules, 'redis' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
