"""Restored KV staged by prompt prefix, bounded in bytes, in the process that runs an engine.

An engine that cannot be told that a load failed (TensorRT-LLM 1.2.x and main have no failed-load
API) is promised only tokens whose KV is already here: restored, verified, shaped for the model, in
the pool's dtype and on its device. The stage holds that KV until the engine's blocks have it:

- ``put(ids, kv, salt="", chunk_tokens=256) -> bool``: stages ``kv`` (``[layers, 2, kv_heads, n,
  head_dim]``, torch or numpy) as the KV of ``ids[:n]`` and of each shorter prefix at a chunk
  boundary (views of the one array: its bytes count once). False, counted as ``refused``, when it
  alone is larger than ``max_bytes``; otherwise the least recently used entries are evicted
  (counted) until it fits;
- ``longest(ids, chunk_tokens, salt="", limit=None) -> Staged | None``: the longest staged prefix of
  ``ids`` at a chunk boundary, at most ``limit`` tokens (``Staged.kv`` cut to it, ``Staged.tokens``,
  ``Staged.entry`` to ``drop`` later). One pass over the prompt: the keys are a hash chain
  (``prefix_keys``), never a hash of every prefix from its start;
- ``drop(entry)``: the entry (all its prefixes) leaves once its blocks are written (the engine's own
  prefix cache holds it from then on); ``bytes``, ``stats()`` (``entries``, ``bytes``, ``staged``,
  ``evicted``, ``dropped``, ``refused``), ``len()`` (the prefixes staged).

Thread-safe. ``prefix_keys(ids, chunk_tokens, salt)``: the key of every prefix of ``ids`` that ends
on a chunk boundary, in one pass: key ``i`` hashes key ``i-1`` with chunk ``i``'s token ids (and the
salt once, at the start), so two prompts share a key exactly when they share that prefix and salt.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

DEFAULT_MAX_BYTES = 1 << 30  # 1 GiB: what may sit outside an engine's KV pool on its device


def prefix_keys(ids: Sequence[int], chunk_tokens: int, salt: str = "") -> List[str]:
    """Keys of ``ids[:chunk_tokens]``, ``ids[:2*chunk_tokens]``, ... (full chunks only), one pass."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    arr = np.asarray(ids, dtype=np.int64)
    link = hashlib.blake2b(salt.encode(), digest_size=16).digest()
    keys = []
    for end in range(chunk_tokens, len(arr) + 1, chunk_tokens):
        h = hashlib.blake2b(link, digest_size=16)
        h.update(arr[end - chunk_tokens:end].tobytes())
        link = h.digest()
        keys.append(link.hex())
    return keys


def nbytes(kv: Any) -> int:
    """Bytes a staged array (numpy or torch) holds."""
    if isinstance(kv, np.ndarray):
        return int(kv.nbytes)
    return int(kv.numel() * kv.element_size())


@dataclass
class _Entry:
    kv: Any
    keys: List[str]
    bytes: int


@dataclass
class Staged:
    kv: Any  # the staged KV cut to ``tokens``
    tokens: int
    entry: int  # what ``Stage.drop`` takes


class Stage:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._entries: "OrderedDict[int, _Entry]" = OrderedDict()  # least recently used first
        self._by_key: Dict[str, int] = {}
        self._next = 0
        self._bytes = 0
        self._counts = {"staged": 0, "evicted": 0, "dropped": 0, "refused": 0}

    def put(self, ids: Sequence[int], kv: Any, salt: str = "", chunk_tokens: int = 256) -> bool:
        n = int(kv.shape[3])
        if n <= 0 or n > len(ids) or n % chunk_tokens:
            raise ValueError(f"staged KV of {n} tokens for a prompt of {len(ids)} (whole {chunk_tokens}-token "
                             "chunks only)")
        size = nbytes(kv)
        keys = prefix_keys(list(ids[:n]), chunk_tokens, salt)
        with self._lock:
            if size > self.max_bytes:
                self._counts["refused"] += 1
                return False
            for key in keys:  # an older entry under the same keys gives way to this one
                old = self._by_key.get(key)
                if old is not None and old in self._entries:
                    self._remove(old)
            while self._bytes + size > self.max_bytes and self._entries:
                self._remove(next(iter(self._entries)))
                self._counts["evicted"] += 1
            entry, self._next = self._next, self._next + 1
            self._entries[entry] = _Entry(kv, keys, size)
            for key in keys:
                self._by_key[key] = entry
            self._bytes += size
            self._counts["staged"] += 1
        return True

    def _remove(self, entry: int) -> None:
        gone = self._entries.pop(entry)
        self._bytes -= gone.bytes
        for key in gone.keys:
            if self._by_key.get(key) == entry:
                del self._by_key[key]

    def longest(self, ids: Sequence[int], chunk_tokens: int, salt: str = "",
                limit: Optional[int] = None) -> Optional[Staged]:
        top = len(ids) if limit is None else max(0, min(limit, len(ids)))
        with self._lock:
            if not self._entries:
                return None
        keys = prefix_keys(list(ids[:top - top % chunk_tokens]), chunk_tokens, salt)
        with self._lock:
            for i in range(len(keys) - 1, -1, -1):
                entry = self._by_key.get(keys[i])
                if entry is not None:
                    self._entries.move_to_end(entry)
                    n = (i + 1) * chunk_tokens
                    return Staged(self._entries[entry].kv[:, :, :, :n], n, entry)
        return None

    def drop(self, entry: int) -> None:
        with self._lock:
            if entry in self._entries:
                self._remove(entry)
                self._counts["dropped"] += 1

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    def stats(self) -> Dict[str, int]:
        with self._lock:
            return dict(self._counts, entries=len(self._entries), bytes=self._bytes)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)
