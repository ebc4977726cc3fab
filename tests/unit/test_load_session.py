"""The connector core's load session and save path: chunks loaded into an engine's blocks as they
arrive (before and after the blocks exist, out of order, from other threads), a failure that leaves
no promised block counted as loaded, and the one save tracker and chunk saver every engine uses."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvcodec.connector import ChunkSaver, HostCopy, KVPages, LoadSession, SaveTracker, WriteBackSink
from kvcodec.format.auth import ChunkAuth
from kvcodec.format.codecs import get_scheme
from kvcodec.serving.decode import ChunkDecoder
from kvcodec.serving.restore import restore
from kvcodec.store import open_store

torch.set_num_threads(1)

L, H, D, C, BS = 2, 2, 8, 32, 16
SENTINEL = -100.0


def kv(tokens: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.integers(-512, 512, (L, 2, H, tokens, D)) / 16).astype(np.float16)


def pool(blocks: int = 16):
    raw = torch.full((blocks, L, 2, H * BS * D), SENTINEL)
    return raw, KVPages.from_trtllm(raw, L, H, BS, D)


def test_chunks_before_and_after_attach_land_in_the_blocks_and_the_load_completes():
    full = kv(4 * C)
    raw, pages = pool()
    session = LoadSession(C, 4)
    blocks = [9, 3, 12, 0, 5, 7, 1, 2]  # 8 blocks of 16 = 128 tokens
    session.put(1, full[:, :, :, C:2 * C])  # before the blocks exist: kept
    assert session.staged_tokens == 0 and not session.settled  # chunk 0 not in yet
    session.attach(pages, blocks, 0, 4 * C - BS)  # one block left for the engine to compute
    assert not session.loaded
    session.put(0, full[:, :, :, :C])
    assert session.staged_tokens == 2 * C and session.loaded_tokens == 2 * C
    done = threading.Thread(target=lambda: [session.put(i, full[:, :, :, i * C:(i + 1) * C]) for i in (3, 2)])
    done.start()
    done.join()
    assert session.settled and session.loaded and session.wait_loaded(1)
    assert session.loaded_tokens == 4 * C - BS and session.failed_block_ids() == []
    got = pages.read(blocks, 0, 4 * C - BS).numpy()
    np.testing.assert_array_equal(got, full[:, :, :, :4 * C - BS].astype(np.float32))
    assert (raw[blocks[-1]] == SENTINEL).all()  # the block left to compute was not written


def test_a_chunk_that_fails_after_the_promise_names_every_block_past_the_good_prefix():
    full = kv(4 * C)
    _, pages = pool()
    session = LoadSession(C, 4)
    blocks = list(range(8))
    session.attach(pages, blocks, 0, 4 * C)
    session.put(0, full[:, :, :, :C])
    assert session.bound_tokens == 4 * C
    session.fail(2, "corrupt: bad tag")
    assert session.bound_tokens == 2 * C and not session.settled  # chunk 1 still coming
    session.put(1, full[:, :, :, C:2 * C])
    session.put(3, full[:, :, :, 3 * C:])  # after the failure: not loaded
    assert session.settled and session.loaded
    assert session.loaded_tokens == 2 * C and session.staged_tokens == 2 * C
    assert session.failed_block_ids() == [4, 5, 6, 7]  # the engine must recompute these, never reuse them
    assert "chunk 2: corrupt" in session.reason
    np.testing.assert_array_equal(session.past_kv(), full[:, :, :, :2 * C])


def test_a_chunk_that_does_not_fit_the_blocks_is_a_failed_load_not_a_loaded_one():
    _, pages = pool()
    session = LoadSession(C, 2)
    session.attach(pages, list(range(4)), 0, 2 * C)
    session.put(0, kv(C))
    session.put(1, np.zeros((L, 2, H + 1, C, D), np.float16))  # another model's geometry
    assert session.loaded and session.loaded_tokens == C and session.failed_block_ids() == [2, 3]


def test_a_load_after_the_engines_own_prefix_writes_only_past_it():
    full = kv(4 * C)
    raw, pages = pool()
    blocks = list(range(8))
    session = LoadSession(C, 4)
    for i in range(4):
        session.put(i, full[:, :, :, i * C:(i + 1) * C])
    session.attach(pages, blocks, 3 * BS, 4 * C - 3 * BS)  # the engine holds 3 blocks (48 tokens) itself
    assert session.loaded and session.loaded_tokens == 4 * C
    assert (raw[:3] == SENTINEL).all()  # its own blocks are never written
    np.testing.assert_array_equal(pages.read(blocks, 3 * BS, 4 * C - 3 * BS).numpy(),
                                  full[:, :, :, 3 * BS:].astype(np.float32))
    with pytest.raises(ValueError, match="block boundary"):
        LoadSession(C, 1).attach(pages, blocks, 5, 8)


def test_a_session_of_kv_in_hand_is_settled_and_keeps_mixed_dtypes_exact():
    a = kv(C)
    b = kv(C, 1).astype(np.float32)
    session = LoadSession(C, 2)
    session.put(0, a)
    session.put(1, b)
    past = session.past_kv()
    assert past.dtype == np.float32 and np.array_equal(past[:, :, :, :C], a.astype(np.float32))
    whole = LoadSession.of(kv(3 * C - 8), C)
    assert whole.settled and whole.staged_tokens == 3 * C - 8 and whole.n_chunks == 3
    with pytest.raises(ValueError, match="already given"):
        session.put(0, a)
    with pytest.raises(ValueError, match="outside"):
        session.fail(2, "x")


def test_save_tracker_returns_a_request_in_the_step_that_completes_its_chunks():
    tracker: SaveTracker = SaveTracker()
    tracker.track("r", [(1, 32, 64), (2, 64, 96)], replace=("k",))
    tracker.track("r", [(0, 0, 32)])  # tracked once
    tracker.add_blocks("r", [4, 5], replace=True)
    tracker.add_blocks("r", [6])
    assert tracker.step("r", 95) is None
    job = tracker.step("r", 96)
    assert job.chunks == [(1, 32, 64), (2, 64, 96)] and job.block_ids == [4, 5, 6] and job.extra["replace"] == ("k",)
    assert "r" not in tracker and tracker.step("r", 1000) is None


def test_chunk_saver_stores_each_rung_once_and_replaces_a_corrupt_copy(tmp_path):
    store = open_store(f"file://{tmp_path}")
    auth = ChunkAuth(b"k" * 32)
    schemes = [get_scheme("raw"), get_scheme("int8-zstd")]
    saver = ChunkSaver(store, "m", schemes, C, auth=auth)
    ids = list(range(3 * C))
    chunk = kv(C, 3)
    keys = saver.keys(ids, 1)
    assert len(keys) == 2 and keys[0] != keys[1]
    sink = WriteBackSink(saver)  # what every engine's worker hands its saved chunks to
    assert sink.for_prompt(ids)([(1, C, HostCopy(torch.from_numpy(chunk)))]) == 1
    assert sink.flush(30) and sink.stats()["stored"] == 1
    restored = restore(ChunkDecoder("m", auth=auth).decode(store.get(keys[0]), key=keys[0]))
    np.testing.assert_array_equal(restored, chunk)  # raw: exact, keys computed by the sink from the ids
    assert sink.stats()["written"] == 2 and sink.stats()["present"] == 0
    again = saver.save(keys, 1, C, chunk)
    assert (again.written, again.present) == (0, 2)  # present: not written again
    store.put(keys[1], b"garbage", overwrite=True)
    sink.corrupt.add(keys[1])  # a reader found it corrupt: the next save replaces it
    assert sink.for_prompt(ids)([(1, C, chunk)]) == 1 and sink.flush(30)
    assert store.get(keys[1]) != b"garbage" and keys[1] not in sink.corrupt
    assert store.get(keys[0]) is not None
    sink.close(5)


def test_torch_chunks_stay_torch_from_the_step_into_the_blocks():
    """Chunks that arrive as torch tensors (on a GPU: where kv_restore left them) are kept as torch
    tensors on their device, written into the pool from there, and ``past_kv`` is one too; only
    ``host=True`` makes numpy (the dense engine's path)."""
    full = torch.from_numpy(kv(2 * C).astype(np.float32))
    raw, pages = pool()
    session = LoadSession(C, 2)
    given = full[:, :, :, :C].clone()
    session.put(0, given)
    given.fill_(0)  # the caller's buffer is reused: the session kept its own copy
    session.put(1, full[:, :, :, C:])
    past = session.past_kv()
    assert isinstance(past, torch.Tensor) and torch.equal(past, full)
    host = session.past_kv(host=True)
    assert isinstance(host, np.ndarray) and np.array_equal(host, full.numpy())
    session.attach(pages, list(range(4)), 0, 2 * C)
    assert session.loaded and torch.equal(pages.read(list(range(4)), 0, 2 * C), full)
    with pytest.raises(ValueError, match="numpy array or a torch tensor"):
        LoadSession(C, 1).put(0, [[1.0]])


def test_write_back_prices_every_rung_it_stores_for_the_adaptive_ladder(tmp_path):
    """A rung that only write-back stores must be priced (size, decode and restore time on this
    machine) before any reader reads it: unpriced, it keeps the pessimistic prior and the ladder never
    picks it; its restore unpriced, a rung whose restore is slow (kvtc-w's inverse transform) ties
    with a faster one and wins by ladder order."""
    from kvcodec.serving.costs import PRIOR_DECODE_S_PER_TOKEN, CostModel

    store = open_store(f"file://{tmp_path / 'store'}")
    costs = CostModel(tmp_path / "costs.json")
    schemes = [get_scheme("raw"), get_scheme("int8-zstd")]
    saver = ChunkSaver(store, "m", schemes, C, auth=ChunkAuth(b"k" * 32), observe=costs.observe_rung)
    assert not any(costs.known(s.identity) for s in schemes)
    ids = list(range(2 * C))
    assert saver.save(saver.keys(ids, 0), 0, 0, kv(C, 5)).written == 2
    for s in schemes:
        assert costs.known(s.identity)
        rung = costs.rung(s.identity)
        assert 0 < rung.decode_s_per_token < PRIOR_DECODE_S_PER_TOKEN
        assert "restore_s_per_token" in costs.data["rungs"][s.identity] and rung.restore_s_per_token > 0
    raw, int8 = (costs.rung(s.identity).bytes_per_token for s in schemes)
    assert int8 < raw  # the sizes as stored
    assert CostModel(tmp_path / "costs.json").known(schemes[1].identity)  # shared through the home's file
