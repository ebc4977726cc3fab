"""KV chunk stores, chosen by URL scheme.

The contract is ``KVStore``, a ``typing.Protocol`` (runtime-checkable) with a line on each member:
what it promises, what it raises, whether it may block. Every backend (the filesystem default, memory
for tests, HTTP(S), Redis and S3, the local tier) keeps it; a backend may subclass ``KVStore`` to
take its shared behaviour (``get_range`` by slicing ``get``, ``scan`` refused, ``close`` and
``drop_connections`` doing nothing, use as a context manager), or keep it structurally. Errors are
``kvcodec.errors``': a bad key or range is ``BadRequest``; a transport failure, or a store that
refuses the credentials (the message says so), is ``StoreUnavailable``; a miss is never an error.
Keys are ``[0-9a-z/]`` paths made by ``kvcodec.format.keys``.

``open_store(url)`` picks the backend by scheme (``file://DIR``, ``memory://NAME``,
``http[s]://HOST:PORT/PREFIX``, ``redis[s]://:PASSWORD@HOST:PORT/DB``,
``redis[s]+cluster://:PASSWORD@HOST:PORT[,HOST:PORT...]``, ``s3://BUCKET/PREFIX``); the backend's
module (and ``redis``, ``boto3``) is imported only when its scheme is used. Secrets come from
``KVCODEC_STORE_TOKEN`` (the HTTP bearer token; the Redis password when the URL has none), or for
S3 the standard ``AWS_*`` variables, so they need not be in a URL. TLS (``https``, ``rediss``,
an S3 endpoint on ``https``) verifies the server against the system CAs, or against the CA bundle
``KVCODEC_STORE_CA_FILE`` (settings' ``store_ca_file``) when set.
"""
from __future__ import annotations

import re
from typing import Iterator, NamedTuple, Optional, Protocol, runtime_checkable
from urllib.parse import urlsplit

from ..errors import BadRequest, ConfigError
from ..registry import Registry

_KEY = re.compile(r"^[0-9a-z][0-9a-z/_-]{0,254}$")


CA_FILE_ENV = "KVCODEC_STORE_CA_FILE"


class Entry(NamedTuple):
    """One stored chunk, as ``KVStore.scan`` lists it."""

    key: str
    size: int
    time: float  # last use where the store tracks it, else last write (epoch seconds)


@runtime_checkable
class KVStore(Protocol):
    """A store of chunks by key. ``get``, ``exists``, ``put`` and ``delete`` each store implements;
    the other members have their shared behaviour here, for stores that subclass this class.

    "May block": the call may wait on the network or the disk (a network store honours the caller's
    ``kvcodec.store.deadline.call_deadline`` where the backend can: HTTP(S)); a caller that must not
    wait (TensorRT-LLM's scheduler hook) calls it from another thread."""

    url: str = ""  # where the store is (``open_store``'s URL): keys, the breaker and link costs are per url

    def get(self, key: str) -> Optional[bytes]:
        """The whole stored value, or None on a miss (a miss is not an error). Raises ``BadRequest``
        (bad key), ``StoreUnavailable``. May block."""

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored: a cheap presence test (no value moved). Raises ``BadRequest``,
        ``StoreUnavailable``. May block (one round trip)."""

    def get_range(self, key: str, start: int, end: int) -> Optional[bytes]:
        """Bytes ``[start, end)`` of the value, as ``get(key)[start:end]`` (short or empty past the
        end), or None on a miss. Raises ``BadRequest`` (bad key; not ``0 <= start <= end``),
        ``StoreUnavailable``. May block. Shared: slices ``get``; a store that can read a range reads it."""
        check_range(start, end)
        data = self.get(key)
        return None if data is None else data[start:end]

    def put(self, key: str, data: bytes, overwrite: bool = False) -> bool:
        """A create: stores ``data`` only where ``key`` is absent, and says whether it did (False:
        another writer stored the key first and its value stays; chunk keys name their content, so
        that is the same chunk). ``overwrite=True`` replaces what is there (a stored copy found
        corrupt) and returns True. Atomic: a reader sees no value, the old one or the whole new one,
        never a torn one; of writers racing to create one key exactly one gets True. Each backend
        creates the same way: the file store with a hard link (``link(2)`` fails on an existing
        name), memory under a lock, Redis ``SET NX``, S3 ``PutObject`` with ``If-None-Match: *``,
        HTTP a WebDAV ``MKCOL`` claim (``mkdir(2)``) then ``PUT`` with ``If-None-Match: *`` (405 /
        412: taken). Raises ``BadRequest`` (bad key), ``StoreUnavailable``. May block."""

    def delete(self, key: str) -> None:
        """Removes ``key`` if present (absent is not an error). Raises ``BadRequest``,
        ``StoreUnavailable``. May block."""

    def scan(self) -> Iterator[Entry]:
        """Every stored chunk as ``Entry(key, size, time)``, ``time`` the last use where the store
        tracks it (Redis idle time, a file's access time, S3's use marks), else the last write (epoch
        seconds); for ``kvcodec.store.capacity`` (usage, gc), never for serving. Raises
        ``StoreUnavailable``; shared: ``NotImplementedError`` from a store that cannot list. May
        block for long (it lists the whole store)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its chunks")

    def close(self) -> None:
        """Releases connections and the store's own threads; the store is not used after. Raises
        nothing. May block briefly (joins the store's threads). Shared: nothing to release."""

    def drop_connections(self) -> None:
        """Connections made until now are not reused (the fetcher's circuit breaker calls it when it
        opens). Raises nothing; never blocks on the network. Shared: nothing to drop (a store
        without connections)."""

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
STORES.register("https", "kvcodec.store.http:HttpStore")
STORES.register("rediss", "kvcodec.store.redis_store:RedisStore")
STORES.register("rediss+cluster", "kvcodec.store.redis_store:RedisClusterStore")
STORES.register("s3", "kvcodec.store.s3:S3Store")


TLS_SCHEMES = ("https", "rediss", "rediss+cluster", "s3")  # the stores that take a CA bundle


def open_store(url: str, ca_file: Optional[str] = None) -> KVStore:
    """The store of ``url``; ``ca_file``: the CA bundle of a TLS store (None: ``KVCODEC_STORE_CA_FILE``,
    else the system CAs)."""
    scheme = urlsplit(url).scheme
    if not scheme:
        raise ConfigError(f"store URL {url!r} has no scheme (use file://DIR)")
    if scheme not in STORES:
        raise ConfigError(f"store URL {url!r}: unknown scheme {scheme!r} (known: {', '.join(STORES.names())})")
    if ca_file is not None and scheme in TLS_SCHEMES:
        return STORES.get(scheme).from_url(url, ca_file=ca_file)
    return STORES.get(scheme).from_url(url)
