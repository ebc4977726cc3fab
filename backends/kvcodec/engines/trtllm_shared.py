"""What TensorRT-LLM's two connector halves and the ensemble's engine share in one process (rank 0).

TensorRT-LLM makes the scheduler half and the worker half itself (``cls(llm_args)``); with TP=1
and ``TLLM_WORKER_USE_SINGLE_PROCESS=1`` both live in the process that runs the executor, beside the
``trtllm`` engine of the ensemble's ``llm`` step. ``Shared`` is what passes between them, typed:

- ``stage``: restored KV by prompt prefix (``connector.Stage``, bounded in bytes), filled by the
  engine (``stage_restored``) or the prefetcher; only staged KV is ever promised;
- ``pages``: the engine's pool (``KVPages``), set by the worker's ``register_kv_caches``;
- ``loads``: the loads the scheduler accepted (``connector.scheduler.Load``, by executor request
  id), taken by the worker's ``start_load_kv`` in the same step (the step's metadata names them);
- ``promised``: tokens promised per request (``Promised``: by the LLM API's client id, else by prompt),
  taken by the engine to report ``reused_tokens``; bounded (the oldest go first, counted), since
  a request that fails before its first output is never taken;
- ``corrupt``: store keys a read found corrupt; the write-back sink replaces them;
- ``salts``: the ensemble engine's cache salts by the stage salt TensorRT-LLM's request carries
  (``Salts``): the write-back of a salted request stores under the tenant's own salt, the one
  kv_fetch reads with; without the engine (the llmapi model) the stage salt is the store salt.

``to_pool(kv, pages)``: staged KV in the pool's dtype and on its device (from the host through pinned
memory on a side stream of the calling thread, which waits for it: never the executor's stream).
``fits(kv, card, pages)``: whether staged KV can be copied into the pool as it is (shape, dtype,
device): only then is it promised.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from ..connector import HandOff, KVPages, Stage, prompt_key
from ..connector.sink import KeySet

log = logging.getLogger("kvcodec.trtllm")


class Promised:
    """Tokens the scheduler promised, per request, until the engine takes them for its report.

    ``post(n, client=None, ids=(), salt="")`` records under the request's LLM-API client id
    (``trtllm_compat.client_id``), or under its prompt (``connector.prompt_key``) where it has none;
    ``pop(client=None, ids=(), salt="")`` takes it back: the client's record, else the prompt's (0
    if neither). At most ``max_entries`` are kept:
    past that the oldest goes (``dropped`` counts them; an engine would then report 0 for it).
    Thread-safe."""

    def __init__(self, max_entries: int = 4096) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.dropped = 0
        self._lock = threading.Lock()
        self._items: "OrderedDict[tuple, int]" = OrderedDict()

    @staticmethod
    def _key(client: Optional[int], ids: Sequence[int], salt: str) -> tuple:
        return ("client", int(client)) if client is not None else ("prompt", prompt_key(list(ids), salt))

    def post(self, n: int, client: Optional[int] = None, ids: Sequence[int] = (), salt: str = "") -> None:
        key = self._key(client, ids, salt)
        with self._lock:
            self._items.pop(key, None)
            self._items[key] = int(n)
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)
                self.dropped += 1

    def pop(self, client: Optional[int] = None, ids: Sequence[int] = (), salt: str = "") -> int:
        with self._lock:
            if client is not None and ("client", int(client)) in self._items:
                return self._items.pop(("client", int(client)))
            return int(self._items.pop(self._key(None, ids, salt), 0)) if len(ids) else 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class Salts:
    """Cache salts by stage salt (``trtllm_compat.stage_salt``), bounded (the oldest go first).

    ``post(stage, salt)`` records that requests carrying ``stage`` were sent with ``salt``;
    ``store_salt(stage)`` is the salt their chunks are stored and read under: that ``salt`` if
    posted, else ``stage`` itself ("" stays ""). Thread-safe."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._items: "OrderedDict[str, str]" = OrderedDict()

    def post(self, stage: str, salt: str) -> None:
        if not stage:
            return
        with self._lock:
            self._items.pop(stage, None)
            self._items[stage] = salt
            while len(self._items) > self.max_entries:
                self._items.popitem(last=False)

    def store_salt(self, stage: str) -> str:
        with self._lock:
            return self._items.get(stage, stage)


@dataclass
class Shared:
    stage: Stage = field(default_factory=Stage)
    loads: HandOff = field(default_factory=HandOff)
    promised: Promised = field(default_factory=Promised)
    corrupt: KeySet = field(default_factory=KeySet)
    salts: Salts = field(default_factory=Salts)
    pages: Optional[KVPages] = None


SHARED = Shared()
_streams = threading.local()


def to_pool(kv: Any, pages: Optional[KVPages]):
    """``kv`` (numpy, or torch on any device) as a torch tensor in the pool's dtype on its device
    (float16 on the CPU before a pool is registered)."""
    import torch

    device = pages.views[0][0].device if pages is not None else torch.device("cpu")
    dtype = pages.dtype if pages is not None else torch.float16
    if isinstance(kv, np.ndarray):
        kv = torch.from_numpy(np.ascontiguousarray(kv))
    if kv.device == device:
        return kv.to(dtype).contiguous()
    if device.type != "cuda":
        return kv.to(device=device, dtype=dtype).contiguous()
    stream = getattr(_streams, "stream", None)
    if stream is None:
        stream = _streams.stream = torch.cuda.Stream(device=device)
    with torch.cuda.stream(stream):
        src = kv.pin_memory() if kv.device.type == "cpu" else kv
        out = src.to(device=device, non_blocking=True).to(dtype).contiguous()
    stream.synchronize()  # this thread waits, not the executor's stream
    return out


def fits(kv: Any, card, pages: Optional[KVPages]) -> bool:
    import torch

    want = (card.layers, 2, card.kv_heads, card.head_dim)
    if not isinstance(kv, torch.Tensor) or pages is None or kv.dtype != pages.dtype \
            or kv.device != pages.views[0][0].device:
        return False  # not in the pool's dtype and device (``to_pool`` puts it there): the copy could still fail
    if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != want:
        log.error("staged KV of shape %s does not fit model %s: not promised", tuple(kv.shape), card.name)
        return False
    return True
