"""A sick store below Triton: the fetcher gives up when recomputing is predicted faster (the
store budget, the per-chunk patience), its calls run on a fixed counted pool, its breaker skips a
dead store and lets a healed one back, and a link estimate made too pessimistic heals."""
from __future__ import annotations

import threading
import time

import pytest

from kvcodec.errors import StoreUnavailable
from kvcodec.serving.calls import PROBE_KEY
from kvcodec.serving.costs import CostModel
from kvcodec.serving.fetch import PROBE_THREADS, Fetcher
from kvcodec.store.breaker import Breaker
from kvcodec.store.memory import MemoryStore

from .test_pipeline import CHUNK, MODEL, assemble, context, encoded, through_steps  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(60)
FP16_PER_TOKEN = 2 * 2 * 3 * 64 * 2  # the synthetic context's


class SickStore(MemoryStore):
    """A memory store holding the chunks, whose ``exists`` and ``get`` can hang (until released)
    or fail; counts the calls it gets."""

    def __init__(self, items) -> None:
        super().__init__(f"sick-{id(self)}")
        for key, data in items:
            self.put(key, data)
        self.hang_get, self.hang_exists, self.fail = set(), False, False
        self.release = threading.Event()
        self.calls = {"exists": 0, "get": 0}
        self.dropped = 0

    def drop_connections(self):
        self.dropped += 1

    def exists(self, key):
        self.calls["exists"] += 1
        if self.fail:
            raise StoreUnavailable("connection refused")
        if self.hang_exists:
            self.release.wait(30)
        return super().exists(key)

    def get(self, key):
        self.calls["get"] += 1
        if self.fail:
            raise StoreUnavailable("connection reset")
        if key in self.hang_get:
            self.release.wait(30)
        return super().get(key)


def costs(prefill_s_per_token: float) -> CostModel:
    c = CostModel(None, 1000.0, FP16_PER_TOKEN)
    c.observe_prefill(CHUNK, prefill_s_per_token * CHUNK)
    return c


@pytest.fixture
def sick(encoded):  # noqa: F811
    store = SickStore(encoded["int8-zstd"])
    yield store, [k for k, _ in encoded["int8-zstd"]]
    store.release.set()


def timed(f: Fetcher, ids):
    t0 = time.monotonic()
    fetched = list(f.fetch(ids, "s"))
    return fetched, time.monotonic() - t0


def test_a_hung_store_costs_at_most_the_budget_not_the_fetch_timeout(context, sick):  # noqa: F811
    """fetch_timeout_s is 20 s; the stored prefix (768 tokens) is predicted to prefill in 0.77 s,
    so the request gives the store 0.8 x max(2 s, 0.77 s) = 1.6 s, look-up or chunk alike."""
    ids, _ = context
    store, keys = sick
    store.hang_exists = True
    f = Fetcher(store, MODEL, ["int8-zstd"], CHUNK, costs=costs(1e-3), timeout_s=20.0,
                breaker=Breaker(cooldown_s=0.1))
    (info, _), = (fetched := timed(f, ids))[0]
    assert info.status == "none" and "store lookup timed out: no answer within 1.60s" in info.reason
    assert 1.5 < fetched[1] < 2.5, fetched[1]
    store.hang_exists, store.hang_get = False, {keys[0]}
    store.release.set()
    time.sleep(0.1)  # the breaker's cooldown: this request probes, finds the store answering, and goes on
    store.release.clear()
    fetched, took = timed(f, ids)
    assert [i.status for i, _ in fetched] == ["timeout", "miss", "miss"]
    assert "the request's store budget of 1.60s" in fetched[0][0].reason
    assert 1.5 < took < 2.5, took
    f.close()


def test_adaptive_stops_waiting_when_recomputing_the_rest_is_faster(context, sick):  # noqa: F811
    """Chunk 2 of 3 hangs: recomputing it is predicted at 256 x 4 ms = 1.02 s, so the wait on it
    ends then, before the request's store budget (0.8 x 3.07 s = 2.46 s)."""
    ids, _ = context
    store, keys = sick
    store.hang_get = {keys[2]}
    f = Fetcher(store, MODEL, ["int8-zstd"], CHUNK, costs=costs(4e-3), adaptive=True, timeout_s=20.0)
    fetched, took = timed(f, ids)
    f.close()
    assert [i.status for i, _ in fetched] == ["ok", "ok", "timeout"]
    assert "past which recomputing the rest is predicted faster" in fetched[2][0].reason
    assert 0.9 < took < 1.8, took
    assert assemble(through_steps(fetched)).reused_tokens == 2 * CHUNK


