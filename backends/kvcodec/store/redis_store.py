"""Redis stores: ``redis[s]://[USER]:PASSWORD@HOST:PORT/DB`` and
``redis[s]+cluster://[USER]:PASSWORD@HOST:PORT[,HOST:PORT...]`` (the ``redis`` package).

One value per chunk under ``<prefix><key>``; ``put`` is ``SET NX`` (a create: False when the key
is there), ``SET`` with ``overwrite`` (atomic: a reader sees the old value or the whole new one). ``get_range`` sends ``EXISTS`` and ``GETRANGE`` in one round trip (``GETRANGE``
alone cannot tell a miss from an empty value). Keys carry no hash tag, so a cluster spreads them
over its slots.

The password comes from the URL, else from ``KVCODEC_STORE_TOKEN``; ``url`` masks it. One
connection pool per store object (redis-py's; for a cluster, one per node), made on first use, so
a store opened before its server is up works once the server is. Connection errors, timeouts and
cluster errors raise ``StoreUnavailable``; a refused password says so.

URL options: ``?timeout_s=5&connect_timeout_s=3&prefix=kvcodec:``.

TLS: ``rediss://`` and ``rediss+cluster://`` verify the server's (each node's) certificate and host name against the system CAs, or
against the CA bundle ``ca_file`` (else ``KVCODEC_STORE_CA_FILE``); a certificate that does not
verify raises ``StoreUnavailable`` saying so.

``scan`` (for ``store.capacity``) walks ``SCAN MATCH <prefix>*`` with ``STRLEN`` and ``OBJECT
IDLETIME`` per key (pipelined), so ``time`` is the last use. Redis bounds itself: run it with
``maxmemory`` and ``maxmemory-policy allkeys-lru`` and it evicts the least recently used chunks on
its own (a chain may then lose a middle chunk: the fetcher uses the stored prefix up to it). With
``noeviction`` a full Redis refuses writes (OOM), which write-back counts as failed.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Iterator, List, Optional, Tuple
from urllib.parse import parse_qsl, unquote, urlsplit

from ..errors import ConfigError, StoreUnavailable
from . import CA_FILE_ENV, Entry, KVStore, check_key, check_range
from .http import TOKEN_ENV

_OPTIONS = ("timeout_s", "connect_timeout_s", "prefix")


def _options(url: str, query: str) -> dict:
    out = {}
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name not in _OPTIONS:
            raise ConfigError(f"redis store URL option {name!r} is unknown (known: {', '.join(_OPTIONS)})")
        if name == "prefix":
            out[name] = value
            continue
        try:
            out[name] = float(value)
        except ValueError:
            raise ConfigError(f"redis store URL option {name}={value!r} is not a number") from None
    return out


def _host_port(text: str, url: str) -> Tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, "6379"
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"redis store URL {url!r}: bad address {text!r} (use HOST:PORT)")
    return host, int(port)


def _split(url: str, scheme: str) -> Tuple[Optional[str], Optional[str], List[Tuple[str, int]], str, str]:
    """(username, password, [(host, port)...], path, query) of a redis URL; commas allowed in hosts."""
    parts = urlsplit(url)
    if parts.scheme != scheme:
        raise ConfigError(f"redis store URL {url!r}: scheme must be {scheme}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, password = None, None
    if userinfo:
        name, sep, secret = userinfo.partition(":")
        user = unquote(name) or None
        password = unquote(secret) if sep else None
    if not hosts:
        raise ConfigError(f"redis store URL {url!r} names no host")
    return user, password, [_host_port(h, url) for h in hosts.split(",")], parts.path, parts.query


def _auth_failure(exc: BaseException) -> bool:
    """A refused password, also where the cluster client wraps it while bootstrapping."""
    import redis.exceptions as rx

    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, (rx.AuthenticationError, rx.AuthenticationWrongNumberOfArgsError)):
            return True
        text = str(exc)
        if "invalid username-password pair" in text or "WRONGPASS" in text or "NOAUTH" in text:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class _RedisBase(KVStore):
    """The store contract over a redis-py client made once (``_make_client``) on first use."""

    kind = "redis"

    def __init__(self, username: Optional[str], password: Optional[str], timeout_s: float,
                 connect_timeout_s: float, prefix: str) -> None:
        for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{self.kind} store {name} must be > 0, got {value!r}")
        if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
            raise ConfigError(f"{self.kind} store prefix must be a string without hash tags, got {prefix!r}")
        self.username = username
        self.password = password if password is not None else os.environ.get(TOKEN_ENV) or None
        self.timeout_s, self.connect_timeout_s = float(timeout_s), float(connect_timeout_s)
        self.prefix = prefix
        self._client = None
        self._lock = threading.Lock()

    def _set_tls(self, tls: bool, ca_file: Optional[str]) -> None:
        self.tls = bool(tls)
        self.ca_file = ca_file if ca_file is not None else os.environ.get(CA_FILE_ENV, "")
        if self.tls and self.ca_file and not os.path.isfile(self.ca_file):
            raise ConfigError(f"{self.kind} store: the CA bundle {self.ca_file!r} ({CA_FILE_ENV}) is not a file")

    def _make_client(self):
        raise NotImplementedError

    tls = False
    ca_file = ""

    def _common_kwargs(self) -> dict:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        kwargs = dict(username=self.username, password=self.password, socket_timeout=self.timeout_s,
                      socket_connect_timeout=self.connect_timeout_s, retry=Retry(NoBackoff(), 1))
        if self.tls:
            kwargs.update(ssl=True, ssl_cert_reqs="required", ssl_ca_certs=self.ca_file or None,
                          ssl_check_hostname=True)
        return kwargs

    def _call(self, what: str, key: str, fn):
        import redis.exceptions as rx

        try:
            with self._lock:
                if self._client is None:
                    self._client = self._make_client()
                client = self._client
            return fn(client)
        except (rx.RedisError, rx.RedisClusterException, OSError) as exc:
            if _auth_failure(exc):
                how = "the password was not accepted" if self.password else f"no password is set (URL or {TOKEN_ENV})"
                raise StoreUnavailable(f"{self.kind} store {self.url} refused the credentials for {what} {key} "
                                       f"({how}: {exc})") from None
            if isinstance(exc, rx.NoPermissionError):
                raise StoreUnavailable(f"{self.kind} store {self.url} refused {what} {key} "
                                       f"(the credentials lack the permission: {exc})") from None
            if "CERTIFICATE_VERIFY_FAILED" in str(exc) or "certificate verify failed" in str(exc):
                raise StoreUnavailable(f"{self.kind} store {self.url}: TLS certificate not accepted against "
                                       f"{self.ca_file or 'the system CAs'} ({what} {key}: {exc})") from None
            if isinstance(exc, rx.OutOfMemoryError) or "maxmemory" in str(exc):
                raise StoreUnavailable(f"{self.kind} store {self.url} is full ({what} {key}: {exc}; "
                                       "see maxmemory and maxmemory-policy allkeys-lru)") from None
            if isinstance(exc, rx.ResponseError) and not isinstance(exc, rx.ClusterError):
                raise StoreUnavailable(f"{self.kind} store {self.url}: {what} {key} failed: {exc}") from None
            raise StoreUnavailable(f"{self.kind} store {self.url} unreachable ({what} {key}): "
                                   f"{type(exc).__name__}: {exc}") from None
        except ValueError as exc:
            # redis-py reading a socket closed under the call (the breaker dropping connections while
            # the store is down; seen in kvcodec soak --chaos): a failed call, not a bug to surface
            if "closed file" not in str(exc):
                raise
            raise StoreUnavailable(f"{self.kind} store {self.url}: the connection closed under {what} {key}") from None

    def _k(self, key: str) -> str:
        return self.prefix + check_key(key)

    def get(self, key: str) -> Optional[bytes]:
        k = self._k(key)
        return self._call("GET", key, lambda c: c.get(k))

    def get_range(self, key: str, start: int, end: int) -> Optional[bytes]:
        check_range(start, end)
        k = self._k(key)

        def run(c):
            pipe = c.pipeline(transaction=False)
            pipe.exists(k)
            if end > start:
                pipe.getrange(k, start, end - 1)
            found, *data = pipe.execute()
            return (data[0] if data else b"") if found else None

        return self._call("GETRANGE", key, run)

    def exists(self, key: str) -> bool:
        k = self._k(key)
        return bool(self._call("EXISTS", key, lambda c: c.exists(k)))

    def put(self, key: str, data: bytes, overwrite: bool = False) -> bool:
        k, value = self._k(key), bytes(data)
        if overwrite:
            self._call("SET", key, lambda c: c.set(k, value))
            return True
        return bool(self._call("SET NX", key, lambda c: c.set(k, value, nx=True)))

    def delete(self, key: str) -> None:
        k = self._k(key)
        self._call("DEL", key, lambda c: c.delete(k))

    def scan(self) -> Iterator[Entry]:
        now = time.time()

        def nodes(c):
            return [c] if not hasattr(c, "get_primaries") else [c.get_redis_connection(n) for n in c.get_primaries()]

        for node in self._call("SCAN", self.prefix + "*", nodes):
            cursor = 0
            while True:
                cursor, names = self._call("SCAN", self.prefix + "*",
                                           lambda c, cur=cursor, node=node: node.scan(cur, match=self.prefix + "*", count=500))
                names = [n.decode() if isinstance(n, bytes) else n for n in names]

                def sizes(c, names=names, node=node):
                    pipe = node.pipeline(transaction=False)
                    for n in names:
                        pipe.strlen(n)
                        pipe.object("idletime", n)
                    return pipe.execute(raise_on_error=False)

                replies = self._call("SCAN", self.prefix + "*", sizes) if names else []
                for i, name in enumerate(names):
                    size, idle = replies[2 * i], replies[2 * i + 1]
                    if isinstance(size, int) and isinstance(idle, int) and size:
                        yield Entry(name[len(self.prefix):], size, now - idle)
                if not cursor:
                    break

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def drop_connections(self) -> None:
        """Close every connection, those in use too (a call hung on a paused server ends at once,
        as ``StoreUnavailable``); the next call makes a new client. The fetcher calls this when the
        store's circuit breaker opens (``kvcodec.serving.calls``)."""
        self.close()


