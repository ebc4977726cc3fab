"""One composition of the read and write paths, for every deployment (issue 45).

Every home of the connector (the ensemble's ``kv_fetch``, ``kv_decode`` and ``llm`` steps, vLLM's
standalone read path in ``vllm serve``, TensorRT-LLM's scheduler, prefetcher and worker) builds what
reads and writes chunks here, from ``Settings``, so that what one path has, every path has: the local
tier in front of the remote store, the store's breaker and deadlines, the adaptive rung choice over
the measured link, the chunk key (previous keys, per-tenant encryption), re-signing of what a
previous key verified, and write-back that prices each rung it stores.

``open_reads(settings, card, store=None, auth=None) -> Reads``; each member is made on first use
(one step needs the fetcher, another the decoder), once:

- ``store``: ``store.tiered.open_for_settings`` (the remote store behind the local tier), unless given;
- ``costs``: the deployment's cost model (``serving.costs.for_settings``);
- ``fetcher``: ``serving.fetch.Fetcher`` over ``store`` (plan, adaptive rungs, breaker, deadlines);
- ``auth``: ``format.auth.auth_for(settings)``, unless given (TensorRT-LLM's workers read theirs);
- ``resigner``: a ``serving.resign.ReSigner`` writing re-signed chunks through ``store`` (so the
  local copy is replaced too), None without previous keys;
- ``decode_step(**options)``: a ``serving.decode.DecodeStep`` with the resigner hooked, the card's
  geometry and the settings' decoder, threads, isolation and deadline (``options``: a step's own,
  e.g. NVDEC's ``gpu_id``);
- ``reader(**options)``: a ``serving.reader.ChunkReader`` (a run of chunks read at once, for a
  connector that reads beside an engine: TensorRT-LLM's prefetch) over the same store and key;
- ``close()``: what it made (the store only if it opened it).

``open_writes(settings, card, store=None, costs=None, auth=None, corrupt=None, name=...)``: the
write-back sink of the settings' ``writeback`` rungs (None when off), into ``store`` (default: the
local tier's, as reads), each rung's size and decode and restore time told to ``costs`` (default:
the deployment's cost model): a rung stored by write-back is priced before anyone reads it.
"""
from __future__ import annotations

import threading
from typing import Any

from .settings import Settings


class Reads:
    def __init__(self, settings: Settings, card, store=None, auth=None) -> None:
        self.settings, self.card = settings, card
        self._owns_store = store is None
        self._store, self._auth = store, auth
        self._made: dict = {}
        self._lock = threading.RLock()  # a member made first may make another (the fetcher, the store)

    def _once(self, name: str, make):
        with self._lock:
            if name not in self._made:
                self._made[name] = make()
            return self._made[name]

    @property
    def store(self):
        if self._store is None:
            from .store.tiered import open_for_settings

            self._store = self._once("store", lambda: open_for_settings(self.settings))
        return self._store

    @property
    def costs(self):
        from .serving.costs import for_settings

        return self._once("costs", lambda: for_settings(self.settings, self.card.geometry(1).fp16_bytes))

    @property
    def fetcher(self):
        from .serving.fetch import Fetcher

        s = self.settings
        return self._once("fetcher", lambda: Fetcher(
            self.store, self.card.model_id, s.ladder, s.chunk_tokens, costs=self.costs, adaptive=s.adaptive,
            deadline_s=s.deadline_s, card=self.card, timeout_s=s.fetch_timeout_s))

    @property
    def auth(self):
        if self._auth is None:
            from .format.auth import auth_for

            self._auth = self._once("auth", lambda: auth_for(self.settings))
        return self._auth

    @property
    def resigner(self):
        from .serving.resign import ReSigner

        return self._once("resigner", lambda: ReSigner(self.store, self.auth) if self.auth.previous_ids else None)

    def decode_step(self, **options: Any):
        from .serving.decode import DecodeStep

        s, resigner = self.settings, self.resigner
        defaults = dict(decoder=s.decoder, threads=max(1, s.threads), geometry=self.card.geometry(s.chunk_tokens),
                        isolate=s.decoder_process, decode_timeout_s=s.decode_timeout_s)
        return DecodeStep(self.card.model_id, auth=self.auth, resign=resigner.offer if resigner is not None else None,
                          **dict(defaults, **options))

    def reader(self, **options: Any):
        from .serving.reader import ChunkReader

        s = self.settings
        defaults = dict(decoder=s.decoder, threads=max(1, s.threads), chunk_tokens=s.chunk_tokens)
        return ChunkReader(self.card, self.store, self.auth, **dict(defaults, **options))

    def close(self) -> None:
        made = self._made
        if made.get("fetcher") is not None:
            made["fetcher"].close()
        if made.get("resigner") is not None:
            made["resigner"].close()
        if self._owns_store and made.get("store") is not None:
            made["store"].close()


def open_reads(settings: Settings, card, store=None, auth=None) -> Reads:
    return Reads(settings, card, store, auth)


def open_writes(settings: Settings, card, store=None, costs=None, auth=None, corrupt=None,
                name: str = "kv-writeback"):
    if not settings.writeback:
        return None
    from .connector.sink import open_sink
    from .format.auth import auth_for
    from .serving.costs import for_settings
    from .store.tiered import open_for_settings

    owns = store is None
    store = open_for_settings(settings) if store is None else store
    costs = for_settings(settings, card.geometry(1).fp16_bytes) if costs is None else costs
    return open_sink(store, card, settings.writeback, settings.chunk_tokens, auth or auth_for(settings),
                     max_pending=settings.writeback_pending, corrupt=corrupt, name=name, costs=costs, owns=owns)
