"""HTTP store: ``http[s]://HOST:PORT/PREFIX``, one object per chunk at ``/PREFIX/<key>.kvc``.

The object layout is the filesystem store's, so a ``file://`` folder served by any web server
(``kvcodec_tools.services.nginx`` runs one with WebDAV PUT/DELETE) is a store. Requests:

- ``get``: ``GET`` (200 -> bytes, 404 -> ``None``); ``get_range``: ``GET`` with ``Range`` (206);
- ``exists``: ``HEAD``; ``put``: a create, exactly one writer wins: first a *claim*, WebDAV
  ``MKCOL`` of the folder ``<key>.claim/`` (``mkdir(2)`` on the server: atomic, so of writers racing
  for one key exactly one gets 201; the others get 405 and return False), then the winner's ``PUT``
  with ``If-None-Match: *`` (412 -> False: stored before claims were taken). A write that fails
  drops its claim; a claim whose chunk never came (its writer died in between) is taken over once
  it is ``CLAIM_STALE_S`` old. A server
  without ``MKCOL`` (501, 403) gets the ``PUT`` alone: nginx's WebDAV module ignores the header,
  so ``kvcodec_tools.services.nginx`` answers 412 itself over an existing file, which is checked,
  then written (two writers within one upload may both win, each value whole). ``overwrite``
  sends a plain ``PUT``. The server writes a temporary file and renames it, so readers see the old
  value or the whole new one. ``delete``: ``DELETE`` of the chunk, then of its claim (404 is fine).

Every request carries ``Authorization: Bearer <token>`` when a token is set: the ``token=``
argument, else the environment variable ``KVCODEC_STORE_TOKEN``. A token in the URL is refused
(URLs end up in logs). Writes without the right token come back 401/403 and raise
``StoreUnavailable`` saying that the store refused the write.

Connections: one small keep-alive pool per store object, one connection per thread (the fetcher
and ingest run a few threads), each reconnected once if the server closed it while idle.
Transport failures, timeouts and 5xx raise ``StoreUnavailable``.

Timeouts: ``connect_timeout_s`` to connect, ``timeout_s`` for each read or write; and, inside a
caller's ``kvcodec.store.deadline.call_deadline``, the whole call (a body that trickles in too)
ends by that deadline: the store's reaper thread shuts the socket of a call still running then, the
call raises ``StoreUnavailable`` (timed out) and its connection is closed, never reused.

TLS: ``https://`` verifies the server's certificate and host name against the system CAs, or
against the CA bundle ``ca_file`` (else ``KVCODEC_STORE_CA_FILE``); a certificate that does not
verify raises ``StoreUnavailable`` saying so. ``scan`` (for ``store.capacity``) walks the folders
with WebDAV ``PROPFIND`` (``Depth: 1``), or where the server does not take it (nginx without the
dav_ext module), through nginx's JSON folder listing (``autoindex on; autoindex_format json;``,
as ``kvcodec_tools.services.nginx`` serves it): name, size and modification time per object.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import ssl
import threading
import time
from typing import Dict, Iterator, List, Optional, Tuple
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from ..errors import ConfigError, StoreUnavailable
from . import CA_FILE_ENV, Entry, KVStore, check_key, check_range
from . import deadline as call_deadline

TOKEN_ENV = "KVCODEC_STORE_TOKEN"
SUFFIX = ".kvc"
CLAIM = ".claim/"  # a key's claim folder: keys are [0-9a-z/_-], so no key's path ends in it
CLAIM_STALE_S = 120.0  # a claim older than this with no chunk: its writer died; taken over
_OPTIONS = ("timeout_s", "connect_timeout_s")
_DAV = "{DAV:}"
_DEPTH_1 = {"Depth": "1"}
# A reused keep-alive connection the server closed while idle fails in one of these ways.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, http.client.BadStatusLine)


class _Connection(http.client.HTTPConnection):
    """Connects within ``connect_timeout``, then waits at most ``timeout`` on each read/write."""

    def __init__(self, host: str, port: int, connect_timeout: float, timeout: float) -> None:
        super().__init__(host, port, timeout=connect_timeout)
        self._io_timeout = timeout

    def connect(self) -> None:
        super().connect()
        self.sock.settimeout(self._io_timeout)


class _TlsConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, connect_timeout: float, timeout: float, context: ssl.SSLContext) -> None:
        super().__init__(host, port, timeout=connect_timeout, context=context)
        self._io_timeout = timeout

    def connect(self) -> None:
        super().connect()
        self.sock.settimeout(self._io_timeout)


def tls_context(ca_file: Optional[str], what: str) -> ssl.SSLContext:
    """A client context verifying against ``ca_file`` (a PEM bundle), or the system CAs if empty."""
    try:
        return ssl.create_default_context(cafile=ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{what}: cannot read the CA bundle {ca_file!r} ({CA_FILE_ENV}): {exc}") from None


class HttpStore(KVStore):
    def __init__(self, base_url: str, token: Optional[str] = None, timeout_s: float = 30.0,
                 connect_timeout_s: float = 3.0, ca_file: Optional[str] = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https"):
            raise ConfigError(f"HTTP store URL {base_url!r}: scheme must be http or https")
        if parts.username is not None or parts.password is not None:
            raise ConfigError(f"HTTP store URL must not carry credentials; put the token in {TOKEN_ENV}")
        if parts.query or parts.fragment:
            raise ConfigError(f"HTTP store URL {base_url!r}: options go to the constructor (or from_url)")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ConfigError(f"HTTP store URL {base_url!r}: bad port") from None
        if not parts.hostname:
            raise ConfigError(f"HTTP store URL {base_url!r} names no host")
        for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"HTTP store {name} must be > 0, got {value!r}")
        self.host, self.port = parts.hostname, port
        self.prefix = "/" + parts.path.strip("/") if parts.path.strip("/") else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"{parts.scheme}://{host}:{self.port}{self.prefix}"
        self.ca_file = ca_file if ca_file is not None else os.environ.get(CA_FILE_ENV, "")
        self._tls = tls_context(self.ca_file, f"HTTP store {self.url}") if parts.scheme == "https" else None
        self.timeout_s, self.connect_timeout_s = float(timeout_s), float(connect_timeout_s)
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self._headers: Dict[str, str] = {"Authorization": f"Bearer {token}"} if token else {}
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: List[_Connection] = []
        self._closed = False
        self._reaper = call_deadline.Reaper("kv-http-reaper")
        self._generation = 0  # connections made before the last drop_connections() are not reused

    @classmethod
    def from_url(cls, url: str, ca_file: Optional[str] = None) -> "HttpStore":
        """``http[s]://HOST:PORT/PREFIX[?timeout_s=30&connect_timeout_s=3]``; token and CA bundle
        from the environment."""
        parts = urlsplit(url)
        options = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name not in _OPTIONS:
                raise ConfigError(f"HTTP store URL option {name!r} is unknown (known: {', '.join(_OPTIONS)})")
            try:
                options[name] = float(value)
            except ValueError:
                raise ConfigError(f"HTTP store URL option {name}={value!r} is not a number") from None
        return cls(parts._replace(query="").geturl(), ca_file=ca_file, **options)

    # -- the store contract ---------------------------------------------------------------------

    def get(self, key: str) -> Optional[bytes]:
        status, _, body = self._request("GET", key)
        if status == 404:
            return None
        self._expect(status, (200,), "GET", key)
        return body

    def get_range(self, key: str, start: int, end: int) -> Optional[bytes]:
        check_range(start, end)
        if start == end:
            return b"" if self.exists(key) else None
        status, _, body = self._request("GET", key, headers={"Range": f"bytes={start}-{end - 1}"})
        if status == 404:
            return None
        if status == 416:  # starts past the end of an existing value
            return b""
        self._expect(status, (200, 206), "GET range", key)
        return body if status == 206 else body[start:end]

    def exists(self, key: str) -> bool:
        status, _, _ = self._request("HEAD", key)
        if status == 404:
            return False
        self._expect(status, (200,), "HEAD", key)
        return True

    def put(self, key: str, data: bytes, overwrite: bool = False) -> bool:
        claimed = None if overwrite else self.claim(key)
        if claimed is False:
            return False  # another writer claimed this chunk first: it stores it
        headers = None if overwrite else {"If-None-Match": "*"}
        try:
            status, _, _ = self._request("PUT", key, body=bytes(data), headers=headers)
            if status == 412 and not overwrite:
                return False  # another writer stored this chunk first
            self._expect(status, (200, 201, 204), "PUT", key)
            return True
        except BaseException:
            if claimed:  # the write failed (a full disk, the store gone): the next writer may try
                with contextlib.suppress(Exception):
                    self._request("DELETE", key, path=self._claim_path(key))
            raise

    def claim(self, key: str) -> Optional[bool]:
        """The first half of a create: True when this writer now holds ``key``'s claim, False when
        another does (or the chunk is stored), None when the server takes no ``MKCOL`` (then only the
        conditional ``PUT`` guards the key)."""
        path = self._claim_path(key)
        for attempt in range(3):
            status, _, _ = self._request("MKCOL", key, path=path)
            if status == 201:
                return True
            if status == 409 and attempt == 0:  # a parent folder is missing: make them, then again
                self._make_parents(key)
                continue
            if status == 405:  # the claim exists, or this server takes no MKCOL
                if self.exists(key):
                    return False
                there, _, _ = self._request("HEAD", key, path=path)
                if there == 404:
                    return None  # no claim there: MKCOL is not allowed here
                age = self._claim_age(key)
                if age is None or age < CLAIM_STALE_S or attempt == 2:
                    return False  # being written now (or just deleted): the other writer stores it
                self._request("DELETE", key, path=path)  # its writer died before its PUT: take it over
                continue
            if status in (403, 501):
                return None
            self._expect(status, (201,), "MKCOL", key)
        return False

    def delete(self, key: str) -> None:
        status, _, _ = self._request("DELETE", key)
        if status != 404:
            self._expect(status, (200, 202, 204), "DELETE", key)
        status, _, _ = self._request("DELETE", key, path=self._claim_path(key))  # the next writer may claim it
        if status not in (404, 405, 409, 501):
            self._expect(status, (200, 202, 204), "DELETE claim", key)

    def _claim_path(self, key: str) -> str:
        return quote(f"{self.prefix}/{check_key(key)}{CLAIM}")

    def _make_parents(self, key: str) -> None:
        parts = check_key(key).split("/")[:-1]
        for i in range(1, len(parts) + 1):
            self._request("MKCOL", key, path=quote(f"{self.prefix}/{'/'.join(parts[:i])}/"))  # 405: there already

    def _claim_age(self, key: str) -> Optional[float]:
        """Seconds since ``key``'s claim was made, from its folder's listing (PROPFIND or nginx's
        JSON); None when it cannot be told."""
        from email.utils import parsedate_to_datetime

        folder, _, leaf = check_key(key).rpartition("/")
        name = leaf + CLAIM.rstrip("/")
        status, _, body = self._request("GET", key, path=quote(f"{self.prefix}/{folder + '/' if folder else ''}"))
        if status != 200:
            return None
        try:
            for item in json.loads(body):
                if item.get("name") == name and item.get("mtime"):
                    return time.time() - parsedate_to_datetime(item["mtime"]).timestamp()
        except (ValueError, TypeError, AttributeError):
            return None
        return None

    def scan(self) -> Iterator[Entry]:
        """WebDAV ``PROPFIND`` (``Depth: 1``, folder by folder); where the server does not take it
        (nginx answers 405), nginx's JSON folder listing (``autoindex_format json``)."""
        status, _, body = self._request("PROPFIND", "/", path=quote(f"{self.prefix}/"), headers=_DEPTH_1)
        if status == 404:
            return  # nothing stored yet
        if status == 207:
            yield from self._scan_dav(body)
        elif status in (400, 401, 403, 405, 501):  # no PROPFIND here (or not for us): the JSON listing
            yield from self._scan_json()
        else:
            self._expect(status, (207,), "PROPFIND", "/")

    def _scan_dav(self, first: bytes) -> Iterator[Entry]:
        import xml.etree.ElementTree as ET
        from email.utils import parsedate_to_datetime

        root = f"{self.prefix}/"
        todo: List[Tuple[str, Optional[bytes]]] = [("", first)]
        while todo:
            folder, body = todo.pop()
            if body is None:
                status, _, body = self._request("PROPFIND", folder, path=quote(root + folder), headers=_DEPTH_1)
                if status == 404:
                    continue  # removed while we walked
                self._expect(status, (207,), "PROPFIND", folder)
            try:
                responses = ET.fromstring(body).iter(f"{_DAV}response")
                for r in responses:
                    href = unquote(urlsplit(r.findtext(f"{_DAV}href") or "").path)
                    if not href.startswith(root):
                        continue
                    name = href[len(root):]
                    if name.rstrip("/") == folder.rstrip("/"):
                        continue  # the folder itself
                    prop = r.find(f"{_DAV}propstat/{_DAV}prop")
                    if prop is None:
                        continue
                    if prop.find(f"{_DAV}resourcetype/{_DAV}collection") is not None:
                        if not name.rstrip("/").endswith(CLAIM.rstrip("/")):  # a claim holds nothing
                            todo.append((name.rstrip("/") + "/", None))
                    elif name.endswith(SUFFIX):
                        modified = prop.findtext(f"{_DAV}getlastmodified")
                        when = parsedate_to_datetime(modified).timestamp() if modified else 0.0
                        yield Entry(name[:-len(SUFFIX)], int(prop.findtext(f"{_DAV}getcontentlength") or 0), when)
            except (ET.ParseError, ValueError, TypeError) as exc:
                raise StoreUnavailable(f"HTTP store {self.url}: a PROPFIND answer for /{folder} "
                                       f"could not be read ({exc})") from None

    def _scan_json(self) -> Iterator[Entry]:
        from email.utils import parsedate_to_datetime

        todo = [""]
        while todo:
            folder = todo.pop()
            status, _, body = self._request("GET", folder or "/", path=quote(f"{self.prefix}/{folder}"))
            if status == 404 and not folder:
                return  # nothing stored yet
            self._expect(status, (200,), "LIST", folder or "/")
            try:
                items = json.loads(body)
            except ValueError:
                raise StoreUnavailable(f"HTTP store {self.url}: the listing of /{folder} is neither WebDAV nor JSON "
                                       "(nginx needs autoindex on; autoindex_format json;)") from None
            for item in items:
                name = str(item.get("name", ""))
                if item.get("type") == "directory":
                    if not name.endswith(CLAIM.rstrip("/")):  # a claim holds nothing
                        todo.append(f"{folder}{name}/")
                elif name.endswith(SUFFIX):
                    when = parsedate_to_datetime(item["mtime"]).timestamp() if item.get("mtime") else 0.0
                    yield Entry(f"{folder}{name[:-len(SUFFIX)]}", int(item.get("size", 0)), when)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
        self._reaper.stop()

    # -- transport ------------------------------------------------------------------------------

    def _connection(self) -> _Connection:
        if self._closed:
            raise StoreUnavailable(f"HTTP store {self.url} is closed")
        conn = getattr(self._local, "conn", None)
        if conn is not None and getattr(conn, "generation", 0) != self._generation:
            self._drop(conn)  # made before drop_connections(): not trusted
            conn = None
        if conn is None:
            conn = (_Connection(self.host, self.port, self.connect_timeout_s, self.timeout_s) if self._tls is None
                    else _TlsConnection(self.host, self.port, self.connect_timeout_s, self.timeout_s, self._tls))
            conn.generation = self._generation
            with self._lock:
                self._all.append(conn)
            self._local.conn = conn
        return conn

    def drop_connections(self) -> None:
        """Connections made until now are closed at their next use, never reused (the fetcher calls
        this when the store's circuit breaker opens: a connection of a sick spell may stay sick)."""
        with self._lock:
            self._generation += 1

    def _drop(self, conn: _Connection) -> None:
        conn.close()
        self._local.conn = None
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)

    def _request(self, method: str, key: str, body: Optional[bytes] = None,
                 headers: Optional[Dict[str, str]] = None, path: Optional[str] = None) -> Tuple[int, Dict[str, str], bytes]:
        path = path or f"{self.prefix}/{check_key(key)}{SUFFIX}"
        all_headers = dict(self._headers, **(headers or {}))
        if body is not None:
            all_headers["Content-Length"] = str(len(body))
        for attempt in (0, 1):
            conn = self._connection()
            reused = conn.sock is not None
            watch = self._watch(conn, method, key)
            try:
                conn.request(method, path, body=body, headers=all_headers)
                resp = conn.getresponse()
                data = resp.read()
            except _STALE as exc:
                self._drop(conn)
                self._cut(watch, method, key)
                if reused and attempt == 0:
                    continue  # the server closed an idle keep-alive connection: once more, fresh
                raise StoreUnavailable(f"HTTP store {self.url}: {method} {key}: connection lost ({exc!r})") from None
            except ssl.SSLCertVerificationError as exc:
                self._drop(conn)
                ca = self.ca_file or "the system CAs"
                raise StoreUnavailable(f"HTTP store {self.url}: TLS certificate not accepted against {ca} "
                                       f"({exc.verify_message or exc})") from None
            except ssl.SSLError as exc:
                self._drop(conn)
                raise StoreUnavailable(f"HTTP store {self.url}: TLS failed ({exc})") from None
            except socket.timeout:
                self._drop(conn)
                raise StoreUnavailable(f"HTTP store {self.url}: {method} {key} timed out") from None
            except (OSError, http.client.HTTPException) as exc:
                self._drop(conn)
                self._cut(watch, method, key)
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
                raise StoreUnavailable(f"HTTP store {self.url} unreachable: {reason}") from None
            finally:
                if watch is not None:
                    self._reaper.done(watch)
            if watch is not None and watch.fired:  # cut as it ended: the socket is shut
                self._drop(conn)
                self._cut(watch, method, key)
            if resp.will_close:
                self._drop(conn)
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
        raise AssertionError("unreachable")

    def _watch(self, conn: _Connection, method: str, key: str) -> Optional[call_deadline.Watch]:
        """Hold this call to the caller's deadline, if it set one (``store.deadline``)."""
        left = call_deadline.left()
        if left is not None and left <= 0:
            raise StoreUnavailable(f"HTTP store {self.url}: {method} {key} timed out (its deadline had passed)")
        conn.timeout = self.connect_timeout_s if left is None else min(self.connect_timeout_s, left)
        return None if left is None else self._reaper.watch(conn, time.monotonic() + left)

    def _cut(self, watch: Optional[call_deadline.Watch], method: str, key: str) -> None:
        if watch is not None and watch.fired:
            raise StoreUnavailable(f"HTTP store {self.url}: {method} {key} timed out (cut at its deadline)") from None

    def _expect(self, status: int, ok: Tuple[int, ...], what: str, key: str) -> None:
        if status in ok:
            return
        if status in (401, 403):
            action = "read" if what.startswith(("GET", "HEAD")) else "write"
            how = "the token was not accepted" if self._headers else f"no token is set ({TOKEN_ENV})"
            raise StoreUnavailable(f"HTTP store {self.url} refused the {action} of {key} "
                                   f"(HTTP {status}, credentials: {how})")
        if status == 507:
            raise StoreUnavailable(f"HTTP store {self.url} is full (HTTP 507 Insufficient Storage): {what} {key}")
        raise StoreUnavailable(f"HTTP store {self.url}: {what} {key} answered HTTP {status}")
