"""Save after a miss, for every engine and for ingest: which chunks, when, and how they are stored.

- ``SaveTracker(max_tracked=None)`` (scheduler side of a paged engine, through
  ``connector.scheduler.SchedulerCore``; the oldest of more than ``max_tracked`` requests is dropped):
  ``track(rid, chunks, **extra)`` names a
  request's full chunks to store (``plan.chunks_to_save``); ``add_blocks(rid, ids)`` follows the
  blocks the engine gives it, step by step; ``step(rid, computed_after_step)`` returns the request's
  ``SaveJob`` (and forgets it) in the step whose forward completes its last tracked chunk, else
  None; ``forget(rid)`` when the request ends. One request is tracked once (``track`` again is a
  no-op while it is tracked).
- ``ChunkSaver``: encodes one chunk at each write-back rung, signs it and puts it (a create, as
  every store's ``put``), unless the store holds it already (a key named in ``replace``, whose
  stored copy was found corrupt, is overwritten); ``save`` returns ``Saved(written, present)``. ``keys(ids, index)`` are the chunk's keys at each rung. Each thread gets its own encoders
  (an encoder holds a check decoder), so ingest may run several at once. ``encode(scheme, kv, key,
  index, start)`` returns ``(bytes, encode_s, check_decode_s, check_restore_s)`` for callers that store
  themselves (the encoder decodes and restores its own output once: what a reader here pays).
  Write-back runs it through ``connector.WriteBackSink`` (off the request's path).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Generic, Hashable, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from ..format.auth import ChunkAuth
from ..format.codecs import Scheme
from ..format.keys import chunk_keys
from ..format.ladder import rung_name
from ..store import KVStore

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Hashable)
Chunk = Tuple[int, int, int]  # (index, token start, token end)


@dataclass
class SaveJob:
    request_id: Hashable
    block_ids: List[int]
    chunks: List[Chunk]
    extra: Dict[str, Any] = field(default_factory=dict)


class SaveTracker(Generic[R]):
    def __init__(self, max_tracked: Optional[int] = None) -> None:
        self.max_tracked = max_tracked
        self._jobs: "OrderedDict[R, SaveJob]" = OrderedDict()

    def track(self, rid: R, chunks: Sequence[Chunk], **extra: Any) -> None:
        if chunks and rid not in self._jobs:
            self._jobs[rid] = SaveJob(rid, [], list(chunks), dict(extra))
            while self.max_tracked is not None and len(self._jobs) > self.max_tracked:
                self._jobs.popitem(last=False)  # a request the engine never finished

    def __contains__(self, rid: R) -> bool:
        return rid in self._jobs

    def add_blocks(self, rid: R, block_ids: Sequence[int], replace: bool = False) -> None:
        job = self._jobs.get(rid)
        if job is None:
            return
        if replace:
            job.block_ids = [int(b) for b in block_ids]
        else:
            job.block_ids.extend(int(b) for b in block_ids)

    def step(self, rid: R, computed_after_step: int) -> Optional[SaveJob]:
        job = self._jobs.get(rid)
        if job is None or computed_after_step < job.chunks[-1][2]:
            return None
        return self._jobs.pop(rid)

    def forget(self, rid: R) -> None:
        self._jobs.pop(rid, None)

    def __len__(self) -> int:
        return len(self._jobs)


class ChunkSaver:
    """Encodes a chunk at each rung and stores it. ``observe(identity, tokens, nbytes, decode_s,
    restore_s)``, when given (the cost model's ``observe_rung``), hears each rung's size and its decode
    and restore time on this machine (the encoder decodes and restores its own output once): a rung
    stored by write-back is priced before any reader has read it, so the adaptive ladder can choose it."""

    def __init__(self, store: KVStore, model_id: str, schemes: Sequence[Scheme], chunk_tokens: int, *,
                 auth: ChunkAuth, threads: int = 1,
                 observe: Optional[Callable[[str, int, int, float, float], None]] = None) -> None:
        self.store = store
        self.observe = observe
        self.model_id = model_id
        self.schemes = list(schemes)
        self.chunk_tokens = chunk_tokens
        self.auth = auth
        self.threads = threads
        self._local = threading.local()

    def _encoder(self, scheme: Scheme):
        encoders = getattr(self._local, "encoders", None)
        if encoders is None:
            encoders = self._local.encoders = {}
        if scheme.identity not in encoders:
            from ..encode import ChunkEncoder  # the codecs' libraries load with the first encoder

            encoders[scheme.identity] = ChunkEncoder(scheme, self.model_id, auth=self.auth, threads=self.threads)
        return encoders[scheme.identity]

    def keys(self, ids: Sequence[int], index: int, salt: str = "") -> Tuple[str, ...]:
        return tuple(chunk_keys(ids, self.model_id, s.identity, self.chunk_tokens, max_chunks=index + 1,
                                salt=salt)[index] for s in self.schemes)

    def encode(self, scheme: Scheme, kv: np.ndarray, key: str, index: int,
               start: int, tenant: str = "") -> Tuple[bytes, float, float, float]:
        enc = self._encoder(scheme)
        t = time.perf_counter()
        data = enc.encode(kv, key, index, start, tenant)
        return data, time.perf_counter() - t, enc.last_decode_s, enc.last_restore_s

    def save(self, keys: Sequence[str], index: int, start: int, kv: np.ndarray,
             replace: FrozenSet[str] = frozenset(), tenant: str = "") -> "Saved":
        """Store the chunk at every rung whose key the store lacks (a create: a key another writer
        stores meanwhile keeps that writer's copy), or that ``replace`` names (overwritten);
        ``tenant``: the keys' tenant (``format.keys.tenant_id``)."""
        saved = Saved()
        for scheme, key in zip(self.schemes, keys, strict=True):
            if key not in replace and self.store.exists(key):
                saved.present += 1
                continue
            data, encode_s, decode_s, restore_s = self.encode(scheme, kv, key, index, start, tenant)
            if self.observe is not None:
                try:
                    self.observe(scheme.identity, self.chunk_tokens, len(data), decode_s, restore_s)
                except Exception as exc:  # noqa: BLE001 - a cost model that cannot be written never fails a write
                    log.warning("write-back: could not record %s's cost: %s", rung_name(scheme), exc)
            if self.store.put(key, data, overwrite=key in replace):
                saved.written += 1
                log.info("write-back: chunk %d at %s (%d bytes) in %.2f s", index, rung_name(scheme), len(data),
                         encode_s)
            else:
                saved.present += 1
        return saved


@dataclass
class Saved:
    """What one ``ChunkSaver.save`` did, per rung copy: ``written`` by this call, ``present``: another
    writer's copy was there already (found before encoding, or refused by the store's create)."""

    written: int = 0
    present: int = 0
