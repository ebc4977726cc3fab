"""A local tier in front of the remote store: chunks read once are read again from this machine.

``TieredStore(local, remote, max_bytes)`` is a ``KVStore`` whose source of truth is ``remote`` (its
``url`` is the remote's: keys, breaker and link costs stay the remote's) and whose ``local`` store
(a folder on this machine: ``file:///dev/shm/kvcodec`` keeps it in RAM, a local disk outlives a
reboot) answers first:

- ``get``: the local copy if there is one (its use time refreshed, for eviction; an S3 remote
  is marked used too, for its gc), else the
  remote's, which is then kept locally; ``get_tiered`` also says which tier answered
  (``"local"`` / ``"remote"``), so the fetcher prices the two links apart; ``get_local``: the
  local copy alone (read while the remote store's breaker keeps it out);
- ``exists``: local, else remote (a chunk held locally costs no remote look-up); ``holds_locally``:
  the local store alone;
- ``put``: the remote first (its answer is returned: a create there is the one that counts), then
  the local copy, replacing what is there (written-back and re-signed bytes are the current ones);
- ``delete``: both. ``scan``: the remote's (capacity tooling acts on the remote store).

The local tier is a cache: a local failure (full disk, a vanished file) never fails a call, it only
loses the copy. It holds at most ``max_bytes``: past it, ``kvcodec.store.capacity.gc`` cuts the
least recently used chains from their tail (in the background, one run at a time) down to
``GC_TARGET`` of it. Chunks are verified after they are read, whichever tier they came from, so a
local copy that is damaged or signed with a dropped key is refused like a remote one.

``with_local_tier(remote, local_url, max_bytes)`` wraps ``remote`` (or returns it: no local URL);
``open_for_settings(settings)``: the store a serving process of ``settings`` reads and writes
(``store`` behind ``local_store``, if set).
"""
from __future__ import annotations

import logging
import threading
from typing import Iterator, Optional, Tuple

from ..errors import ConfigError, KVCodecError
from . import Entry, KVStore

log = logging.getLogger("kvcodec.store.tiered")

GC_TARGET = 0.9  # a gc run brings the local tier down to this share of its limit

LOCAL, REMOTE = "local", "remote"


class TieredStore(KVStore):
    def __init__(self, local: KVStore, remote: KVStore, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ConfigError(f"a local tier needs a size > 0, got {max_bytes}")
        self.local, self.remote, self.max_bytes = local, remote, int(max_bytes)
        self.url = remote.url
        self.local_url = local.url
        self._lock = threading.Lock()
        self._held: Optional[int] = None  # bytes in the local tier (scanned once, then counted)
        self._gc: Optional[threading.Thread] = None
        self._kept_since = 0  # bytes kept since the running gc scanned
        self._collecting = False  # a gc thread is running and has not yet said it is done
        self.counts = {"local_hits": 0, "remote_reads": 0, "kept": 0, "evicted": 0, "local_errors": 0}

    # -- reads -------------------------------------------------------------------------------
    def get_tiered(self, key: str) -> Tuple[Optional[bytes], str]:
        data = self.get_local(key)
        if data:
            self._mark_remote(key)
            return data, LOCAL
        data = self.remote.get(key)
        if data:
            self._count("remote_reads")
            self._keep(key, data)
        return data, REMOTE

    def get(self, key: str) -> Optional[bytes]:
        return self.get_tiered(key)[0]

    def get_local(self, key: str) -> Optional[bytes]:
        """The local copy, or None (the remote store is not asked: it is kept out)."""
        data = self._local(self.local.get, key)
        if data:
            self._count("local_hits")
            self._local(getattr(self.local, "touch", lambda k: None), key)
        return data or None

    def get_range(self, key: str, start: int, end: int) -> Optional[bytes]:
        data = self._local(self.local.get_range, key, start, end)
        return data if data is not None else self.remote.get_range(key, start, end)

    def exists(self, key: str) -> bool:
        return self.holds_locally(key) or self.remote.exists(key)

    def holds_locally(self, key: str) -> bool:
        return bool(self._local(self.local.exists, key))

    # -- writes ------------------------------------------------------------------------------
    def put(self, key: str, data: bytes, overwrite: bool = False) -> bool:
        stored = self.remote.put(key, data, overwrite=overwrite)
        self._keep(key, data)
        return stored

    def delete(self, key: str) -> None:
        self._local(self.local.delete, key)
        self.remote.delete(key)

    def scan(self) -> Iterator[Entry]:
        return self.remote.scan()

    def drop_connections(self) -> None:
        self.remote.drop_connections()

    def close(self) -> None:
        gc = self._gc
        if gc is not None:
            gc.join(timeout=5)
        self.local.close()
        self.remote.close()

    # -- the local tier ----------------------------------------------------------------------
    def _mark_remote(self, key: str) -> None:
        """A local hit is a use of the remote chunk too: an S3 remote, which sees no read then, is
        told (``S3Store.touch``: queued, at most once per ``touch_s``), so its gc keeps the chunk."""
        from .s3 import S3Store

        if isinstance(self.remote, S3Store):
            self.remote.touch(key)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def _local(self, fn, *args):
        try:
            return fn(*args)
        except (KVCodecError, OSError) as exc:  # the local tier is a cache: losing it is a miss
            self._count("local_errors")
            log.warning("local tier %s: %s", self.local_url, exc)
            return None

    def _keep(self, key: str, data: bytes) -> None:
        if len(data) > self.max_bytes or self._local(self.local.put, key, data, True) is None:
            return
        with self._lock:
            self.counts["kept"] += 1
            self._kept_since += len(data)
            if self._held is None:
                self._held = 0  # counted from here; the first gc run measures what was there before
                over = True
            else:
                self._held += len(data)
                over = self._held > self.max_bytes
            if not over or self._collecting:
                return
            self._collecting = True
            self._gc = threading.Thread(target=self._collect, name="kv-local-gc", daemon=True)
            self._gc.start()

    def _collect(self) -> None:
        """gc runs until the tier is within its size (three runs at most), counting what was kept while
        it ran; it says it is done under the lock it decided under, so a keep after that starts another."""
        from .capacity import gc

        for attempt in range(3):
            with self._lock:
                self._kept_since = 0
            try:
                report = gc(self.local, max_bytes=int(self.max_bytes * GC_TARGET))
            except (KVCodecError, OSError) as exc:
                log.warning("local tier %s: gc failed: %s", self.local_url, exc)
                with self._lock:
                    self.counts["local_errors"] += 1
                    self._collecting = False
                return
            with self._lock:
                self._held = report["after"]["bytes"] + self._kept_since
                self.counts["evicted"] += report["deleted"]["chunks"]
                if self._held <= self.max_bytes or attempt == 2:
                    self._collecting = False
                    return


def with_local_tier(remote: KVStore, local_url: str, max_bytes: int) -> KVStore:
    """``remote`` behind a local tier at ``local_url`` of at most ``max_bytes`` ('': ``remote`` itself)."""
    if not local_url:
        return remote
    from . import open_store

    return TieredStore(open_store(local_url), remote, max_bytes)


def open_for_settings(settings) -> KVStore:
    """``settings.store`` behind ``settings.local_store`` (``local_store_mb``), or alone when that is unset."""
    from . import open_store

    return with_local_tier(open_store(settings.store), settings.local_store, settings.local_store_mb * 1024 * 1024)