def test_the_breaker_skips_a_dead_store_at_once_and_a_probe_lets_it_back(context, sick):  # noqa: F811
    ids, _ = context
    store, _ = sick
    store.fail = True
    f = Fetcher(store, MODEL, ["int8-zstd"], CHUNK, costs=costs(1e-3), breaker=Breaker(cooldown_s=0.3))
    (first, _), = list(f.fetch(ids, "a"))
    assert first.status == "none" and "store lookup failed: connection refused" in first.reason
    assert first.store["breaker"] == "closed"
    calls = dict(store.calls)
    (skipped, _), = list(f.fetch(ids, "b"))  # within the cooldown: not a single store call
    assert "store skipped: its circuit breaker is open" in skipped.reason and "connection refused" in skipped.reason
    assert store.calls == calls and skipped.store["breaker"] == "open" and skipped.store["opened"] == 1
    assert store.dropped == 1  # the connections of the sick spell are not reused
    time.sleep(0.3)
    (probed, _), = list(f.fetch(ids, "c"))  # the store still dead: the probe fails, cooldown doubles
    assert "store skipped" in probed.reason and f.calls.breaker.cooldown_s == 0.6 and store.dropped == 2
    store.fail = False  # healed
    time.sleep(0.6)
    fetched = list(f.fetch(ids, "d"))  # the first request after the cooldown probes and reuses
    assert [i.status for i, _ in fetched] == ["ok"] * 3 and fetched[0][0].store["breaker"] == "closed"
    assert store.calls["exists"] > calls["exists"] + 2  # the probes and the look-up
    f.close()


def test_hung_calls_stay_in_the_fixed_pool_are_counted_and_released(context, sick):  # noqa: F811
    ids, _ = context
    store, keys = sick
    store.hang_get = set(keys)
    f = Fetcher(store, MODEL, ["int8-zstd"], CHUNK, costs=costs(1e-3), timeout_s=0.5,
                breaker=Breaker(cooldown_s=0.05))
    for session in "abc":
        fetched = list(f.fetch(ids, session))
        assert fetched[0][0].status in ("timeout", "none"), fetched[0][0]
        time.sleep(0.06)  # each request finds the breaker due a probe (which succeeds: exists answers)
    snap = f.calls.snapshot()
    assert snap["threads"] == PROBE_THREADS and 1 <= snap["abandoned"] == snap["running"] <= 3, snap
    assert len(f.calls._pool._threads) <= PROBE_THREADS
    store.release.set()  # the hung calls end: nothing stays counted
    deadline = time.monotonic() + 5
    while f.calls.snapshot()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert f.calls.snapshot() | {"opened": 0, "breaker": ""} == {
        "threads": PROBE_THREADS, "running": 0, "queued": 0, "abandoned": 0, "opened": 0, "breaker": ""}
    f.close()


def test_a_link_estimate_made_too_slow_heals_by_a_background_probe(context, sick):  # noqa: F811
    """A slow moment made the link look like 1 kB/s: the adaptive fetcher recomputes, and without a
    transfer nothing would correct that. Its link probe (a ranged read of the first chunk) does:
    the next request reuses."""
    ids, _ = context
    store, _ = sick
    c = costs(4e-3)
    c.observe_transfer(store.url, 1 << 20, 1000.0)  # 1 MB took 1000 s, once
    f = Fetcher(store, MODEL, ["int8-zstd"], CHUNK, costs=c, adaptive=True)
    first = list(f.fetch(ids, "a"))
    assert first[0][0].status == "recompute"
    deadline = time.monotonic() + 5
    while c.link(store.url)[0] < 1e6 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert c.link(store.url)[0] > 1e6  # measured again, and believed
    second = list(f.fetch(ids, "b"))
    assert [i.status for i, _ in second] == ["ok"] * 3
    f.close()


def test_the_probe_key_is_a_valid_key_that_is_never_stored(sick):
    store, _ = sick
    assert store.exists(PROBE_KEY) is False


def test_a_request_that_names_its_rungs_is_held_to_the_fetch_timeout_only(context, sick):  # noqa: F811
    """A benchmark's baseline asks for a rung however slow it is: no budget, no patience."""
    ids, _ = context
    store, keys = sick
    store.hang_get = {keys[0]}
    f = Fetcher(store, MODEL, ["int8-zstd"], CHUNK, costs=costs(1e-3), adaptive=True, timeout_s=2.5)
    t0 = time.monotonic()
    fetched = list(f.fetch(ids, "s", codecs=["int8-zstd"]))
    took = time.monotonic() - t0
    f.close()
    assert fetched[0][0].status == "timeout" and "the fetch deadline of 2.5s" in fetched[0][0].reason
    assert 2.4 < took < 3.5, took  # not the 1.6 s budget of a request the server chooses for
