"""KV stores (kvcodec.store): the same contract for the filesystem and the in-memory backend."""
from __future__ import annotations

import threading
import time
import uuid

import pytest

from kvcodec.errors import BadRequest, ConfigError
from kvcodec.store import KVStore, check_key, open_store
from kvcodec.store.fs import FileStore
from kvcodec.store.memory import MemoryStore

KEY = "0a1b2c3d4e5f/abcdefabcdef/" + "0" * 40
BAD_KEYS = ["../x", "a/../b", "", "ABC", "a//b", "/abs", "a b", "a.b", "x" * 300, "é", None, 5]


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    if request.param == "file":
        s = FileStore(tmp_path / "store")
    else:
        s = MemoryStore(f"unit-{uuid.uuid4().hex}")
    yield s
    s.close()


def test_get_returns_none_on_a_miss(store):
    assert store.get(KEY) is None
    assert store.exists(KEY) is False


def test_put_get_exists_delete(store):
    data = bytes(range(256)) * 3
    store.put(KEY, data)
    assert store.exists(KEY)
    assert store.get(KEY) == data
    assert isinstance(store.get(KEY), bytes)
    store.delete(KEY)
    assert store.get(KEY) is None and not store.exists(KEY)
    store.delete(KEY)  # deleting what is not there is fine


def test_put_creates_and_overwrite_replaces(store):
    assert store.put(KEY, b"old value, longer than the new one") is True
    assert store.put(KEY, b"new") is False  # a create: the first writer's value stays
    assert store.get(KEY) == b"old value, longer than the new one"
    assert store.put(KEY, b"new", overwrite=True) is True
    assert store.get(KEY) == b"new"


class SlowCheck(dict):
    """The memory store's contents with a pause after each presence check: every racing writer is
    between its check and its write at once, so a create that is not under one lock is caught
    (without the pause, the GIL all but closes that window and the test could not fail)."""

    def __contains__(self, key):
        found = dict.__contains__(self, key)
        time.sleep(0.01)
        return found


def test_writers_racing_for_one_key_leave_exactly_one_winner(store):
    if isinstance(store, MemoryStore):
        store._data = SlowCheck(store._data)
    values = [bytes([65 + i]) * (64 << 10) for i in range(8)]
    gate = threading.Barrier(len(values))
    won = [None] * len(values)

    def write(i):
        gate.wait(10)
        won[i] = store.put(KEY, values[i])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(values))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert won.count(True) == 1 and won.count(False) == len(values) - 1, won
    assert store.get(KEY) == values[won.index(True)]


def test_keys_are_independent(store):
    other = KEY[:-1] + "1"
    store.put(KEY, b"a")
    store.put(other, bytearray(b"b"))
    assert store.get(KEY) == b"a" and store.get(other) == b"b"
    store.delete(KEY)
    assert store.get(other) == b"b"


def test_empty_value_round_trips(store):
    store.put(KEY, b"")
    assert store.exists(KEY)
    assert store.get(KEY) == b""


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_raise_bad_request(store, key):
    for op in (store.get, store.exists, store.delete, lambda k: store.put(k, b"x")):
        with pytest.raises(BadRequest):
            op(key)


@pytest.mark.parametrize("key", ["a", "0/1/2", "ab-cd_ef/01", KEY])
def test_check_key_accepts_store_paths(key):
    assert check_key(key) == key


def test_store_is_a_context_manager(store):
    with store as s:
        assert isinstance(s, KVStore) and s is store


def test_file_store_leaves_no_temp_files_after_put(tmp_path):
    root = tmp_path / "store"
    s = FileStore(root)
    for i in range(3):
        s.put(KEY, b"x" * (i + 1) * 1000)
    s.put(KEY[:-1] + "9", b"y")
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert files == sorted([KEY + ".kvc", KEY[:-1] + "9.kvc"])
    assert not [p for p in root.rglob(".tmp-*")]


def test_file_store_failed_put_raises_unavailable_and_leaves_no_temp_file(tmp_path, monkeypatch):
    from kvcodec.errors import StoreUnavailable
    from kvcodec.store import fs

    root = tmp_path / "store"
    s = FileStore(root)

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fs.os, "replace", refuse)
    monkeypatch.setattr(fs.os, "link", refuse)
    with pytest.raises(StoreUnavailable, match="No space left"):
        s.put(KEY, b"data")
    with pytest.raises(StoreUnavailable, match="No space left"):
        s.put(KEY, b"data", overwrite=True)
    monkeypatch.undo()
    assert s.get(KEY) is None
    leftovers = [p.name for p in root.rglob(".tmp-*")]
    assert leftovers == [], f"failed put left {leftovers}"


def test_file_store_survives_a_new_instance(tmp_path):
    FileStore(tmp_path / "s").put(KEY, b"persisted")
    assert FileStore(tmp_path / "s").get(KEY) == b"persisted"


def test_memory_stores_of_one_name_share_contents_and_others_do_not():
    name = f"unit-{uuid.uuid4().hex}"
    a, b, c = MemoryStore(name), MemoryStore(name), MemoryStore(name + "-other")
    a.put(KEY, b"shared")
    assert b.get(KEY) == b"shared"
    assert c.get(KEY) is None


def test_memory_store_copies_what_it_is_given():
    s = MemoryStore(f"unit-{uuid.uuid4().hex}")
    buf = bytearray(b"abc")
    s.put(KEY, buf)
    buf[0] = ord("z")
    assert s.get(KEY) == b"abc"


def test_open_store_picks_the_backend_by_scheme(tmp_path):
    fs = open_store(f"file://{tmp_path}/by-url")
    assert isinstance(fs, FileStore)
    assert fs.root == (tmp_path / "by-url").resolve() and fs.root.is_dir()
    fs.put(KEY, b"x")
    assert (tmp_path / "by-url" / (KEY + ".kvc")).read_bytes() == b"x"
    name = f"unit-{uuid.uuid4().hex}"
    mem = open_store(f"memory://{name}")
    assert isinstance(mem, MemoryStore) and mem.url == f"memory://{name}"
    mem.put(KEY, b"y")
    assert MemoryStore(name).get(KEY) == b"y"


@pytest.mark.parametrize("url, match", [
    ("redis2://host/0", "unknown scheme 'redis2'"),
    ("gs://bucket/x", "unknown scheme 'gs'"),
    ("/just/a/path", "no scheme"),
    ("", "no scheme"),
    ("file://", "names no folder"),
])
def test_open_store_rejects_bad_urls(url, match):
    with pytest.raises(ConfigError, match=match):
        open_store(url)
