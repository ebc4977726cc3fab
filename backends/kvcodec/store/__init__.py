"""KV chunk stores, chosen by URL scheme.

Contract of a ``KVStore`` (every backend: the filesystem default, memory for tests, HTTP and
Redis):

- ``get(key) -> bytes | None``: the stored bytes, or ``None`` on a miss (a miss is not an error);
- ``exists(key) -> bool``: cheap presence test;
- ``get_range(key, start, end) -> bytes | None``: bytes ``[start, end)`` of the stored value (as
  ``get(key)[start:end]``: short or empty past the end), or ``None`` on a miss;
- ``put(key, data)``: store atomically (a reader sees the old value, or the whole new one);
- ``delete(key)``: remove if present;
- ``close()``: release connections.
Transport failures raise ``StoreUnavailable``, and so does a store that refuses the credentials
(the message says so). Keys are ``[0-9a-z/]`` paths made by ``kvcodec.format.keys``.

``open_store(url)`` picks the backend by scheme (``file://DIR``, ``memory://NAME``,
``http://HOST:PORT/PREFIX``, ``redis://:PASSWORD@HOST:PORT/DB``,
``redis+cluster://:PASSWORD@HOST:PORT[,HOST:PORT...]``); the backend's module (and ``redis``) is
imported only when its scheme is used. Secrets come from ``KVCODEC_STORE_TOKEN`` (the HTTP bearer
token; the Redis password when the URL has none), so they need not be in a URL.
"""
from __future__ import annotations

import re
from typing import Optional
from urllib.parse import urlsplit

from ..errors import BadRequest, ConfigError
from ..registry import Registry

_KEY = re.compile(r"^[0-9a-z][0-9a-z/_-]{0,254}$")


class KVStore:
    url: str = ""

    def get(self, key: str) -> Optional[bytes]:
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def get_range(self, key: str, start: int, end: int) -> Optional[bytes]:
        """Bytes ``[start, end)`` of the value, or None on a miss (default: slice ``get``)."""
        check_range(start, end)
        data = self.get(key)
        return None if data is None else data[start:end]

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.match(key) or ".." in key or "//" in key:
        raise BadRequest(f"bad store key {key!r}")
    return key


def check_range(start: int, end: int) -> None:
    if not (isinstance(start, int) and isinstance(end, int)) or not 0 <= start <= end:
        raise BadRequest(f"bad byte range [{start!r}, {end!r}): need 0 <= start <= end")


STORES: Registry = Registry("store scheme")
STORES.register("file", "kvcodec.store.fs:FileStore")
STORES.register("memory", "kvcodec.store.memory:MemoryStore")
STORES.register("http", "kvcodec.store.http:HttpStore")
STORES.register("redis", "kvcodec.store.redis_store:RedisStore")
STORES.register("redis+cluster", "kvcodec.store.redis_store:RedisClusterStore")


def open_store(url: str) -> KVStore:
    scheme = urlsplit(url).scheme
    if not scheme:
        raise ConfigError(f"store URL {url!r} has no scheme (use file://DIR)")
    if scheme not in STORES:
        raise ConfigError(f"store URL {url!r}: unknown scheme {scheme!r} (known: {', '.join(STORES.names())})")
    return STORES.get(scheme).from_url(url)
