"""The local tier (``kvcodec.store.tiered``) below any server: two real file stores (the local one in
front of the "remote" one) and real chunk containers. A chunk read once is served locally after,
even with the remote copy gone; writes land in both; the tier's failures never fail a call; it keeps
to its size by cutting chains from the tail; the adaptive fetcher prices the tiers apart and a local
hit never moves the remote link's estimate. Against a real Redis behind a link and a real
``vllm serve``: tests/integration/test_vllm_serve.py."""
from __future__ import annotations

import threading
import time

import pytest

from kvcodec.errors import ConfigError, StoreUnavailable
from kvcodec.format.codecs import get_scheme
from kvcodec.serving.costs import CostModel
from kvcodec.serving.fetch import Fetcher
from kvcodec.settings import Settings
from kvcodec.store.breaker import Breaker
from kvcodec.store.fs import FileStore
from kvcodec.store.tiered import LOCAL, REMOTE, TieredStore, open_for_settings, with_local_tier

from .test_pipeline import CHUNK, MODEL, N_CHUNKS, assemble, context, encoded, ingest, through_steps  # noqa: F401  (module fixtures)
from .test_store_capacity import intact, store_chain

FP16_PER_TOKEN = 2 * 2 * 3 * 64 * 2  # the synthetic context: 2 layers, 3 heads, head_dim 64


@pytest.fixture
def tiers(tmp_path):
    local, remote = FileStore(tmp_path / "local"), FileStore(tmp_path / "remote")
    yield local, remote, TieredStore(local, remote, 1 << 30)


def test_a_chunk_read_once_is_served_locally_after_even_with_the_remote_copy_gone(tiers):
    local, remote, tiered = tiers
    keys = store_chain(remote, list(range(40)))
    data, tier = tiered.get_tiered(keys[0])
    assert tier == REMOTE and data == remote.get(keys[0]) and local.get(keys[0]) == data
    remote.delete(keys[0])
    assert tiered.get_tiered(keys[0]) == (data, LOCAL) and tiered.exists(keys[0])
    assert tiered.holds_locally(keys[0]) and not tiered.holds_locally(keys[1]) and tiered.exists(keys[1])
    assert tiered.get_range(keys[0], 0, 4) == data[:4]
    assert tiered.counts["local_hits"] == 1 and tiered.counts["remote_reads"] == 1
    assert tiered.url == remote.url and tiered.local_url == local.url


def test_writes_land_in_both_tiers_and_the_remote_answers_for_the_create(tiers):
    local, remote, tiered = tiers
    assert tiered.put("aa/bb", b"first") and remote.get("aa/bb") == b"first" == local.get("aa/bb")
    local.put("aa/cc", b"stale")
    assert not tiered.put("aa/bb", b"again")  # the remote held it: not created (chunk keys name content)
    assert tiered.put("aa/cc", b"fresh") and local.get("aa/cc") == b"fresh"  # a local copy is replaced
    tiered.delete("aa/bb")
    assert not local.exists("aa/bb") and not remote.exists("aa/bb")


class BrokenStore(FileStore):
    """A local tier on a disk that fails every call."""

    def get(self, *args):
        raise StoreUnavailable("disk gone")

    exists = put = get_range = delete = get


def test_a_failing_local_tier_only_loses_its_copies(tmp_path):
    remote = FileStore(tmp_path / "remote")
    keys = store_chain(remote, list(range(24)))
    tiered = TieredStore(BrokenStore(tmp_path / "local"), remote, 1 << 30)
    assert tiered.get_tiered(keys[0]) == (remote.get(keys[0]), REMOTE) and tiered.exists(keys[1])
    assert tiered.put("aa/bb", b"x") and remote.get("aa/bb") == b"x"
    assert tiered.counts["local_errors"] >= 3


