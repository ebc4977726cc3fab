"""The lazy name -> "module:attribute" registry (kvcodec.registry)."""
from __future__ import annotations

import sys

import pytest

from kvcodec.errors import Unsupported
from kvcodec.registry import Registry


def test_register_and_get():
    r = Registry("widget")
    r.register("od", "collections:OrderedDict")
    import collections

    assert r.get("od") is collections.OrderedDict
    assert "od" in r and "other" not in r
    assert r.names() == ["od"]


def test_duplicate_name_raises():
    r = Registry("widget")
    r.register("a", "collections:OrderedDict")
    with pytest.raises(ValueError, match="'a' is already registered"):
        r.register("a", "collections:Counter")
    assert r.get("a").__name__ == "OrderedDict"  # the first one stays


def test_target_must_name_module_and_attribute():
    with pytest.raises(ValueError, match="module:attribute"):
        Registry("widget").register("a", "collections.OrderedDict")


def test_unknown_name_raises_unsupported_listing_known_names():
    r = Registry("widget")
    r.register("zeta", "collections:Counter")
    r.register("alpha", "collections:OrderedDict")
    with pytest.raises(Unsupported, match=r"unknown widget 'beta' \(known: alpha, zeta\)"):
        r.get("beta")
    with pytest.raises(NotImplementedError):  # Unsupported is also the built-in
        r.get("beta")
    with pytest.raises(Unsupported, match="known: none"):
        Registry("widget").get("x")


def test_the_target_module_is_imported_only_on_get():
    module = "kvcodec_unit_no_such_module_x9"
    r = Registry("widget")
    r.register("ghost", f"{module}:Ghost")  # registering does not import
    assert "ghost" in r and module not in sys.modules
    with pytest.raises(ModuleNotFoundError, match=module):
        r.get("ghost")


def test_a_missing_attribute_raises_attribute_error():
    r = Registry("widget")
    r.register("nope", "collections:NoSuchThing")
    with pytest.raises(AttributeError):
        r.get("nope")


def test_get_caches_the_loaded_target(monkeypatch):
    r = Registry("widget")
    r.register("od", "collections:OrderedDict")
    first = r.get("od")
    import importlib

    def no_import(name, *a, **k):
        raise AssertionError(f"imported {name} again")

    monkeypatch.setattr(importlib, "import_module", no_import)
    assert r.get("od") is first


def test_library_registries_do_not_import_heavy_modules_until_used():
    """Registering the hevc codec and nvdec decoder must not import PyAV or PyNvVideoCodec."""
    import subprocess

    code = ("import sys, kvcodec.bitstream, kvcodec.store, kvcodec.layout, kvcodec.encode, kvcodec.serving.decode, "
            "kvcodec.serving.restore, kvcodec.serving.request, kvcodec.engines, kvcodec.settings; "
            "bad = [m for m in ('av', 'PyNvVideoCodec', 'zstandard', 'torch') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"imported at registration: {result.stdout.strip()} {result.stderr[-500:]}"


def test_remote_store_schemes_are_registered_lazily():
    """http/redis/redis+cluster are registered by kvcodec.store; redis is imported at the first command."""
    import subprocess

    code = ("import sys, kvcodec.store as st; "
            "assert {'http', 'redis', 'redis+cluster'} <= set(st.STORES.names()); "
            "loaded = lambda: [m for m in ('redis', 'kvcodec.store.http', 'kvcodec.store.redis_store') "
            "if m in sys.modules]; "
            "before = loaded(); "
            "s = st.open_store('redis+cluster://:pw@127.0.0.1:9'); st.open_store('redis://127.0.0.1:9/0'); "
            "opened = loaded(); "
            "print(before, opened); sys.exit(0 if before == [] and 'redis' not in opened else 1)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"imported too early: {result.stdout.strip()} {result.stderr[-500:]}"
