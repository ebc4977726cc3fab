"""Fetch: the longest stored prefix of a prompt, streamed chunk by chunk, rung by rung.

``Fetcher.plan(ids)`` looks up which rungs (schemes of the ladder, best quality first) hold each
of the prompt's chunks, probing the store concurrently, and keeps each rung's run of stored chunks
from the start (at least one prompt token is always left to compute).

``Fetcher.fetch(ids, session)`` yields ``(ChunkInfo, bytes)`` for each planned chunk as it
arrives (the caller sends each on at once, so chunk i is decoded while chunk i+1 is on the wire);
it yields one ``count == 0`` record when there is nothing to reuse. Two policies:

- static (``adaptive=False``, or a request that names its codecs): the preferred rung with the
  longest run, for every chunk;
- adaptive: per chunk, the rung whose slowest stage (transfer at the measured link rate, decode
  and restore at this machine's measured cost, see ``kvcodec.serving.costs``) is quickest; with a
  deadline, the best-quality rung that still meets it. A rung that misses falls back to the next
  one for that chunk. Before each chunk it compares fetching the rest with recomputing it and
  stops (status ``recompute``) when recomputing is faster, as CacheGen does. Each choice is
  written into the chunk's ``ChunkInfo.choice``.

A store error mid-way becomes a failed chunk (a miss from there on), never an exception. So does
time. A sick store costs a request at most about one prefill of what it stores:

- the give-up budget: a request's store calls (the look-up too) end by
  ``GIVE_UP_SHARE * max(MIN_FAULT_S, predicted prefill of the stored prefix)`` after it came (before
  the look-up, of the longest prefix that could be stored), and never after ``timeout_s``
  (``fetch_timeout_s``, the outer bound). The prefill rate is the cost model's;
- patience (adaptive): while a chunk is awaited, the request stops waiting as soon as finishing the
  fetch is predicted slower than recomputing the rest: when the wait on chunk i passes
  ``prefill(chunks i..) - predicted fetch(chunks after i)`` (at least ``MIN_PATIENCE_S``);
- a store that does not answer in time ends reuse at that chunk with status ``timeout``; one that
  refuses or errs, with ``error``, at once. The model computes the rest.
A request that names its rungs (``codecs``: a baseline of a benchmark) asked for them however slow
they are: it is held to ``timeout_s`` only (the breaker still keeps it off a dead store).

Every store call runs on ``serving.calls.StoreCalls``: a fixed pool per store, each call inside
the request's deadline (``store.deadline``: a network store cuts the call and closes its socket
then, so hung calls do not pile up), counted (``snapshot()``, sent with each request in
``ChunkInfo.store``) and heard by the store's circuit breaker (``store.breaker``): once a call
fails or times out, requests skip the store at once (status ``none``, "store skipped") until a
probe finds it answering again (the first request after the cooldown runs the probe and waits up to
``PROBE_WAIT_S`` for it; a healed store is used again within two requests).

A store with a local tier (``store.tiered``: ``holds_locally``, ``get_tiered``) is two links: the
plan notes which chunks the local tier holds, the estimates price each chunk over its tier's link
(the local one's prior ``LOCAL_PRIOR_MBPS`` until measured), each transfer is recorded under the
tier that served it (a local hit never makes the remote link look fast), and ``ChunkInfo.tier``
says which it was. While the remote store's breaker keeps it out, the local tier alone is still
read (``plan_local``: on the request's thread, not the store's pool): a hot prefix outlives an outage.

Estimates heal: when the adaptive fetcher chooses to recompute, no transfer would correct a link
estimate that a slow moment made too pessimistic; so it reads up to ``LINK_PROBE_BYTES`` of the
first chunk in the background (at most every ``LINK_PROBE_EVERY_S``) and records that transfer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

from ..errors import KVCodecError, StoreTimeout
from ..format.codecs import Scheme
from ..format.keys import chunk_keys, reusable_chunks
from ..format.ladder import parse_ladder, rung_name
from ..store import KVStore
from ..store.breaker import Breaker
from ..store.deadline import call_deadline
from ..store.tiered import LOCAL, REMOTE
from .calls import StoreCalls
from .chunkinfo import ChunkInfo
from .costs import CostModel

PROBE_THREADS = 16  # the fixed pool of one store's calls
MIN_FAULT_S = 2.0  # a store fault may cost a request max(this, predicted prefill of the stored prefix)
GIVE_UP_SHARE = 0.8  # of that, the share the store may take (the rest: what runs after giving up)
MIN_PATIENCE_S = 0.5  # the shortest wait on one chunk (a healthy store answers well within it)
PROBE_WAIT_S = 0.2  # how long a request waits for the breaker's probe before going without the store
LINK_PROBE_BYTES = 256 * 1024
LINK_PROBE_EVERY_S = 5.0
LOCAL_PRIOR_MBPS = 20000.0  # a local tier's rate before one is measured (a file in RAM or on an SSD)


@dataclass
class Plan:
    runs: List[Tuple[Scheme, List[str]]]  # per rung, in ladder order: the keys of its stored run
    local: FrozenSet[str] = frozenset()  # the keys a local tier holds (``store.tiered``)
    local_only: bool = False  # the remote store is kept out (its breaker): only the local tier is read

    @property
    def n_chunks(self) -> int:
        return max((len(keys) for _, keys in self.runs), default=0)

    @property
    def scheme(self) -> Scheme:
        """The preferred rung among those with the longest run."""
        return next(s for s, keys in self.runs if len(keys) == self.n_chunks)

    @property
    def keys(self) -> List[str]:
        return next(keys for _, keys in self.runs if len(keys) == self.n_chunks)

    def candidates(self, index: int) -> List[Tuple[Scheme, str]]:
        return [(s, keys[index]) for s, keys in self.runs if len(keys) > index]


@dataclass
class Estimate:
    scheme: Scheme
    key: str
    fetch_s: float
    decode_s: float
    restore_s: float

    @property
    def stage_s(self) -> float:
        return max(self.fetch_s, self.decode_s, self.restore_s)

    def describe(self) -> str:
        return (f"{rung_name(self.scheme)} {self.stage_s:.3f}s (fetch {self.fetch_s:.3f}, "
                f"decode {self.decode_s:.3f}, restore {self.restore_s:.3f})")


def _runs(schemes: Sequence[Scheme], all_keys: Sequence[Sequence[str]],
          present: Dict[str, bool]) -> List[Tuple[Scheme, List[str]]]:
    """Per rung, the keys of its run of present chunks from the first."""
    runs = []
    for scheme, keys in zip(schemes, all_keys, strict=True):
        n = 0
        while n < len(keys) and present[keys[n]]:
            n += 1
        runs.append((scheme, list(keys[:n])))
    return runs


class Fetcher:
    def __init__(self, store: KVStore, model_id: str, codecs: Sequence[str], chunk_tokens: int,
                 costs: Optional[CostModel] = None, adaptive: bool = False, deadline_s: float = 0.0,
                 card: Optional[Any] = None, timeout_s: float = 20.0, breaker: Optional[Breaker] = None) -> None:
        """``card``: the model's ``engines.ModelCard``; every rung is bound to it (codec profile,
        KV dtype: ``Scheme.for_card``), so the keys are those ingest wrote for this engine.
        ``breaker``: the store's circuit breaker (a default one otherwise)."""
        self.store = store
        self.model_id = model_id
        self.card = card
        self.schemes = parse_ladder(list(codecs), card)
        self.chunk_tokens = chunk_tokens
        self.costs = costs or CostModel()
        self.adaptive = adaptive
        self.deadline_s = deadline_s
        self.timeout_s = timeout_s  # the hard limit on a request's store calls (``fetch_timeout_s``)
        self.calls = StoreCalls(store, PROBE_THREADS, breaker)
        self._link_probe_at = -LINK_PROBE_EVERY_S

    def close(self) -> None:
        self.calls.close()

    # -- plan --------------------------------------------------------------------------------
    def plan(self, ids: Sequence[int], schemes: Optional[Sequence[Scheme]] = None,
             deadline: Optional[float] = None, salt: str = "") -> Plan | None:
        """``deadline``: a ``time.monotonic()`` by which the look-up must be done (``StoreTimeout`` after);
        ``salt``: the request's cache salt (its tenant's keys, ``format.keys``)."""
        schemes, all_keys = self._keys(ids, schemes, salt)
        flat = [k for keys in all_keys for k in keys]
        futures = [self.calls.submit(self.store.exists, k, deadline=deadline) for k in flat]
        present = dict(zip(flat, self.calls.wait(futures, deadline, "look-up"), strict=True))
        holds = getattr(self.store, "holds_locally", None)
        runs = _runs(schemes, all_keys, present)
        local = frozenset(k for _, keys in runs for k in keys if holds(k)) if holds else frozenset()
        plan = Plan(runs, local)
        return plan if plan.n_chunks else None

    def plan_local(self, ids: Sequence[int], schemes: Optional[Sequence[Scheme]] = None,
                   salt: str = "") -> Plan | None:
        """The plan of what the local tier alone holds (its own calls, no pool, no breaker)."""
        schemes, all_keys = self._keys(ids, schemes, salt)
        present = {k: self.store.holds_locally(k) for keys in all_keys for k in keys}
        runs = _runs(schemes, all_keys, present)
        plan = Plan(runs, frozenset(k for _, keys in runs for k in keys), local_only=True)
        return plan if plan.n_chunks else None

    def _keys(self, ids: Sequence[int], schemes: Optional[Sequence[Scheme]],
              salt: str = "") -> Tuple[List[Scheme], List[List[str]]]:
        """The rungs to look up and each one's chunk keys for ``ids`` (under cache salt ``salt``)."""
        limit = reusable_chunks(len(ids), self.chunk_tokens)
        schemes = list(schemes or self.schemes)
        return schemes, [chunk_keys(ids, self.model_id, s.identity, self.chunk_tokens, max_chunks=limit, salt=salt)
                         for s in schemes]

    # -- choice ------------------------------------------------------------------------------
    def estimates(self, plan: Plan, index: int) -> List[Estimate]:
        self.costs.reload()
        out = []
        for scheme, key in plan.candidates(index):
            c = self.costs.rung(scheme.identity)
            t = self.chunk_tokens
            nbytes = c.bytes_per_token * t
            transfer = (self.costs.transfer_s(self.store.local_url, nbytes, LOCAL_PRIOR_MBPS) if key in plan.local
                        else self.costs.transfer_s(self.store.url, nbytes))
            out.append(Estimate(scheme, key, transfer, c.decode_s_per_token * t, c.restore_s_per_token * t))
        return out

    def _rank(self, estimates: List[Estimate], remaining: int, budget_s: Optional[float]) -> List[Estimate]:
        fastest = sorted(estimates, key=lambda e: e.stage_s)  # stable: ties keep ladder (quality) order
        if budget_s is None:
            return fastest
        fits = [e for e in estimates if e.stage_s * remaining <= budget_s]
        return fits + [e for e in fastest if e not in fits] if fits else fastest

    def _predict(self, plan: Plan, index: int) -> Tuple[float, float]:
        """(seconds to fetch, seconds to compute) the chunks from ``index`` on."""
        if index >= plan.n_chunks:
            return 0.0, 0.0
        remaining = plan.n_chunks - index
        # A chunk's estimates depend only on which rungs (and tiers) hold it: one estimate per set,
        # not one per remaining chunk (which made each request quadratic in its chunks).
        best: Dict[Tuple[Tuple[str, bool], ...], Estimate] = {}
        per_chunk: List[Estimate] = []
        for j in range(index, plan.n_chunks):
            rungs = tuple((scheme.identity, key in plan.local) for scheme, key in plan.candidates(j))
            if rungs not in best:
                best[rungs] = min(self.estimates(plan, j), key=lambda e: e.stage_s)
            per_chunk.append(best[rungs])
        last = per_chunk[-1]
        fetch_s = sum(e.stage_s for e in per_chunk) + last.decode_s + last.restore_s  # the pipeline drains
        return fetch_s, self.costs.prefill_s_per_token * remaining * self.chunk_tokens

    def _recompute_reason(self, plan: Plan, index: int) -> str:
        """Why the chunks from ``index`` on are better recomputed, or '' if fetching them is faster."""
        fetch_s, compute_s = self._predict(plan, index)
        if fetch_s <= compute_s:
            return ""
        return (f"recompute: fetching the last {plan.n_chunks - index} chunk(s) would take ~{fetch_s:.2f}s, "
                f"computing them ~{compute_s:.2f}s")

    def give_up_s(self, tokens: int) -> float:
        """How long a request may wait on the store in all, when ``tokens`` tokens are stored."""
        return min(self.timeout_s, GIVE_UP_SHARE * max(MIN_FAULT_S, self.costs.prefill_s_per_token * tokens))

    def _patience_s(self, plan: Plan, index: int) -> float:
        """How long to wait for chunk ``index``: past it, finishing the fetch is predicted slower
        than computing the rest."""
        compute_s = self._predict(plan, index)[1]
        after_s = self._predict(plan, index + 1)[0]
        return max(MIN_PATIENCE_S, compute_s - after_s)

    # -- fetch -------------------------------------------------------------------------------
    def fetch(self, ids: Sequence[int], session: str, reuse: bool = True,
              codecs: Optional[Sequence[str]] = None, salt: str = "") -> Iterator[Tuple[ChunkInfo, bytes]]:
        """``codecs``: rung specs for this request only (a static choice among them); ``salt``: the
        request's cache salt (only its tenant's chunks are looked up)."""
        t_request, t0 = time.time(), time.monotonic()
        adaptive = self.adaptive and not codecs
        self.costs.reload()
        plan, reason = None, "reuse disabled by the request"
        if reuse:
            reason = self.calls.gate(PROBE_WAIT_S)  # '' unless the store's breaker keeps it out
        store = self.calls.snapshot()  # the store's calls and breaker as this request came
        if reuse and not reason:
            longest = reusable_chunks(len(ids), self.chunk_tokens) * self.chunk_tokens
            lookup_by = t0 + (self.timeout_s if codecs else self.give_up_s(longest))
            try:
                schemes = parse_ladder(list(codecs), self.card) if codecs else None
                plan = self.plan(ids, schemes, lookup_by, salt)
            except StoreTimeout:
                reason = f"store lookup timed out: no answer within {lookup_by - t0:.2f}s"
            except KVCodecError as exc:
                reason = f"store lookup failed: {exc}"
        elif reuse and reason and hasattr(self.store, "holds_locally"):
            # the remote store is kept out; what this machine's tier holds is still read
            try:
                plan = self.plan_local(ids, parse_ladder(list(codecs), self.card) if codecs else None, salt)
            except KVCodecError as exc:
                reason = f"{reason}; local look-up failed: {exc}"
        if plan is None:
            info = ChunkInfo(session, 0, 0, status="none", reason=reason or "no stored prefix", store=store)
            info.t.update(request=t_request, sent=time.time())
            yield info, b""
            return
        n = plan.n_chunks
        give_up = self.timeout_s if codecs else self.give_up_s(n * self.chunk_tokens)
        store_by = t0 + give_up
        budget = (f"the fetch deadline of {self.timeout_s:g}s" if give_up >= self.timeout_s else
                  f"the request's store budget of {give_up:.2f}s (the predicted prefill of the prefix)")
        failed = False
        for i in range(n):
            info = ChunkInfo(session, i, n, token_start=i * self.chunk_tokens, tokens=self.chunk_tokens,
                             store=store if i == 0 else {})
            info.t["request"] = t_request
            info.t["fetch_start"] = time.time()
            data = b""
            if failed:
                info.fail("miss", "an earlier chunk failed")
            elif time.monotonic() >= store_by:
                info.fail("timeout", f"{budget} passed")
            elif adaptive and (why := self._recompute_reason(plan, i)):
                info.fail("recompute", why)
                self._probe_link(plan)
            else:
                wait_by, why = store_by, budget
                if adaptive and (patience := self._patience_s(plan, i)) < store_by - time.monotonic():
                    wait_by = time.monotonic() + patience
                    why = f"{patience:.2f}s, past which recomputing the rest is predicted faster"
                data = self._fetch_chunk(info, plan, i, adaptive, t_request, wait_by, why)
            failed = not info.ok
            info.t["sent"] = time.time()
            yield info, data

    def _fetch_chunk(self, info: ChunkInfo, plan: Plan, i: int, adaptive: bool, t_request: float,
                     deadline: float, why: str) -> bytes:
        """``why``: what ``deadline`` is, for the reason of a timeout."""
        if adaptive:
            estimates = self.estimates(plan, i)
            budget = self.deadline_s - (time.time() - t_request) if self.deadline_s > 0 else None
            ranked = self._rank(estimates, plan.n_chunks - i, budget)
            tries = [(e.scheme, e.key) for e in ranked]
            info.choice = "; ".join(e.describe() for e in ranked)
        else:
            tries = [(plan.scheme, plan.keys[i])]
        data = b""
        errors: List[str] = []
        t0 = time.perf_counter()
        for scheme, key in tries:
            info.scheme, info.scheme_id, info.key = scheme.name, scheme.identity, key
            t_get = time.perf_counter()
            try:
                if plan.local_only:  # on this thread: the pool may be full of the sick store's calls
                    data, tier = self.store.get_local(key), LOCAL
                else:
                    call = self.calls.submit(self._get, key, deadline=deadline)
                    data, tier = self.calls.wait([call], deadline, f"chunk {i}")[0]
                data = data or b""
            except StoreTimeout:
                errors.append(f"timeout: the store did not answer within {why}")
                break  # no time left for another rung
            except KVCodecError as exc:
                errors.append(f"error: store: {exc}")
                continue
            seconds = time.perf_counter() - t_get
            if data:
                info.tier = tier
                self._observe(len(data), seconds, url=self.store.local_url if tier == LOCAL else None)
                break
            errors.append("miss: chunk vanished from the store")
        info.s["fetch"] = time.perf_counter() - t0
        info.bytes = len(data)
        if not data:
            status, _, reason = errors[-1].partition(": ")
            info.fail(status, reason if len(errors) == 1 else f"{reason} (tried {len(errors)} rungs)")
        return data

    def _probe_link(self, plan: Plan) -> None:
        """Measure the link in the background when recomputing was chosen (see the module's docstring)."""
        now = time.monotonic()
        if now - self._link_probe_at < LINK_PROBE_EVERY_S or not self.calls.breaker.allow():
            return
        self._link_probe_at = now
        key = plan.candidates(0)[0][1]

        def measure():
            t = time.perf_counter()
            with call_deadline(time.monotonic() + LINK_PROBE_EVERY_S):
                data = getattr(self.store, "remote", self.store).get_range(key, 0, LINK_PROBE_BYTES)  # not a local tier
            if data:
                self._observe(len(data), time.perf_counter() - t, fresh=True)

        self.calls.submit(measure, deadline=now + LINK_PROBE_EVERY_S)

    def _get(self, key: str) -> Tuple[Optional[bytes], str]:
        """The chunk and the tier that served it (``REMOTE`` for a store without a local tier)."""
        tiered = getattr(self.store, "get_tiered", None)
        return tiered(key) if tiered else (self.store.get(key), REMOTE)

    def _observe(self, nbytes: int, seconds: float, fresh: bool = False, url: Optional[str] = None) -> None:
        """One transfer, recorded under ``url`` (the local tier's) or the store's."""
        try:
            self.costs.observe_transfer(url or self.store.url, nbytes, seconds, fresh=fresh)
        except OSError:
            pass  # a cost file we cannot write only makes estimates staler
