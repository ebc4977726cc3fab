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
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np


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
