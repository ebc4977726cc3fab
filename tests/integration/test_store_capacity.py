"""Capacity of real stores (``kvcodec.store.capacity`` and ``kvcodec store usage|gc``): real chunk
containers on prefix chains (``format.keys``), stored in a folder, nginx (WebDAV; listed through its
JSON folder listing), SeaweedFS's WebDAV server (listed with PROPFIND), redis-server, a 3-node redis cluster and
SeaweedFS (S3); gc keeps each under its limit with every remaining chain intact. And full stores:
a full disk behind nginx and a Redis at maxmemory with noeviction make write-back fail quietly
and counted, never the caller, and so does a SeaweedFS out of volume space; with ``allkeys-lru``
Redis evicts on its own.
"""
from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvcodec.connector import WriteBack
from kvcodec.encode import ChunkEncoder
from kvcodec.errors import ConfigError, StoreUnavailable
from kvcodec.format.auth import ChunkAuth
from kvcodec.format.codecs import get_scheme
from kvcodec.format.keys import chunk_keys
from kvcodec.store import open_store
from kvcodec.store.capacity import gc, usage
from kvcodec.store.http import HttpStore
from kvcodec_tools.ports import free_port, free_port_run
from kvcodec_tools.services.nginx import NginxStore
from kvcodec_tools.services.redis import RedisCluster, RedisServer
from kvcodec_tools.services.seaweedfs import SeaweedS3

pytestmark = pytest.mark.integration

TOKEN = "capacity-token-0123456789"
PASSWORD = "capacity-password-42"
C = 8  # tokens per chunk
AUTH = ChunkAuth(b"c" * 32)
KVCODEC = str(Path(sys.executable).parent / "kvcodec")


def kv(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(-512, 512, (2, 2, 1, C, 16)) / 16).astype(np.float16)


def chains():
    """(model, token ids) of each chain: in m1 a 6-chunk chain, a 5-chunk branch sharing its first 2
    chunks and a 3-chunk chain of its own; in m2 one 4-chunk chain."""
    rng = np.random.default_rng(7)
    t1 = rng.integers(0, 30000, 6 * C).tolist()
    t2 = t1[:2 * C] + rng.integers(0, 30000, 3 * C).tolist()
    t3 = rng.integers(0, 30000, 3 * C).tolist()
    t4 = rng.integers(0, 30000, 4 * C).tolist()
    return [("m1", t1), ("m1", t2), ("m1", t3), ("m2", t4)]


def fill(store) -> list:
    """Store every chain's chunks (raw rung), as ingest would; the chains' key lists."""
    scheme = get_scheme("raw")
    encoders = {m: ChunkEncoder(scheme, m, auth=AUTH) for m in ("m1", "m2")}
    out = []
    for model, ids in chains():
        keys = chunk_keys(ids, model, scheme.identity, C)
        for i, key in enumerate(keys):
            if not store.exists(key):
                store.put(key, encoders[model].encode(kv(i), key, i, i * C))
        out.append(keys)
    return out


def assert_chains_intact(store, all_keys) -> int:
    """Every chain holds a prefix of its chunks (no chunk whose predecessor is gone); chunks left."""
    present = {e.key for e in store.scan()}
    for keys in all_keys:
        held = [k in present for k in keys]
        n = held.index(False) if False in held else len(held)
        assert not any(held[n:]), f"chunk {held.index(True, n)} stored without chunk {n} of its chain"
    return len(present)


# -- every store ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("capacity")
    nginx = NginxStore(root / "nginx", "127.0.0.1", free_port(), TOKEN).start()
    redis = RedisServer(root / "redis", "127.0.0.1", free_port(), PASSWORD).start()
    cluster = RedisCluster(root / "cluster", "127.0.0.1", free_port_run(3, offsets=(0, 10000)), PASSWORD).start(30)
    s3 = SeaweedS3(root / "s3", "127.0.0.1", "capacity-key", "capacity-secret-0123", bucket="kvcap",
                   webdav=True).start(60)  # its WebDAV server: a WebDAV store that speaks PROPFIND
    yield {"nginx": nginx, "redis": redis, "cluster": cluster, "s3": s3, "root": root}
    for srv in (nginx, redis, cluster, s3):
        pids = srv.pids if srv is cluster else [srv.pid]
        srv.stop()
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.killpg(pid, 0)


