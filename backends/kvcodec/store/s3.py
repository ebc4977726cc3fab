"""S3 store: ``s3://BUCKET/PREFIX``, one object per chunk at ``PREFIX/<key>.kvc`` (``boto3``).

Works with AWS and with S3-compatible servers (SeaweedFS, Ceph RGW, MinIO). Everything but the
bucket and prefix comes the way boto3 reads it: the endpoint from ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL`` (or the profile), credentials and region from the ``AWS_*`` variables, the
profile or the instance role. Requests:

- ``get``: ``GetObject`` (``NoSuchKey`` -> ``None``); ``get_range``: ``GetObject`` with ``Range``;
- ``exists``: ``HeadObject``; ``delete``: ``DeleteObject``;
- ``put``: a conditional create, ``PutObject`` with ``If-None-Match: *``; when another writer
  stored the key first (412 ``PreconditionFailed``, or 409 while its upload is in flight) it
  returns False and the loser's body is refused: two replicas writing back one prefix never tear
  a chunk. A server that does not implement the condition (501, or 400 naming the header) gets
  ``HeadObject`` then plain ``PutObject`` from then on (a create that two writers racing within one
  upload may both win, each value whole). ``overwrite``: plain ``PutObject``. A single
  ``PutObject`` is atomic on S3: a reader sees no object, the old one or the whole new one.
- ``scan``: ``ListObjectsV2`` under the prefix (size and ``LastModified``).

Last use. S3 keeps only the time an object was written, so this store records use itself: every
``put`` stores the object with the user metadata ``kvcodec-used`` (epoch seconds), and a ``get``
that finds the chunk marks it used again, at most once per ``touch_s`` seconds per key in this
process, by copying the object onto itself with new metadata (``CopyObject``, server side: no bytes
cross the link; it also moves ``LastModified``). The copy runs on a background thread off the read
(at most ``_TOUCH_QUEUE`` waiting; more are dropped); ``close`` waits for those queued. ``used(key)``
(``HeadObject``) reads the mark back, else ``LastModified`` for objects stored before it existed;
``kvcodec.store.capacity.gc`` orders and ages S3 chunks by it. ``touch_s=0`` turns marking off (and
with it gc's ``older_than_s`` on this store). ``clock`` (default ``time.time``) stamps the marks.

One boto3 client per store object (thread-safe, made on first use), with a connection pool of
``pool`` connections, ``connect_timeout_s`` / ``timeout_s`` per attempt and ``attempts`` attempts
in all (the fetch deadline belongs to the caller, so few). Inside a caller's
``store.deadline.call_deadline``, a call started after the deadline raises at once and a body read
ends by the deadline (connect and the wait for the response headers stay bounded by
``connect_timeout_s`` and ``timeout_s``). Transport failures, timeouts, 5xx, a missing bucket and
refused or missing credentials raise ``StoreUnavailable``, saying which.

TLS (an ``https://`` endpoint) verifies the server against the CA bundle ``ca_file`` (else
``KVCODEC_STORE_CA_FILE``), else boto3's own (``AWS_CA_BUNDLE``, the system CAs); a certificate
that does not verify raises ``StoreUnavailable`` saying so.

URL options: ``?timeout_s=10&connect_timeout_s=3&attempts=2&pool=16&addressing=auto|path|virtual&touch_s=0``.
Marking use is off by default (``touch_s=0``): the copy of an object onto itself is not atomic against
a write of the same key on every S3 server (on SeaweedFS a copy queued behind a read put back the
bytes that an overwrite had just replaced, even with ``CopySourceIfMatch``); turn it on
(``touch_s=3600``) where nothing overwrites chunks while they are read (no key rotation re-signing,
no corrupt-chunk replacement) or the server's copy is atomic.
``boto3`` is imported only when an ``s3://`` store is opened.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Optional
from urllib.parse import parse_qsl, urlsplit

from ..errors import ConfigError, StoreUnavailable
from . import CA_FILE_ENV, Entry, KVStore, check_key, check_range
from . import deadline as call_deadline

log = logging.getLogger("kvcodec.store.s3")

SUFFIX = ".kvc"
USED = "kvcodec-used"  # user metadata: epoch seconds of the chunk's last use (or its write)
TOUCH_S = 0.0  # off unless the URL says (?touch_s=3600): see the module's docstring on overwrites
_TOUCH_QUEUE = 256  # marks waiting for the background thread; more are dropped
_TOUCH_KEYS = 1 << 16  # keys whose last mark this process remembers
_PIECE = 1 << 16  # bytes read at a time inside a caller's deadline
_NUMBERS = {"timeout_s": float, "connect_timeout_s": float, "attempts": int, "pool": int, "touch_s": float}
_ADDRESSING = ("auto", "path", "virtual")
_MISS = ("NoSuchKey", "404", "NotFound")
_TAKEN = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")
_AUTH = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "InvalidToken", "ExpiredToken",
         "AuthorizationHeaderMalformed", "InvalidSecurity", "401")


class S3Store(KVStore):
    def __init__(self, bucket: str, prefix: str = "", timeout_s: float = 10.0, connect_timeout_s: float = 3.0,
                 attempts: int = 2, pool: int = 16, addressing: str = "auto", ca_file: Optional[str] = None,
                 touch_s: float = TOUCH_S, clock: Callable[[], float] = time.time) -> None:
        if not isinstance(bucket, str) or len(bucket) < 3:
            raise ConfigError(f"S3 store bucket must have 3 or more characters, got {bucket!r}")
        for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"S3 store {name} must be > 0, got {value!r}")
        for name, value in (("attempts", attempts), ("pool", pool)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"S3 store {name} must be an integer >= 1, got {value!r}")
        if not isinstance(touch_s, (int, float)) or not touch_s >= 0:
            raise ConfigError(f"S3 store touch_s must be >= 0 (0: never mark use), got {touch_s!r}")
        if addressing not in _ADDRESSING:
            raise ConfigError(f"S3 store addressing must be one of {', '.join(_ADDRESSING)}, got {addressing!r}")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.timeout_s, self.connect_timeout_s = float(timeout_s), float(connect_timeout_s)
        self.attempts, self.pool, self.addressing = attempts, pool, addressing
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.ca_file = ca_file if ca_file is not None else os.environ.get(CA_FILE_ENV, "")
        if self.ca_file and not os.path.isfile(self.ca_file):
            raise ConfigError(f"S3 store: the CA bundle {self.ca_file!r} ({CA_FILE_ENV}) is not a file")
        self.conditional = True  # False once the server turned If-None-Match down
        self.touch_s, self.clock = float(touch_s), clock
        self._client = None
        self._lock = threading.Lock()
        self._toucher: Optional[ThreadPoolExecutor] = None
        self._touched: "OrderedDict[str, float]" = OrderedDict()  # key -> clock() of this process's last mark
        self._touches_waiting = 0

    @classmethod
    def from_url(cls, url: str, ca_file: Optional[str] = None) -> "S3Store":
        parts = urlsplit(url)
        if parts.scheme != "s3":
            raise ConfigError(f"S3 store URL {url!r}: scheme must be s3")
        if "@" in parts.netloc:
            raise ConfigError("S3 store URL must not carry credentials; use the AWS_* variables or a profile")
        options = {}
        for name, value in parse_qsl(parts.query, keep_blank_values=True):
            if name == "addressing":
                options[name] = value
            elif name in _NUMBERS:
                try:
                    options[name] = _NUMBERS[name](value)
                except ValueError:
                    raise ConfigError(f"S3 store URL option {name}={value!r} is not a number") from None
            else:
                known = ", ".join([*_NUMBERS, "addressing"])
                raise ConfigError(f"S3 store URL option {name!r} is unknown (known: {known})")
        if not parts.netloc:
            raise ConfigError(f"S3 store URL {url!r} names no bucket (use s3://BUCKET/PREFIX)")
        return cls(parts.netloc, parts.path, ca_file=ca_file, **options)

    # -- the client -----------------------------------------------------------------------------

    def _s3(self):
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                config = Config(connect_timeout=self.connect_timeout_s, read_timeout=self.timeout_s,
                                retries={"max_attempts": self.attempts, "mode": "standard"},
                                max_pool_connections=self.pool, s3={"addressing_style": self.addressing})
                verify = self.ca_file or None  # None: boto3's default (AWS_CA_BUNDLE, the system CAs)
                self._client = boto3.session.Session().client("s3", config=config, verify=verify)
            return self._client

    @property
    def endpoint(self) -> str:
        try:
            return self._s3().meta.endpoint_url
        except Exception:  # noqa: BLE001 - only for messages
            return "?"

    def _name(self, key: str) -> str:
        k = check_key(key) + SUFFIX
        return f"{self.prefix}/{k}" if self.prefix else k

    def _fail(self, what: str, key: str, exc: BaseException) -> StoreUnavailable:
        import botocore.exceptions as bx

        where = f"S3 store {self.url} ({self.endpoint})"
        if isinstance(exc, bx.NoCredentialsError):
            return StoreUnavailable(f"{where} refused {what} {key}: no credentials found "
                                    "(set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)")
        if isinstance(exc, bx.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _AUTH or status in (401, 403):
                return StoreUnavailable(f"{where} refused the credentials for {what} {key} "
                                        f"(HTTP {status} {code}: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")
            if code == "NoSuchBucket":
                return StoreUnavailable(f"{where}: bucket {self.bucket!r} does not exist")
            return StoreUnavailable(f"{where}: {what} {key} answered HTTP {status} {code}")
        if isinstance(exc, bx.SSLError) or "CERTIFICATE_VERIFY_FAILED" in str(exc):
            return StoreUnavailable(f"{where}: TLS certificate not accepted against "
                                    f"{self.ca_file or 'the default CAs'} ({what} {key}: {exc})")
        if isinstance(exc, (bx.ConnectTimeoutError, bx.ReadTimeoutError)):
            return StoreUnavailable(f"{where}: {what} {key} timed out ({exc})")
        return StoreUnavailable(f"{where} unreachable ({what} {key}): {type(exc).__name__}: {exc}")

    def _call(self, what: str, key: str, fn):
        import botocore.exceptions as bx

        left = call_deadline.left()
        if left is not None and left <= 0:
            raise StoreUnavailable(f"S3 store {self.url}: {what} {key} timed out (its deadline had passed)")
        try:
            return fn(self._s3())
        except bx.ClientError as exc:
            raise exc  # the caller maps the codes it expects, then calls _fail
        except (bx.BotoCoreError, OSError) as exc:
            raise self._fail(what, key, exc) from None

    def _body(self, response: dict, what: str, key: str) -> bytes:
        """The object's bytes; inside a caller's ``call_deadline`` the read ends by that deadline."""
        body = response["Body"]
        if call_deadline.left() is None:
            return body.read()
        pieces, got, size = [], 0, int(response.get("ContentLength", -1))
        try:
            while got != size:
                left = call_deadline.left()
                if left <= 0:
                    raise StoreUnavailable(f"S3 store {self.url}: {what} {key} timed out (cut at its deadline)")
                body.set_socket_timeout(min(self.timeout_s, left))
                piece = body.read(_PIECE)
                if not piece:
                    break
                pieces.append(piece)
                got += len(piece)
            return b"".join(pieces)
        finally:
            if call_deadline.left() is not None and call_deadline.left() <= 0:
                body.close()  # a cut read leaves its connection unusable

    @staticmethod
    def _code(exc) -> str:
        return str(exc.response.get("Error", {}).get("Code", ""))

    # -- the store contract ---------------------------------------------------------------------

    def get(self, key: str) -> Optional[bytes]:
        import botocore.exceptions as bx

        name = self._name(key)
        seen: dict = {}

        def read(c):
            response = c.get_object(Bucket=self.bucket, Key=name)
            seen["etag"] = response.get("ETag")
            return self._body(response, "GET", key)

        try:
            data = self._call("GET", key, read)
        except bx.ClientError as exc:
            if self._code(exc) in _MISS:
                return None
            raise self._fail("GET", key, exc) from None
        self.touch(key, seen.get("etag"))
        return data

    def get_range(self, key: str, start: int, end: int) -> Optional[bytes]:
        import botocore.exceptions as bx

        check_range(start, end)
        if start == end:
            return b"" if self.exists(key) else None
        name = self._name(key)
        try:
            return self._call("GET range", key, lambda c: self._body(c.get_object(
                Bucket=self.bucket, Key=name, Range=f"bytes={start}-{end - 1}"), "GET range", key))
        except bx.ClientError as exc:
            code = self._code(exc)
            if code in _MISS:
                return None
            if code in ("InvalidRange", "416"):  # starts past the end of an existing object
                return b"" if self.exists(key) else None
            raise self._fail("GET range", key, exc) from None

    def exists(self, key: str) -> bool:
        import botocore.exceptions as bx

        name = self._name(key)
        try:
            self._call("HEAD", key, lambda c: c.head_object(Bucket=self.bucket, Key=name))
            return True
        except bx.ClientError as exc:
            if self._code(exc) in _MISS:
                return False
            raise self._fail("HEAD", key, exc) from None

    def put(self, key: str, data: bytes, overwrite: bool = False) -> bool:
        import botocore.exceptions as bx

        name, body = self._name(key), bytes(data)
        if self.conditional and not overwrite:
            try:
                self._call("PUT", key, lambda c: c.put_object(Bucket=self.bucket, Key=name, Body=body,
                                                              Metadata=self._stamp(), IfNoneMatch="*"))
                return True
            except bx.ClientError as exc:
                code = self._code(exc)
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code in _TAKEN:
                    return False  # another writer stored this chunk first: its copy stays
                message = str(exc.response.get("Error", {}).get("Message", ""))
                if not (code == "NotImplemented" or status == 501 or "If-None-Match" in message):
                    raise self._fail("PUT", key, exc) from None
                self.conditional = False  # this server cannot: look, then put, from now on
        if not overwrite and self.exists(key):
            return False
        try:
            self._call("PUT", key, lambda c: c.put_object(Bucket=self.bucket, Key=name, Body=body,
                                                          Metadata=self._stamp()))
        except bx.ClientError as exc:
            raise self._fail("PUT", key, exc) from None
        return True

    def delete(self, key: str) -> None:
        import botocore.exceptions as bx

        name = self._name(key)
        try:
            self._call("DELETE", key, lambda c: c.delete_object(Bucket=self.bucket, Key=name))
        except bx.ClientError as exc:
            if self._code(exc) not in _MISS:
                raise self._fail("DELETE", key, exc) from None

    def scan(self) -> Iterator[Entry]:
        import botocore.exceptions as bx

        lead = f"{self.prefix}/" if self.prefix else ""
        try:
            pages = self._call("LIST", lead or "/", lambda c: c.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=lead))
            for page in pages:
                for obj in page.get("Contents", ()):
                    name = obj["Key"][len(lead):]
                    if name.endswith(SUFFIX):
                        yield Entry(name[:-len(SUFFIX)], int(obj["Size"]), obj["LastModified"].timestamp())
        except bx.ClientError as exc:
            raise self._fail("LIST", lead or "/", exc) from None
        except (bx.BotoCoreError, OSError) as exc:
            raise self._fail("LIST", lead or "/", exc) from None

    # -- last use --------------------------------------------------------------------------------

    def _stamp(self) -> dict:
        return {USED: f"{self.clock():.3f}"}

    def touch(self, key: str, etag: Optional[str] = None) -> None:
        """Mark the chunk used now, unless this process did within ``touch_s``: queued for the
        background thread (never blocks the caller; dropped when too many wait)."""
        if self.touch_s <= 0:
            return
        now = self.clock()
        with self._lock:
            last = self._touched.get(key)
            if last is not None and now - last < self.touch_s:
                return
            if self._touches_waiting >= _TOUCH_QUEUE:
                return
            self._touched[key] = now
            self._touched.move_to_end(key)
            while len(self._touched) > _TOUCH_KEYS:
                self._touched.popitem(last=False)
            if self._toucher is None:
                self._toucher = ThreadPoolExecutor(1, thread_name_prefix="kv-s3-touch")
            self._touches_waiting += 1
            self._toucher.submit(self._mark, key, now, etag)

    def _mark(self, key: str, when: float, etag: Optional[str] = None) -> None:
        """``CopyObject`` of the object onto itself with ``kvcodec-used`` = ``when``, only if it is
        still the object that was read (``CopySourceIfMatch``: the ETag of the read, else of a HEAD
        now): a copy queued behind a read must never put back bytes that a later write replaced (an
        overwrite re-signing or replacing a corrupt chunk); a chunk deleted or replaced meanwhile
        is left as it is; a failure is logged (a lost mark makes gc see an older use)."""
        import botocore.exceptions as bx

        name = self._name(key)
        try:
            if etag is None:
                etag = self._call("HEAD", key, lambda c: c.head_object(Bucket=self.bucket, Key=name)).get("ETag")
            self._call("COPY", key, lambda c: c.copy_object(
                Bucket=self.bucket, Key=name, CopySource={"Bucket": self.bucket, "Key": name},
                CopySourceIfMatch=etag, Metadata={USED: f"{when:.3f}"}, MetadataDirective="REPLACE"))
        except bx.ClientError as exc:
            if self._code(exc) in ("PreconditionFailed", "412"):
                log.debug("S3 %s changed since it was read: not marked", key)
            elif self._code(exc) not in _MISS:
                log.warning("%s", self._fail("COPY (mark used)", key, exc))
        except StoreUnavailable as exc:
            log.warning("%s", exc)
        finally:
            with self._lock:
                self._touches_waiting = max(0, self._touches_waiting - 1)

    def used(self, key: str) -> Optional[float]:
        """When the chunk was last used as far as marks tell (``kvcodec-used``), else its
        ``LastModified``; None when it is not stored."""
        import botocore.exceptions as bx

        name = self._name(key)
        try:
            head = self._call("HEAD", key, lambda c: c.head_object(Bucket=self.bucket, Key=name))
        except bx.ClientError as exc:
            if self._code(exc) in _MISS:
                return None
            raise self._fail("HEAD", key, exc) from None
        try:
            return float(head.get("Metadata", {})[USED])
        except (KeyError, TypeError, ValueError):
            return head["LastModified"].timestamp()

    def _stop_touches(self, wait: bool) -> None:
        with self._lock:
            toucher, self._toucher = self._toucher, None
            if not wait:
                self._touches_waiting = 0  # those queued are cancelled
        if toucher is not None:
            toucher.shutdown(wait=wait, cancel_futures=not wait)

    def drop_connections(self) -> None:
        """Calls from now on use a new client and pool (the fetcher calls this when the store's
        circuit breaker opens: a connection of a sick spell may stay sick); the old client is
        closed, so its calls still running fail at once as unavailable. Marks waiting are dropped."""
        self._stop_touches(wait=False)
        self._drop_client()

    def close(self) -> None:
        """Waits for the marks already queued, then closes the client."""
        self._stop_touches(wait=True)
        self._drop_client()

    def _drop_client(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
