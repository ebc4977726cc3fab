"""Restored KV staged for TensorRT-LLM, by prompt prefix, in the process that runs its executor.

TensorRT-LLM cannot be told that a load failed or take a promise back (1.2.x and main), so its
connector promises only tokens whose KV is already here: restored, verified, shaped for the model
(and on the device where the engine is). Two producers fill the stage:

- the ensemble's ``llm`` step (``trtllm_engine``), which gathers a request's restored chunks and
  stages them before it gives the request to the LLM API;
- the connector's own ``Prefetcher`` (the stock LLM-API deployment, which has no ensemble): a prompt
  that finds nothing staged starts a background read of its stored prefix (store -> decode ->
  restore, ``serving.reader``) and is computed; the next prompt with that prefix finds it staged.

``Stage(max_entries=16)``: ``put(ids, kv, salt="", chunk_tokens=256)`` stages ``kv`` (``[layers, 2,
kv_heads, n, head_dim]``) as the KV of ``ids[:n]`` and of its shorter prefixes at chunk boundaries
(views of the same array); ``longest(ids, chunk_tokens, salt="", limit=None) -> (kv,
tokens)`` finds the longest staged prefix of ``ids`` at a chunk boundary (``(None, 0)`` if none);
the least recently used entry goes first when full. Keys are ``connector.prompt_key`` of the prefix
and the cache salt. Thread-safe.

``Loads``: the asynchronous loads in flight by executor request id (a ``LoadSession`` each), shared
by the scheduler (which starts them) and the worker (which reports them loaded) of rank 0.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Optional, Sequence, Tuple

from ..connector import LoadSession, prompt_key

MAX_TRACKED = 4096  # loads of requests TensorRT-LLM never finished (warm-up, aborts): dropped oldest first


class Stage:
    def __init__(self, max_entries: int = 16) -> None:
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: "OrderedDict[str, Any]" = OrderedDict()

    def put(self, ids: Sequence[int], kv: Any, salt: str = "", chunk_tokens: int = 256) -> None:
        """Stage ``kv`` for ``ids[:n]`` and, sharing it, for each shorter prefix at a chunk boundary."""
        n = int(kv.shape[3])
        if n <= 0 or n > len(ids):
            raise ValueError(f"staged KV of {n} tokens for a prompt of {len(ids)}")
        ids = list(ids)
        keys = [prompt_key(ids[:m], salt) for m in range(chunk_tokens, n + 1, chunk_tokens)] or \
            [prompt_key(ids[:n], salt)]
        with self._lock:
            for key in keys:  # longest last: the most recently used
                self._entries[key] = kv
                self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries * 64:
                self._entries.popitem(last=False)

    def longest(self, ids: Sequence[int], chunk_tokens: int, salt: str = "",
                limit: Optional[int] = None) -> Tuple[Optional[Any], int]:
        ids = list(ids)
        top = len(ids) if limit is None else min(limit, len(ids))
        with self._lock:
            if not self._entries:
                return None, 0
        for n in range(top - top % chunk_tokens, 0, -chunk_tokens):
            key = prompt_key(ids[:n], salt)
            with self._lock:
                kv = self._entries.get(key)
                if kv is not None:
                    self._entries.move_to_end(key)
                    return kv[:, :, :, :n], n
        return None, 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class Loads:
    """Asynchronous loads by executor request id, shared by the two halves of rank 0 (one process)."""

    def __init__(self) -> None:
        self._items: "OrderedDict[int, LoadSession]" = OrderedDict()

    def put(self, rid: int, session: LoadSession) -> None:
        self._items[rid] = session
        while len(self._items) > MAX_TRACKED:
            self._items.popitem(last=False)

    def get(self, rid: int) -> Optional[LoadSession]:
        return self._items.get(rid)

    def pop(self, rid: int) -> Optional[LoadSession]:
        return self._items.pop(rid, None)

    def __len__(self) -> int:
        return len(self._items)