@pytest.fixture(params=["file", "http", "webdav", "redis", "redis-cluster", "s3"])
def store(request, servers, monkeypatch, tmp_path):
    kind = request.param
    if kind == "s3":
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            monkeypatch.delenv(name)
        for name, value in servers["s3"].environ().items():
            monkeypatch.setenv(name, value)
    s = {"file": lambda: open_store(f"file://{tmp_path / 'store'}"),
         "http": lambda: HttpStore(servers["nginx"].url, token=TOKEN),
         "webdav": lambda: HttpStore(servers["s3"].webdav_url),
         "redis": lambda: open_store(servers["redis"].url),
         "redis-cluster": lambda: open_store(servers["cluster"].url),
         "s3": lambda: open_store(servers["s3"].url)}[kind]()
    for e in list(s.scan()):
        s.delete(e.key)
    yield s
    for e in list(s.scan()):
        s.delete(e.key)
    s.close()


@pytest.mark.timeout(60)
def test_usage_and_gc_keep_the_store_under_its_limit_with_chains_intact(store):
    all_keys = fill(store)
    n_chunks = len({k for keys in all_keys for k in keys})
    assert n_chunks == 16  # 6 + 3 (branch) + 3 + 4
    u = usage(store)
    sizes = {e.key: e.size for e in store.scan()}
    assert (u["chunks"], u["bytes"]) == (n_chunks, sum(sizes.values()))
    assert sorted((g["model"], g["rung"], g["chunks"]) for g in u["groups"]) == [("m1", "raw", 12), ("m2", "raw", 4)]
    limit = u["bytes"] // 2
    report = gc(store, max_bytes=limit)
    assert report["met"] and report["after"]["bytes"] <= limit and report["deleted"]["chunks"] > 0
    left = assert_chains_intact(store, all_keys)
    assert left == report["after"]["chunks"] == u["chunks"] - report["deleted"]["chunks"]
    assert sum(e.size for e in store.scan()) == report["after"]["bytes"]
    report = gc(store, max_bytes=0)
    assert report["met"] and report["after"] == {"bytes": 0, "chunks": 0} and list(store.scan()) == []


# -- order (a folder, whose times the test sets) -------------------------------------------------

def _touch(store, keys, when: float) -> None:
    for k in keys:
        os.utime(store._path(k), (when, when))


@pytest.mark.timeout(60)
def test_gc_goes_least_recently_used_first_and_from_the_tail(tmp_path):
    store = open_store(f"file://{tmp_path}")
    all_keys = fill(store)
    m1, m2 = [k for keys in all_keys[:3] for k in keys], all_keys[3]
    now = time.time()
    _touch(store, m1, now - 60)  # used a minute ago
    _touch(store, m2, now - 3 * 86400)  # unused for three days
    size = {e.key: e.size for e in store.scan()}
    total = sum(size.values())
    # room for all of m1 but not m2: m2 goes whole (tail first), m1 keeps everything
    report = gc(store, max_bytes=total - sum(size[k] for k in m2))
    assert report["deleted"]["chunks"] == 4 and not any(store.exists(k) for k in m2)
    assert all(store.exists(k) for k in m1)
    # one chunk less room: m1's deepest chunk goes (chunk 5 of the 6-chunk chain), not a head
    report = gc(store, max_bytes=report["after"]["bytes"] - 1)
    assert report["deleted"]["chunks"] == 1 and not store.exists(all_keys[0][5])
    assert_chains_intact(store, all_keys)
    # dry run: reported, not deleted
    before = {e.key for e in store.scan()}
    report = gc(store, max_bytes=0, dry_run=True)
    assert report["after"]["chunks"] == 0 and {e.key for e in store.scan()} == before


