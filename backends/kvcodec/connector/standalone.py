"""A connector's own offers, where no ensemble step posts them (``vllm serve``): ``OwnOffers``.

The engine's own prefix cache is the first tier: a request whose stored prefix the engine already
holds (``computed_tokens``) reads nothing. For the rest the store is read in the background through
the ensemble's read path (``serving.readpath.ReadPath``: plan, adaptive rungs, breaker, deadlines,
verification, decode, restore); until the plan is known ``offer`` answers ``PENDING`` (the engine
is told to ask again at its next step), then posts an ``Offer`` whose session the chunks stream
into as they arrive. Misses are written back through ``sink`` (a ``WriteBackSink``), keyed by the
request's cache salt.

``OwnOffers(reads, sink, handoff, chunk_tokens, metrics)``: ``metrics`` hears ``local(tokens)``
per request and is attached to the sink's and the store's live counts (``attach(writeback=,
store=)``); the adapter gives it the engine's metrics object. ``offer(rid, ids, salt,
computed_tokens)``, ``finished(rid)``, ``close()``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from ..format.keys import reusable_chunks
from .handoff import HandOff, Offer
from .session import LoadSession

PENDING = object()  # the read's plan is not known yet: the engine is told to ask again


class OwnOffers:
    def __init__(self, reads, sink, handoff: HandOff, chunk_tokens: int, metrics) -> None:
        self.reads, self.sink, self.handoff, self.chunk_tokens = reads, sink, handoff, chunk_tokens
        self.metrics = metrics
        metrics.attach(writeback=sink.stats if sink is not None else None, store=reads.fetcher.calls.snapshot)
        self._reading: Dict[str, Any] = {}
        self.counters = {"requests": 0, "local_tokens": 0, "remote_reads": 0}

    def offer(self, rid: str, ids: Sequence[int], salt: str, computed_tokens: int):
        """The request's ``Offer`` (posted in the hand-off), or ``PENDING`` while its read is planning."""
        reading = self._reading.get(rid)
        ids = list(ids)
        if reading is None:
            self.counters["requests"] += 1
            self.counters["local_tokens"] += int(computed_tokens)
            self.metrics.local(computed_tokens)
            stored_max = reusable_chunks(len(ids), self.chunk_tokens) * self.chunk_tokens
            if computed_tokens >= stored_max:  # the engine holds every chunk the store could: nothing to read
                return self._post(rid, ids, None, salt)
            reading = self._reading[rid] = self.reads.start(ids, salt)
            self.counters["remote_reads"] += 1
        if not reading.ready.is_set():
            return PENDING
        del self._reading[rid]
        return self._post(rid, ids, reading.session, salt)

    def _post(self, rid: str, ids: List[int], session: Optional[LoadSession], salt: str) -> Offer:
        offer = Offer(session=session, chunk_tokens=self.chunk_tokens,
                      save=self.sink.for_prompt(ids, salt) if self.sink is not None else None, own=True)
        self.handoff.post(rid, offer)
        return offer

    def finished(self, rid: str) -> None:
        self._reading.pop(rid, None)
        offer = self.handoff.get(rid)
        if offer is not None and offer.own:
            self.handoff.pop(rid)

    def close(self) -> None:
        self.reads.close()
        if self.sink is not None:
            self.sink.close()
