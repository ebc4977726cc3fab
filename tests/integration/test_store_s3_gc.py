"""gc's ``older_than_s`` on a real S3 server (SeaweedFS, ``weed mini``): "unused for", not "written
before". S3 lists only write times, so the S3 store marks reads (``kvcodec-used``, a server-side
copy onto itself) and gc ages S3 chunks by the marks. Time is the store's injected clock (the marks
it writes) and gc's ``now``: no sleeping.

A missing ``weed`` fails these tests (``pip install -r requirements.txt`` installs it).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvcodec.encode import ChunkEncoder
from kvcodec.format.auth import ChunkAuth
from kvcodec.format.codecs import get_scheme
from kvcodec.format.keys import chunk_keys
from kvcodec.store import open_store
from kvcodec.store.capacity import gc, read_header
from kvcodec.store.s3 import S3Store
from kvcodec.store.tiered import TieredStore
from kvcodec_tools.services.seaweedfs import SeaweedS3

pytestmark = pytest.mark.integration

DAY = 86400.0
C = 8  # tokens per chunk
AUTH = ChunkAuth(b"g" * 32)


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def kv(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(-512, 512, (2, 2, 1, C, 16)) / 16).astype(np.float16)


def ingest(store, model: str, seed: int, n: int = 3) -> list:
    scheme = get_scheme("raw")
    ids = np.random.default_rng(seed).integers(0, 30000, n * C).tolist()
    keys = chunk_keys(ids, model, scheme.identity, C)
    enc = ChunkEncoder(scheme, model, auth=AUTH)
    for i, key in enumerate(keys):
        assert store.put(key, enc.encode(kv(i), key, i, i * C))
    return keys


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    srv = SeaweedS3(tmp_path_factory.mktemp("s3gc"), "127.0.0.1", "gc-test-key", "gc-test-secret-0123456789",
                    bucket="kvgc")
    srv.start(timeout_s=60)
    pid = srv.pid
    yield srv
    srv.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


@pytest.fixture
def s3(weed, monkeypatch):
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in weed.environ().items():
        monkeypatch.setenv(name, value)
    with open_store(weed.url) as store:
        for e in list(store.scan()):
            store.delete(e.key)
    return weed.url


def at(url: str, clock: Clock, **options) -> S3Store:
    store = S3Store.from_url(url)
    store.clock = clock
    for name, value in options.items():
        setattr(store, name, value)
    return store


@pytest.mark.timeout(90)
def test_gc_keeps_a_chunk_read_yesterday_and_ingested_last_month(s3):
    now = 1_900_000_000.0  # gc runs "now"; everything below is stamped by the store's clock
    clock = Clock(now - 30 * DAY)
    with at(s3, clock, touch_s=3600.0) as store:  # ingested a month ago: a hot prefix and a cold one
        hot = ingest(store, "m-hot", 1)
        cold = ingest(store, "m-cold", 2)
    clock.t = now - DAY  # yesterday a replica read the hot prefix
    with at(s3, clock, touch_s=3600.0) as replica:  # marking on (off by default: docs/operations.md)
        for key in hot:
            assert replica.get(key) is not None
        assert replica.get(hot[0]) is not None  # again at once: within touch_s, no second mark
    # close() waited for the marks: they are on the server now
    with at(s3, Clock(now), touch_s=3600.0) as store:
        report = gc(store, older_than_s=7 * DAY, now=now)
        assert all(store.exists(k) for k in hot), "a chunk read yesterday was deleted as unused"
        assert not any(store.exists(k) for k in cold)
        assert report["deleted"]["chunks"] == 3
        assert [store.used(k) for k in hot] == [pytest.approx(now - DAY)] * 3
        # the copy that marked use left the chunk's bytes as they were
        assert read_header(store, hot[2])["chunk_index"] == 2
        assert store.get(hot[2]) == ChunkEncoder(get_scheme("raw"), "m-hot", auth=AUTH).encode(
            kv(2), hot[2], 2, 2 * C)


@pytest.mark.timeout(90)
def test_a_local_tier_hit_marks_the_s3_chunk_used(s3, tmp_path):
    now = 1_900_000_000.0
    clock = Clock(now - 30 * DAY)
    local = open_store(f"file://{tmp_path / 'local'}")
    with TieredStore(local, at(s3, clock, touch_s=3600.0), 1 << 30) as tier:
        keys = ingest(tier, "m-tier", 3, n=2)  # written through: held locally too
        clock.t = now - 2 * DAY
        for key in keys:
            assert tier.get_tiered(key)[1] == "local"  # S3 sees no read ...
    with at(s3, Clock(now), touch_s=3600.0) as store:
        assert [store.used(k) for k in keys] == [pytest.approx(now - 2 * DAY)] * 2  # ... but is told
        assert gc(store, older_than_s=7 * DAY, now=now)["deleted"]["chunks"] == 0


@pytest.mark.timeout(90)
def test_marks_off_refuse_an_age_limit_and_keep_the_size_limit(s3):
    with at(s3, Clock(1_900_000_000.0), touch_s=0.0) as store:
        keys = ingest(store, "m-off", 4, n=2)
        with pytest.raises(Exception, match="not when it was last used"):
            gc(store, older_than_s=DAY)
        assert gc(store, max_bytes=0)["deleted"]["chunks"] == 2
        assert not any(store.exists(k) for k in keys)


def test_an_age_limit_is_refused_where_the_store_tells_only_writes(tmp_path):
    from kvcodec.errors import ConfigError
    from kvcodec.store.http import HttpStore

    nowhere = HttpStore("http://127.0.0.1:9/kv")  # refused before any request
    with pytest.raises(ConfigError, match="not when it was last used"):
        gc(nowhere, older_than_s=DAY)
    local = open_store(f"file://{tmp_path / 'local'}")
    with pytest.raises(ConfigError, match="not when it was last used"):  # a local tier lists its remote
        gc(TieredStore(local, nowhere, 1 << 20), max_bytes=10, older_than_s=DAY)
