"""A run of stored chunks read, decoded and restored in one call (for connectors that read the store
themselves, off the ensemble: TensorRT-LLM's stock LLM-API deployment).

``ChunkReader(card, store, auth, decoder="pyav", threads=1, chunk_tokens=256, threads_io=4)``;
``read_run(refs, deadline) -> (restored KV of the leading run, why it ended ('' if it did not), the
keys found corrupt)``: each ``ChunkRef`` is tried at its rungs in order (the first choices of every
chunk fetched at once on a small pool; decode and restore in the caller's thread, in order); a
missing, corrupt or foreign chunk, a store error or the deadline ends the run there.
``restore(data, key)`` is one chunk's decode and restore, checked against the model's geometry.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, List, Sequence, Set, Tuple

import numpy as np

from ..errors import CorruptChunk, ForeignChunk, KVCodecError
from ..format.auth import ChunkAuth
from ..store import KVStore
from .decode import ChunkDecoder
from .restore import restore


@dataclass
class ChunkRef:
    index: int
    keys: Tuple[str, ...]  # the rungs that hold the chunk, preferred first
    rungs: Tuple[str, ...]


class ChunkReader:
    def __init__(self, card, store: KVStore, auth: ChunkAuth, *, decoder: str = "pyav", threads: int = 1,
                 chunk_tokens: int = 256, io_threads: int = 4) -> None:
        self.store = store
        self.geometry = card.geometry(chunk_tokens)
        self.decoder = ChunkDecoder(card.model_id, auth=auth, decoder=decoder, threads=threads,
                                    geometry=self.geometry)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kv-get")

    def restore(self, data: Any, key: str) -> np.ndarray:
        kv = restore(self.decoder.decode(data, key=key))
        g = self.geometry
        if kv.shape != (g.layers, 2, g.kv_heads, g.tokens, g.head_dim):
            raise ForeignChunk(f"chunk restored to {tuple(kv.shape)}, expected "
                               f"{(g.layers, 2, g.kv_heads, g.tokens, g.head_dim)}")
        return kv

    def read_run(self, refs: Sequence[ChunkRef], deadline: float) -> Tuple[List[np.ndarray], str, Set[str]]:
        first = [self._pool.submit(self.store.get, ref.keys[0]) for ref in refs]
        out: List[np.ndarray] = []
        corrupt: Set[str] = set()
        for ref, call in zip(refs, first, strict=True):
            kv, why = None, ""
            for n, (key, rung) in enumerate(zip(ref.keys, ref.rungs, strict=True)):
                call = call if n == 0 else self._pool.submit(self.store.get, key)
                try:
                    data = call.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    why = f"chunk {ref.index}: timeout, the store did not answer by the fetch deadline"
                    break
                except KVCodecError as exc:
                    why = f"chunk {ref.index} at {rung}: store error: {exc}"
                    continue
                if not data:
                    why = f"chunk {ref.index} at {rung}: missing"
                    continue
                try:
                    kv = self.restore(data, key)
                    break
                except (KVCodecError, ValueError) as exc:
                    if isinstance(exc, CorruptChunk):
                        corrupt.add(key)
                    kind = "foreign" if isinstance(exc, ForeignChunk) else "corrupt"
                    why = f"chunk {ref.index} at {rung}: {kind}: {exc}"
            if kv is None:
                for later in first[len(out) + 1:]:
                    later.cancel()
                return out, why or f"chunk {ref.index}: no rung", corrupt
            out.append(kv)
        return out, "", corrupt

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.decoder.close()
