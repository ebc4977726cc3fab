"""How much of a prompt the store holds: the scheduler's question, answered with ``exists`` only.

- ``prompt_keys(model_id, scheme, ids, chunk_tokens, max_chunks=None)``: the store keys of the
  prompt's full chunks at one rung (``kvcodec.format.keys.chunk_keys`` with the scheme's identity);
- ``stored_tokens(store, keys, chunk_tokens, pool=None)``: tokens of the leading run of ``keys``
  the store holds. Without ``pool`` it probes in order and stops at the first miss; with an
  executor it probes every key at once (one round trip instead of one per chunk, as the fetcher
  does). A store error ends the run there (a miss, never an exception, as in the fetcher);
- ``stored_tokens_for(store, model_id, ladder_schemes, ids, chunk_tokens, pool=None)``: the longest
  prefix over the ladder, with the fetcher's rule (``Fetcher.plan``): each rung's own leading run,
  capped so that one prompt token is left to compute, and the longest run wins. So the answer is
  what a ``Fetcher`` with the same ladder will stream. ``ladder_schemes`` are ``Scheme`` objects
  bound to the model as the fetcher binds them (``parse_ladder(ladder, card)``), or the keys are
  not those ingest wrote;
- ``fetcher_tokens(fetcher, ids)``: the same answer from an existing ``Fetcher``'s own plan.
"""
from __future__ import annotations

import logging
from concurrent.futures import Executor
from typing import List, Optional, Sequence

from ..errors import KVCodecError
from ..format.codecs import Scheme
from ..format.keys import chunk_keys, reusable_chunks
from ..serving.fetch import Fetcher
from ..store import KVStore

log = logging.getLogger(__name__)


def prompt_keys(model_id: str, scheme: Scheme, ids: Sequence[int], chunk_tokens: int,
                max_chunks: Optional[int] = None) -> List[str]:
    return chunk_keys(ids, model_id, scheme.identity, chunk_tokens, max_chunks=max_chunks)


def _exists(store: KVStore, key: str) -> bool:
    try:
        return store.exists(key)
    except KVCodecError as exc:
        log.warning("store look-up of %s failed: %s", key, exc)
        return False


def stored_tokens(store: KVStore, keys: Sequence[str], chunk_tokens: int, pool: Optional[Executor] = None) -> int:
    if pool is not None:
        found = list(pool.map(lambda k: _exists(store, k), keys))
    else:
        found = []
        for key in keys:
            found.append(_exists(store, key))
            if not found[-1]:
                break
    n = 0
    while n < len(found) and found[n]:
        n += 1
    return n * chunk_tokens


def stored_tokens_for(store: KVStore, model_id: str, ladder_schemes: Sequence[Scheme], ids: Sequence[int],
                      chunk_tokens: int, pool: Optional[Executor] = None) -> int:
    limit = reusable_chunks(len(ids), chunk_tokens)
    best = 0
    for scheme in ladder_schemes:
        if best == limit * chunk_tokens:
            break  # no rung can do better
        keys = prompt_keys(model_id, scheme, ids, chunk_tokens, max_chunks=limit)
        best = max(best, stored_tokens(store, keys, chunk_tokens, pool))
    return best


def fetcher_tokens(fetcher: Fetcher, ids: Sequence[int]) -> int:
    try:
        plan = fetcher.plan(ids)
    except KVCodecError as exc:
        log.warning("store look-up failed: %s", exc)
        return 0
    return plan.n_chunks * fetcher.chunk_tokens if plan else 0
