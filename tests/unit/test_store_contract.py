"""The store contract as a type (``kvcodec.store.KVStore``, a runtime-checkable Protocol): every
store class in ``kvcodec/store`` (each registered scheme's and the local tier) implements the four
members no store can inherit, with the Protocol's call shapes; each member of the contract says what
it promises, what it raises and whether it may block; the check is structural (a class that does
not subclass ``KVStore`` passes it by having the members, and fails it by lacking one)."""
from __future__ import annotations

import ast
import inspect
import uuid
from pathlib import Path

import pytest

from kvcodec.store import STORES, KVStore
from kvcodec.store.fs import FileStore
from kvcodec.store.memory import MemoryStore
from kvcodec.store.tiered import TieredStore

STORE_DIR = Path(__file__).resolve().parents[2] / "backends" / "kvcodec" / "store"
OWN = ("get", "exists", "put", "delete")  # what every store implements itself
CONTRACT = OWN + ("get_range", "scan", "close", "drop_connections")


def _store_classes() -> dict:
    """{name: class}: each registered scheme's class and every public class in store/ that subclasses
    ``KVStore`` (found in the source, so a new store module cannot slip past)."""
    classes = {f"{cls.__module__}.{cls.__name__}": cls for cls in map(STORES.get, STORES.names())}
    for path in STORE_DIR.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "") == "KVStore" for b in node.bases):
                module = __import__(f"kvcodec.store.{path.stem}", fromlist=[node.name])
                for cls in [getattr(module, node.name)] + getattr(module, node.name).__subclasses__():
                    # the store package's own (a test's subclass, imported earlier in the run, is not)
                    if not cls.__name__.startswith("_") and cls.__module__.startswith("kvcodec.store."):
                        classes[f"{cls.__module__}.{cls.__name__}"] = cls
    return classes


CLASSES = _store_classes()


def test_every_store_in_store_is_checked():
    names = {name.rsplit(".", 1)[1] for name in CLASSES}
    assert {"FileStore", "MemoryStore", "HttpStore", "RedisStore", "RedisClusterStore", "S3Store",
            "TieredStore"} <= names, names


@pytest.mark.parametrize("cls", list(CLASSES.values()), ids=list(CLASSES))
def test_each_store_class_keeps_the_protocol(cls):
    for name in CONTRACT:
        assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}"
        want = inspect.signature(getattr(KVStore, name))
        got = inspect.signature(getattr(cls, name))
        assert list(got.parameters) == list(want.parameters), (cls.__name__, name, got, want)
        assert [p.default for p in got.parameters.values()] == [p.default for p in want.parameters.values()], \
            (cls.__name__, name, got, want)
    for name in OWN:  # not the Protocol's empty body: the store's own
        assert getattr(cls, name) is not getattr(KVStore, name), f"{cls.__name__} does not implement {name}"
    assert hasattr(cls, "__enter__") and hasattr(cls, "__exit__")


def test_store_instances_are_kvstores(tmp_path):
    memory, files = MemoryStore(f"contract-{uuid.uuid4().hex}"), FileStore(tmp_path / "s")
    tiered = TieredStore(FileStore(tmp_path / "local"), FileStore(tmp_path / "remote"), 1 << 20)
    for store in (memory, files, tiered):
        with store:
            assert isinstance(store, KVStore) and store.url


def test_the_protocol_is_structural():
    class Duck:  # keeps the contract without subclassing KVStore
        url = "duck://"

        def get(self, key): return None
        def exists(self, key): return False
        def get_range(self, key, start, end): return None
        def put(self, key, data, overwrite=False): return True
        def delete(self, key): pass
        def scan(self): return iter(())
        def close(self): pass
        def drop_connections(self): pass
        def __enter__(self): return self
        def __exit__(self, *exc): self.close()

    class NoPut(Duck):
        put = None

    assert isinstance(Duck(), KVStore) and not isinstance(NoPut(), KVStore)


@pytest.mark.parametrize("name", CONTRACT)
def test_each_member_says_what_it_promises_raises_and_whether_it_blocks(name):
    doc = inspect.getdoc(getattr(KVStore, name)) or ""
    assert "Raise" in doc and "block" in doc, (name, doc)


def test_put_states_the_create_only_semantics():
    doc = inspect.getdoc(KVStore.put)
    assert "only where" in doc and "absent" in doc and "exactly one gets True" in doc and "overwrite=True" in doc