@pytest.mark.timeout(60)
def test_gc_older_than_and_unreachable_chunks(tmp_path):
    store = open_store(f"file://{tmp_path}")
    all_keys = fill(store)
    now = time.time()
    _touch(store, [k for keys in all_keys for k in keys], now - 60)
    _touch(store, all_keys[2], now - 10 * 86400)  # the 3-chunk chain of m1: old, but m1 has deeper chunks
    _touch(store, all_keys[3][2:], now - 10 * 86400)  # the tail of m2's chain: old
    report = gc(store, older_than_s=7 * 86400)
    assert report["deleted"]["chunks"] == 2 and not any(store.exists(k) for k in all_keys[3][2:])
    assert all(store.exists(k) for k in all_keys[2])  # a deeper, recent chunk of m1 might follow them
    store.delete(all_keys[3][0])  # m2 holds no chunk 0 now: its chunk 1 can never be reached
    report = gc(store, max_bytes=10 ** 12)
    assert report["deleted"]["orphans"] == 1 and not store.exists(all_keys[3][1])
    assert report["after"]["chunks"] == 12  # m1 untouched
    store.delete(all_keys[0][0])  # the last two chunks 0 of m1: nothing of m1 can be reached
    store.delete(all_keys[2][0])
    report = gc(store, max_bytes=10 ** 12)
    assert report["deleted"]["orphans"] == 10 and report["after"]["chunks"] == 0
    store.put("notachunk/ab", b"x")  # outside the key scheme: counted, left alone
    u = usage(store)
    assert u["foreign"] == {"objects": 1, "bytes": 1} and store.exists("notachunk/ab")
    with pytest.raises(ConfigError, match="needs a limit"):
        gc(store)