class GatedStore(FileStore):
    """A local tier whose first listing waits, once taken, until the test lets it go: the keeps made
    meanwhile land after gc's listing, as a keep racing a gc run does, but every time."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.listed, self.go = threading.Event(), threading.Event()

    def scan(self):
        entries = list(super().scan())
        if not self.listed.is_set():
            self.listed.set()
            assert self.go.wait(30)
        return iter(entries)


def test_the_local_tier_keeps_to_its_size_by_cutting_chains_from_the_tail(tmp_path):
    """Deterministic: gc is joined after every read, so each chain's end is a point where the tier
    must be within its size. One chain is left in the local folder by an earlier process (the first
    keep measures it); the first gc run lists the folder while the rest of its chain is kept (those
    bytes count towards the size after it); a bound that misses either, or keeps to more than its
    size, fails here on every run."""
    local, remote = GatedStore(tmp_path / "local"), FileStore(tmp_path / "remote")
    chains = [store_chain(remote, list(range(100 * c, 100 * c + 48))) for c in range(4)]  # 4 chains, 6 chunks
    size = len(remote.get(chains[0][0]))
    for k in chains[0]:
        local.put(k, remote.get(k))  # left by an earlier process
    tiered = TieredStore(local, remote, 7 * size)

    def read(k):
        assert tiered.get(k)
        if tiered._gc is not None:
            tiered._gc.join(timeout=30)
            assert not tiered._gc.is_alive()

    assert tiered.get(chains[1][0])  # the first keep starts a gc run: it lists the folder, then waits
    assert local.listed.wait(30)
    for k in chains[1][1:]:
        assert tiered.get(k)  # kept while that run is between its listing and its deletions
    local.go.set()
    tiered._gc.join(timeout=30)
    for n, keys in enumerate(chains[1:], 1):
        for k in keys if n > 1 else ():
            read(k)
        held = {e.key for e in local.scan()}
        assert sum(e.size for e in local.scan()) <= 7 * size, (n, len(held))
        assert intact(held, chains) and keys[0] in held, n  # prefixes stay; the newest chain's head too
    assert tiered.counts["evicted"] > 0
    assert len({e.key for e in remote.scan()}) == 24  # the remote store keeps everything


def test_settings_name_the_local_tier(tmp_path):
    s = Settings.load({"home": str(tmp_path), "local_store": f"file://{tmp_path}/local", "local_store_mb": "3"}, env={})
    assert (s.local_store, s.local_store_mb) == (f"file://{tmp_path}/local", 3)
    assert Settings.load(env=s.environ()) == s
    store = open_for_settings(s)
    assert isinstance(store, TieredStore) and store.max_bytes == 3 << 20 and store.url == s.store
    plain = Settings.load({"home": str(tmp_path)}, env={})
    assert not isinstance(open_for_settings(plain), TieredStore) and plain.local_store == ""
    with pytest.raises(ConfigError, match="local_store"):
        Settings.load({"home": str(tmp_path), "local_store": "/dev/shm/x"}, env={})
    with pytest.raises(ConfigError, match="size"):
        with_local_tier(FileStore(tmp_path / "r"), f"file://{tmp_path}/l", 0)


class SlowStore(FileStore):
    """A remote store 50 ms away."""

    def get(self, key):
        time.sleep(0.05)
        return super().get(key)


def test_the_fetcher_prices_the_tiers_apart(tmp_path, context, encoded):  # noqa: F811
    """Raw chunk 0 is local: it comes from there (remotely the smaller rung wins); its transfer is
    recorded under the local tier's URL; once every chunk is local, the remote link's estimate stays."""
    ids, _ = context
    local, remote = FileStore(tmp_path / "local"), SlowStore(tmp_path / "remote")
    ingest(remote, encoded, "raw")
    ingest(remote, encoded, "int8-zstd")
    tiered = TieredStore(local, remote, 1 << 30)
    tiered.get(encoded["raw"][0][0])  # read once: now local
    costs = CostModel(None, 10.0, FP16_PER_TOKEN)  # a 10 Mbit/s link until measured
    for rung, nbytes in (("raw", FP16_PER_TOKEN * CHUNK), ("int8-zstd", FP16_PER_TOKEN * CHUNK // 2)):
        costs.observe_rung(get_scheme(rung).identity, CHUNK, nbytes, 0.0, 0.0)
    f = Fetcher(tiered, MODEL, ["int8-zstd", "raw"], CHUNK, costs=costs, adaptive=True)
    fetched = list(f.fetch(ids, "s"))
    assert [(i.scheme, i.tier) for i, _ in fetched] == [("raw", LOCAL)] + [("int8-zstd", REMOTE)] * (N_CHUNKS - 1)
    assert "s_per_byte" in costs.data["links"][local.url]
    remote_rate = costs.data["links"][remote.url]["s_per_byte"]
    done = assemble(through_steps(fetched))
    assert done.reused_tokens == N_CHUNKS * CHUNK
    assert done.stats().to_dict()["tiers"] == {"local": 1, "remote": N_CHUNKS - 1}
    again = list(f.fetch(ids, "t"))  # every chunk is local now, at the rung it was read at
    assert [(i.scheme, i.tier) for i, _ in again] == [("raw", LOCAL)] + [("int8-zstd", LOCAL)] * (N_CHUNKS - 1)
    assert costs.data["links"][remote.url]["s_per_byte"] == remote_rate
    f.close()


def test_while_the_remote_breaker_is_open_the_local_tier_is_still_read(tmp_path, context, encoded):  # noqa: F811
    """A remote store kept out by its breaker: the prefix this machine holds (chunks 0 and 1) is read
    from the local tier, on the request's thread; the rest is computed; the remote store is not called."""
    ids, _ = context
    local, remote = FileStore(tmp_path / "local"), FileStore(tmp_path / "remote")
    keys = ingest(remote, encoded, "int8-zstd")
    tiered = TieredStore(local, remote, 1 << 30)
    for k in keys[:2]:
        tiered.get(k)
    f = Fetcher(tiered, MODEL, ["int8-zstd"], CHUNK, costs=CostModel(None, 1000.0, FP16_PER_TOKEN),
                breaker=Breaker(cooldown_s=30))
    f.calls.breaker.failure("store down")
    for k in keys:
        remote.delete(k)  # were the remote store asked, nothing would be found there
    fetched = list(f.fetch(ids, "s"))
    assert [(i.index, i.tier) for i, _ in fetched] == [(0, LOCAL), (1, LOCAL)]
    assert fetched[0][0].store["breaker"] == "open"
    done = assemble(through_steps(fetched))
    assert done.reused_tokens == 2 * CHUNK
    plain = Fetcher(remote, MODEL, ["int8-zstd"], CHUNK, breaker=Breaker(cooldown_s=30))
    plain.calls.breaker.failure("store down")  # without a local tier: nothing is read
    [(info, _)] = list(plain.fetch(ids, "t"))
    assert info.count == 0 and "breaker" in info.reason
    f.close()
    plain.close()
