"""The write-back's own circuit breaker (``connector.sink.WriteBackSink``): a store that fails (here:
every call raises ``StoreUnavailable``, as a dead or hung store does at its timeout) is called once,
then kept out: the jobs after it are skipped without a call until the cooldown is over, when one job
probes it; a healed store closes the breaker and write-back stores again."""
from __future__ import annotations

from kvcodec.connector.save import ChunkSaver
from kvcodec.connector.sink import WriteBackSink
from kvcodec.errors import StoreUnavailable
from kvcodec.format.auth import ChunkAuth
from kvcodec.format.ladder import parse_ladder
from kvcodec.store.breaker import Breaker
from kvcodec.store.memory import MemoryStore

from .test_pipeline import CHUNK, MODEL, context  # noqa: F401  (fixture)

AUTH = ChunkAuth(b"k" * 32)


class SickStore(MemoryStore):
    """A memory store whose calls fail while ``dead``; every call is counted."""

    def __init__(self) -> None:
        super().__init__("sick-writeback")
        self.dead, self.calls = True, 0

    def _call(self) -> None:
        self.calls += 1
        if self.dead:
            raise StoreUnavailable("store down (test)")

    def exists(self, key: str) -> bool:
        self._call()
        return super().exists(key)

    def put(self, key: str, data: bytes, overwrite: bool = False) -> bool:
        self._call()
        return super().put(key, data, overwrite=overwrite)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_dead_store_is_called_once_then_skipped_until_a_probe_finds_it_healed(context):  # noqa: F811
    ids, kv = context
    store, clock = SickStore(), Clock()
    saver = ChunkSaver(store, MODEL, parse_ladder(["int8-zstd"]), CHUNK, auth=AUTH)
    sink = WriteBackSink(saver, max_pending=16, breaker=Breaker(cooldown_s=1.0, clock=clock))
    chunks = [(i, i * CHUNK, kv[:, :, :, i * CHUNK:(i + 1) * CHUNK]) for i in range(kv.shape[3] // CHUNK)]
    try:
        offer = sink.for_prompt(ids)
        assert offer(chunks) == len(chunks) and sink.flush(60)
        stats = sink.stats()
        # the first job's call failed; the others never reached the store
        assert store.calls == 1, store.calls
        assert stats["failed"] == 1 and stats["skipped"] == len(chunks) - 1 and stats["breaker"] == "open"

        store.dead = False
        assert offer(chunks[:1]) == 1 and sink.flush(60)
        assert store.calls == 1 and sink.stats()["skipped"] == len(chunks)  # still cooling down: no call

        clock.now += 1.5  # the cooldown is over: the next job is the probe, and it stores
        assert offer(chunks) == len(chunks) and sink.flush(60)
        stats = sink.stats()
        assert stats["breaker"] == "closed" and stats["written"] == len(chunks), stats
        assert all(store.exists(k) for k in saver.keys(ids, len(chunks) - 1))
    finally:
        sink.close()


def test_a_failed_probe_keeps_the_store_out_for_twice_as_long(context):  # noqa: F811
    ids, kv = context
    store, clock = SickStore(), Clock()
    breaker = Breaker(cooldown_s=1.0, clock=clock)
    sink = WriteBackSink(ChunkSaver(store, MODEL, parse_ladder(["int8-zstd"]), CHUNK, auth=AUTH), breaker=breaker)
    one = [(0, 0, kv[:, :, :, :CHUNK])]
    try:
        offer = sink.for_prompt(ids)
        for advance, calls in ((0.0, 1), (1.5, 2), (1.5, 2), (1.0, 3)):  # cooldown 1 s, then 2 s
            clock.now += advance
            assert offer(one) == 1 and sink.flush(60)
            assert store.calls == calls, (advance, store.calls)
        assert breaker.cooldown_s == 4.0 and sink.stats()["breaker"] == "open"
    finally:
        sink.close()


def test_a_probe_that_fails_before_the_store_leaves_it_out_and_the_next_job_probes(context):  # noqa: F811
    """A probe job that fails for its own reason (an encode error, before any store call) says
    nothing of the store: the breaker stays open (no job goes to a store nobody has seen heal) and
    the next job is the probe."""
    ids, kv = context
    store, clock = SickStore(), Clock()
    breaker = Breaker(cooldown_s=1.0, clock=clock)
    saver = ChunkSaver(store, MODEL, parse_ladder(["int8-zstd"]), CHUNK, auth=AUTH)
    sink = WriteBackSink(saver, breaker=breaker)
    one, broken = [(0, 0, kv[:, :, :, :CHUNK])], [(0, 0, "not a KV array")]
    try:
        offer = sink.for_prompt(ids)
        assert offer(one) == 1 and sink.flush(60) and breaker.state == "open" and store.calls == 1
        clock.now += 1.5
        assert offer(broken) == 1 and sink.flush(60)  # the probe's job fails in the sink, not the store
        assert store.calls == 1 and breaker.state == "open" and breaker.cooldown_s == 1.0
        assert offer(one) == 1 and sink.flush(60)  # at once, no new cooldown: it probes the (dead) store
        assert store.calls == 2 and breaker.cooldown_s == 2.0 and breaker.state == "open"
    finally:
        sink.close()