@pytest.mark.timeout(120)
def test_the_store_commands(tmp_path):
    url = f"file://{tmp_path / 'store'}"
    all_keys = fill(open_store(url))
    run = subprocess.run([KVCODEC, "store", "usage", "--store", url, "--json"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert "m1" in run.stdout and "raw" in run.stdout
    last = json.loads(run.stdout.strip().splitlines()[-1])
    assert last["chunks"] == 16 and last["bytes"] > 0
    run = subprocess.run([KVCODEC, "store", "gc", "--store", url, "--max-bytes", str(last["bytes"] // 3),
                          "--older-than", "30d", "--json"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["after"]["bytes"] <= last["bytes"] // 3 and report["deleted"]["chunks"] > 0
    assert_chains_intact(open_store(url), all_keys)
    run = subprocess.run([KVCODEC, "store", "gc", "--store", url, "--max-bytes", "lots"], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode != 0 and "not a size" in run.stderr


# -- full stores ---------------------------------------------------------------------------------

def _writeback(store):
    """Write-back as the engines run it: encode a chunk and put it, in WriteBack's worker."""
    encoder = ChunkEncoder(get_scheme("raw"), "m1", auth=AUTH)

    def save(job):
        key, index, data = job
        store.put(key, encoder.encode(data, key, index, index * C))

    return WriteBack(save, max_pending=8)


def _needs_root() -> None:
    if os.geteuid() != 0:
        message = "a full disk is a tmpfs this test mounts: run as root"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.mark.timeout(60)
def test_a_full_disk_behind_nginx_fails_write_back_quietly_and_counted(tmp_path):
    _needs_root()
    data = tmp_path / "data"
    data.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(data)], check=True, timeout=10)
    try:
        with NginxStore(tmp_path, "127.0.0.1", free_port(), TOKEN) as srv:
            store = HttpStore(srv.url, token=TOKEN)
            big = np.tile(kv(0), (1, 1, 1, 1, 64))  # ~130 KB raw: more than the disk holds
            queue = _writeback(store)
            key = chunk_keys(list(range(C)), "m1", "raw", C)[0]
            assert queue.offer((key, 0, kv(1)))  # fits
            assert queue.offer((key[:-1] + "0", 0, big))  # does not
            assert queue.flush(30)
            stats = queue.stats()
            assert (stats["stored"], stats["failed"]) == (1, 1)
            with pytest.raises(StoreUnavailable, match=r"PUT .* answered HTTP 5\d\d"):
                store.put(key[:-1] + "0", b"x" * (100 << 10))  # nginx answers 500 for ENOSPC on PUT
            assert store.exists(key)
            queue.close(10)
            store.close()
    finally:
        subprocess.run(["umount", str(data)], timeout=10)


@pytest.mark.timeout(60)
def test_a_full_s3_store_fails_write_back_quietly_and_counted(tmp_path, monkeypatch):
    srv = SeaweedS3(tmp_path, "127.0.0.1", "full-key-01", "full-secret-0123", bucket="kvfull", volume_size_mb=1,
                    volume_max=1)  # one volume of 1 MB: full after about 1 MB
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    srv.start(60)
    try:
        for name, value in srv.environ().items():
            monkeypatch.setenv(name, value)
        store = open_store(srv.url + "?attempts=1")
        queue = _writeback(store)
        keys = chunk_keys(list(range(8 * C)), "m1", "raw", C)
        big = np.tile(kv(0), (1, 1, 1, 1, 256))  # ~260 KB raw: eight of them do not fit
        for i, key in enumerate(keys):
            assert queue.offer((key, i, big))
            assert queue.flush(30)
        stats = queue.stats()
        assert stats["failed"] >= 1 and stats["stored"] >= 1 and stats["stored"] + stats["failed"] == len(keys)
        with pytest.raises(StoreUnavailable, match="HTTP 5"):
            store.put("fill/more", os.urandom(512 << 10))
        queue.close(5)
        store.close()
    finally:
        pid = srv.pid
        srv.stop(grace_s=1)  # a full weed does not exit on SIGTERM
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)


class _Full(http.server.BaseHTTPRequestHandler):
    def do_PUT(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(507)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.timeout(30)
def test_a_webdav_507_is_a_full_store_and_write_back_counts_it():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Full)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = HttpStore(f"http://127.0.0.1:{server.server_address[1]}/kv")
        key = chunk_keys(list(range(C)), "m1", "raw", C)[0]
        with pytest.raises(StoreUnavailable, match=r"full \(HTTP 507"):
            store.put(key, b"x")
        queue = _writeback(store)
        assert queue.offer((key, 0, kv(1)))
        assert queue.flush(10) and queue.stats()["failed"] == 1
        queue.close(5)
        store.close()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.timeout(60)
def test_redis_at_maxmemory_noeviction_fails_write_back_quietly_allkeys_lru_evicts(tmp_path):
    import redis

    with RedisServer(tmp_path, "127.0.0.1", free_port(), PASSWORD) as srv:
        admin = redis.Redis(host=srv.host, port=srv.port, password=PASSWORD)
        store = open_store(srv.url)
        store.put("filler/a", os.urandom(1 << 20))
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", str(admin.info("memory")["used_memory"] + (256 << 10)))  # full
        with pytest.raises(StoreUnavailable, match=r"is full \(.*maxmemory"):
            store.put("filler/b", os.urandom(1 << 20))
        queue = _writeback(store)
        key = chunk_keys(list(range(C)), "m1", "raw", C)[0]
        big = np.tile(kv(0), (1, 1, 1, 1, 512))  # ~1 MB raw: more than is left
        assert queue.offer((key, 0, big))
        assert queue.flush(30) and queue.stats()["failed"] == 1 and not store.exists(key)
        # allkeys-lru: Redis bounds itself, the least recently used values go first, writes succeed
        admin.config_set("maxmemory-policy", "allkeys-lru")
        admin.config_set("maxmemory-samples", "10")
        store.delete("filler/a")
        limit = admin.info("memory")["used_memory"] + (4 << 20)
        admin.config_set("maxmemory", str(limit))
        for i in range(40):  # 8 MB through 4 MB: every write succeeds
            store.put(f"lru/{i:02d}", os.urandom(200 << 10))
        held = [store.exists(f"lru/{i:02d}") for i in range(40)]
        # which keys go is Redis's sampled LRU (its clock ticks once a second): the newest stays
        assert held[-1] and sum(held) < 30 and admin.info("stats")["evicted_keys"] >= 10
        assert admin.info("memory")["used_memory"] <= limit + (1 << 20)
        queue.close(5)
        store.close()
        admin.close()
