"""Fetch: the longest stored prefix of a prompt, streamed chunk by chunk.

``Fetcher.plan(ids)`` looks the prompt's chunk keys up for each codec in preference order and
keeps the codec with the longest run of stored chunks from the start (at least one prompt token
is always left to compute). ``Fetcher.fetch(ids, session)`` yields ``(ChunkInfo, bytes)`` for each
planned chunk as it arrives; it yields one ``count == 0`` record when there is nothing to reuse.
A store error mid-way becomes a failed chunk (a miss from there on), never an exception.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, List, Sequence, Tuple

from .chunkinfo import ChunkInfo
from .errors import KVCodecError
from .keys import chunk_keys, reusable_chunks
from .schemes import Scheme, get_scheme
from .store import KVStore


@dataclass
class Plan:
    scheme: Scheme
    keys: List[str]


class Fetcher:
    def __init__(self, store: KVStore, model_id: str, codecs: Sequence[str], chunk_tokens: int) -> None:
        self.store = store
        self.model_id = model_id
        self.schemes = [get_scheme(c) for c in codecs]
        self.chunk_tokens = chunk_tokens

    def plan(self, ids: Sequence[int]) -> Plan | None:
        limit = reusable_chunks(len(ids), self.chunk_tokens)
        best: Plan | None = None
        for scheme in self.schemes:
            keys = chunk_keys(ids, self.model_id, scheme.identity, self.chunk_tokens, max_chunks=limit)
            found = 0
            for key in keys:
                if not self.store.exists(key):
                    break
                found += 1
            if found and (best is None or found > len(best.keys)):
                best = Plan(scheme, keys[:found])
            if best is not None and len(best.keys) == limit:
                break
        return best

    def fetch(self, ids: Sequence[int], session: str, reuse: bool = True) -> Iterator[Tuple[ChunkInfo, bytes]]:
        t_request = time.time()
        try:
            plan = self.plan(ids) if reuse else None
            reason = "" if reuse else "reuse disabled by the request"
        except KVCodecError as exc:
            plan, reason = None, f"store lookup failed: {exc}"
        if plan is None:
            info = ChunkInfo(session, 0, 0, status="none", reason=reason or "no stored prefix")
            info.t.update(request=t_request, sent=time.time())
            yield info, b""
            return
        failed = False
        for i, key in enumerate(plan.keys):
            info = ChunkInfo(session, i, len(plan.keys), scheme=plan.scheme.name, key=key,
                             token_start=i * self.chunk_tokens, tokens=self.chunk_tokens)
            info.t["request"] = t_request
            data = b""
            if failed:
                info.fail("miss", "an earlier chunk failed")
            else:
                t0 = time.perf_counter()
                try:
                    data = self.store.get(key) or b""
                    if not data:
                        info.fail("miss", "chunk vanished from the store")
                except KVCodecError as exc:
                    info.fail("error", f"store: {exc}")
                info.s["fetch"] = time.perf_counter() - t0
                info.bytes = len(data)
                failed = not info.ok
            info.t["sent"] = time.time()
            yield info, data
