"""What an engine's connector is handed, by request, inside one process (thread-safe).

The ``llm`` step hosts the engine in its own process (vLLM with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
TensorRT-LLM with ``TLLM_WORKER_USE_SINGLE_PROCESS=1``): it posts what a request brings (its load
session, where to send its saved chunks) under a key before it gives the request to the engine, and
the connector's scheduler and worker halves read it under the name the engine gives the request:

- ``post(key, item)``, ``get(key)``, ``pop(key)``, ``len()``;
- ``find(engine_id) -> (key, item | None)``: vLLM appends ``-<8 characters>`` to the id it was
  given, so an id not posted is looked up without its last ``-`` part;
- ``prompt_key(ids, salt="")``: a key from a prompt's token ids (and a cache salt), for engines whose
  connector sees an id of its own (TensorRT-LLM's executor ids are not the client's).

``HandOff`` also carries one process-wide value an engine's worker registers and its scheduler
reads: ``pages`` (the engine's ``KVPages``, set by the worker's ``register_kv_caches``).

``Offer``: what is posted for one request (its load session, its write-back sink, whether to defer),
and what the connector reports back on it (tokens promised and loaded, time spent, chunks saved);
``Offer.saver()`` is the sink the worker hands the request's saved chunks to, counting them.
"""
from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from .session import LoadSession
from .worker import SaveSink


def prompt_key(ids: Sequence[int], salt: str = "") -> str:
    h = hashlib.blake2b(np.asarray(list(ids), dtype=np.int64).tobytes(), digest_size=16)
    h.update(salt.encode())
    return h.hexdigest()


class HandOff:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: "OrderedDict[str, Any]" = OrderedDict()
        self.pages = None  # the engine's KVPages, once its worker registered them

    def post(self, key: str, item: Any) -> None:
        with self._lock:
            self._items[key] = item

    def get(self, key: str) -> Optional[Any]:
        with self._lock:
            return self._items.get(key)

    def find(self, engine_id: str) -> Tuple[str, Optional[Any]]:
        with self._lock:
            if engine_id in self._items:
                return engine_id, self._items[engine_id]
            given = str(engine_id).rsplit("-", 1)[0]
            return given, self._items.get(given)

    def pop(self, key: str) -> Optional[Any]:
        with self._lock:
            return self._items.pop(key, None)

    def snapshot(self) -> Dict[str, Any]:
        with self._lock:
            return dict(self._items)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


@dataclass
class Offer:
    """What the ``llm`` step (or the connector itself) offers the connector for one request."""

    session: Optional[LoadSession] = None  # the restored chunks of the prompt's first tokens
    chunk_tokens: int = 256
    save: Optional[SaveSink] = None  # receives the prompt's full chunks not served from the session
    promised_tokens: int = 0  # filled in by the connector
    loaded_tokens: int = 0
    asynchronous: bool = False
    defer: bool = False  # chunks still coming: ask again later, load once they are in (no asynchronous load)
    load_s: float = 0.0
    save_s: float = 0.0
    saved_chunks: int = 0
    own: bool = False  # made by the connector itself (standalone): it removes it when the request ends

    def saver(self) -> Optional[SaveSink]:
        """``save``, timed and counted into ``save_s`` and ``saved_chunks``; None without one."""
        if self.save is None:
            return None

        def sink(chunks) -> int:
            t = time.perf_counter()
            accepted = self.save(chunks)
            self.save_s += time.perf_counter() - t
            accepted = len(chunks) if accepted is None else accepted
            self.saved_chunks += accepted
            return accepted

        return sink