class RedisStore(_RedisBase):
    """One redis server (``redis://[USER]:PASSWORD@HOST:PORT/DB``)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, db: int = 0, password: Optional[str] = None,
                 username: Optional[str] = None, timeout_s: float = 10.0, connect_timeout_s: float = 3.0,
                 prefix: str = "kvcodec:", tls: bool = False, ca_file: Optional[str] = None) -> None:
        super().__init__(username, password, timeout_s, connect_timeout_s, prefix)
        self._set_tls(tls, ca_file)
        if not isinstance(db, int) or db < 0:
            raise ConfigError(f"redis store db must be an integer >= 0, got {db!r}")
        self.host, self.port, self.db = host, int(port), db
        auth = f"{username or ''}:***@" if self.password or username else ""
        self.url = f"{'rediss' if self.tls else 'redis'}://{auth}{host}:{self.port}/{db}"

    @classmethod
    def from_url(cls, url: str, ca_file: Optional[str] = None) -> "RedisStore":
        scheme = urlsplit(url).scheme
        user, password, hosts, path, query = _split(url, "rediss" if scheme == "rediss" else "redis")
        if len(hosts) != 1:
            raise ConfigError(f"redis store URL {url!r} names {len(hosts)} hosts; use redis+cluster:// for a cluster")
        db = path.strip("/") or "0"
        if not db.isdigit():
            raise ConfigError(f"redis store URL {url!r}: database {db!r} is not a number")
        (host, port), = hosts
        return cls(host, port, int(db), password, user, tls=scheme == "rediss", ca_file=ca_file,
                   **_options(url, query))

    def _make_client(self):
        import redis

        return redis.Redis(host=self.host, port=self.port, db=self.db, **self._common_kwargs())


class RedisClusterStore(_RedisBase):
    """A redis cluster (``redis[s]+cluster://[USER]:PASSWORD@HOST:PORT[,HOST:PORT...]``): any of the
    nodes bootstraps the client, which then follows the cluster's slot map (over TLS to every node
    with ``rediss+cluster``)."""

    kind = "redis cluster"

    def __init__(self, nodes: List[Tuple[str, int]], password: Optional[str] = None, username: Optional[str] = None,
                 timeout_s: float = 10.0, connect_timeout_s: float = 3.0, prefix: str = "kvcodec:",
                 tls: bool = False, ca_file: Optional[str] = None) -> None:
        super().__init__(username, password, timeout_s, connect_timeout_s, prefix)
        self._set_tls(tls, ca_file)
        if not nodes:
            raise ConfigError("redis cluster store needs at least one HOST:PORT")
        self.nodes = [(h, int(p)) for h, p in nodes]
        auth = f"{username or ''}:***@" if self.password or username else ""
        self.url = f"{'rediss' if self.tls else 'redis'}+cluster://" + auth + ",".join(f"{h}:{p}" for h, p in self.nodes)

    @classmethod
    def from_url(cls, url: str, ca_file: Optional[str] = None) -> "RedisClusterStore":
        tls = urlsplit(url).scheme == "rediss+cluster"
        user, password, hosts, path, query = _split(url, "rediss+cluster" if tls else "redis+cluster")
        if path.strip("/") not in ("", "0"):
            raise ConfigError(f"redis cluster store URL {url!r}: a cluster has only database 0")
        return cls(hosts, password, user, tls=tls, ca_file=ca_file, **_options(url, query))

    def _make_client(self):
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in self.nodes], **self._common_kwargs())
