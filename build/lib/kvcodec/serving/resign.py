"""Chunks a previous key verified, signed again with the current key, off the request's path.

While a key rotates (docs/operations.md, "Rotating the chunk key"), a reader that verifies a chunk
with the previous key (``format.auth``) hands its bytes here: ``ReSigner(store, auth)`` re-signs
each (``format.container.resign``: the same header fields and sections, the current key's tag) and
overwrites the stored copy, on one background thread (``connector.writeback.WriteBack``: bounded,
never blocking the reader; a full queue drops, counted). Once every server signs with the new key
and has re-signed what it read, the previous key can be dropped without a cold start. Two servers
re-signing one chunk write the same bytes.

``offer(key, data) -> bool``; ``stats()``: ``WriteBack``'s (``queued``, ``stored``: re-signed,
``dropped``, ``failed``, ``pending``); ``close()``. Each key is re-signed once per process (the
first offer; later offers of it are ignored until ``MAX_SEEN`` others came after it).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Dict, Tuple

from ..connector.writeback import WriteBack
from ..format import container
from ..format.auth import ChunkAuth

MAX_SEEN = 65536


class ReSigner:
    def __init__(self, store, auth: ChunkAuth, max_pending: int = 64) -> None:
        self.store, self.auth = store, auth
        self.queue = WriteBack(self._resign, max_pending=max_pending, name="kv-resign")
        self._seen: "OrderedDict[str, None]" = OrderedDict()
        self._lock = threading.Lock()

    def offer(self, key: str, data: bytes) -> bool:
        with self._lock:
            if key in self._seen:
                return False
            self._seen[key] = None
            while len(self._seen) > MAX_SEEN:
                self._seen.popitem(last=False)
        return self.queue.offer((key, bytes(data)))

    def _resign(self, job: Tuple[str, bytes]) -> None:
        key, data = job
        if not self.store.put(key, container.resign(data, self.auth), overwrite=True):
            raise RuntimeError(f"the store refused the re-signed chunk {key}")

    def stats(self) -> Dict[str, float]:
        return self.queue.stats()

    def flush(self, timeout_s: float = 30.0) -> bool:
        return self.queue.flush(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        self.queue.close(timeout_s)
