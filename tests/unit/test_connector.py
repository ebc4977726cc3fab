"""The engine-neutral connector core: pool views, token plans, per-request loads, write-back, lookup.

Each pool layout is checked against raw memory arithmetic written here, independently of
``KVPages``: a flat offset per (block, K|V, head, slot, dim) of the engine's own tensor.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvcodec.connector import (
    KVPages,
    RequestLoad,
    WriteBack,
    chunks_to_save,
    matched_tokens,
    stored_prefix,
)
from kvcodec.errors import Unsupported

torch.set_num_threads(1)

L, H, D, CHUNK = 2, 2, 8, 256
SENTINEL = -100.0  # outside the values of chunk_kv


def chunk_kv(tokens: int = 600, seed: int = 0) -> np.ndarray:
    """A prompt's restored KV, float16 (as chunks come back), values exact in float16."""
    rng = np.random.default_rng(seed)
    return (rng.integers(-512, 512, (L, 2, H, tokens, D)) / 16).astype(np.float16)


# Per layout: (the engine's tensors, how to view them, the flat offset of (layer, block, k, head, slot, dim)).
def make_pool(layout: str, nb: int, bs: int, dtype=torch.float32):
    if layout == "trtllm":
        raw = torch.full((nb, L, 2, H * bs * D), SENTINEL, dtype=dtype)
        pages = KVPages.from_trtllm(raw, L, H, bs, D)
        return [raw], pages, lambda l, b, k, h, s, j: (((b * L + l) * 2 + k) * H * bs * D) + (h * bs + s) * D + j
    shapes = {"cpu_attn": (nb, H, bs, 2 * D), "token_kv": (nb, H, bs, 2 * D), "flash_attn": (2, nb, bs, H, D),
              "flashinfer": (nb, 2, bs, H, D), "flashinfer_hnd": (nb, 2, H, bs, D)}
    raws = [torch.full(shapes[layout], SENTINEL, dtype=dtype) for _ in range(L)]
    tensors = [r.permute(0, 1, 3, 2, 4) if layout == "flashinfer_hnd" else r for r in raws]
    name = {"flashinfer_hnd": None, "token_kv": "token_kv"}.get(layout)
    pages = KVPages.from_vllm(tensors, H, D, block_size=bs, layout=name)
    offsets = {
        # per (block, head): K transposed ([dim, bs]: measured on vLLM 0.32's CPU kernel), then V [bs, dim]
        "cpu_attn": lambda l, b, k, h, s, j: (b * H + h) * bs * 2 * D + k * bs * D
        + np.where(k == 0, j * bs + s, s * D + j),
        "token_kv": lambda l, b, k, h, s, j: ((b * H + h) * bs + s) * 2 * D + k * D + j,
        "flash_attn": lambda l, b, k, h, s, j: (((k * nb + b) * bs + s) * H + h) * D + j,
        "flashinfer": lambda l, b, k, h, s, j: (((b * 2 + k) * bs + s) * H + h) * D + j,
        "flashinfer_hnd": lambda l, b, k, h, s, j: (((b * 2 + k) * H + h) * bs + s) * D + j,
    }
    return raws, pages, offsets[layout]


def expected_memory(raws, offset, kv: np.ndarray, block_ids, bs: int):
    """The engine's tensors after ``kv`` (positions 0..n-1) lands in ``block_ids``: by raw offsets."""
    flats = [np.full(r.numel(), SENTINEL, dtype=np.float32) for r in raws]
    n = kv.shape[3]
    p = np.arange(n)[None, None, :, None]
    b = np.asarray(block_ids)[p // bs]
    k = np.arange(2)[:, None, None, None]
    h = np.arange(H)[None, :, None, None]
    j = np.arange(D)[None, None, None, :]
    for layer in range(L):
        flat = flats[0] if len(raws) == 1 else flats[layer]
        flat[offset(layer, b, k, h, p % bs, j)] = kv[layer].astype(np.float32)
    return flats


LAYOUTS = ["cpu_attn", "token_kv", "flash_attn", "flashinfer", "flashinfer_hnd", "trtllm"]


@pytest.mark.parametrize("bs", [16, 32, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_lands_where_the_engine_reads_and_nowhere_else(layout, bs):
    prompt = 600  # chunks of 256, 256, 88: a partial last chunk and a partial last block
    needed = -(-prompt // bs)
    nb = needed * 2 + 3
    block_ids = np.random.default_rng(bs).permutation(nb)[:needed].tolist()  # shuffled, not contiguous
    raws, pages, offset = make_pool(layout, nb, bs)
    assert (pages.layers, pages.num_blocks, pages.block_size, pages.kv_heads, pages.head_dim, pages.dtype) == (
        L, nb, bs, H, D, torch.float32)
    kv = chunk_kv(prompt)
    for i in (2, 0, 1):  # out of order, float16 chunks into a float32 pool
        pages.write(block_ids, i * CHUNK, kv[:, :, :, i * CHUNK:(i + 1) * CHUNK])
    want = expected_memory(raws, offset, kv, block_ids, bs)
    for raw, flat in zip(raws, want, strict=True):
        np.testing.assert_array_equal(raw.contiguous().view(-1).numpy(), flat)
    back = pages.read(block_ids, 0, prompt)
    assert back.dtype == torch.float32 and back.shape == (L, 2, H, prompt, D)
    np.testing.assert_array_equal(back.numpy(), kv.astype(np.float32))
    np.testing.assert_array_equal(pages.read(block_ids, 300, 50).numpy(), kv[:, :, :, 300:350].astype(np.float32))


def test_vllm_backends_read_back_what_was_written():
    """Where vLLM 0.32's kernels read each token's K and V: the CPU kernel K transposed per
    (block, head), then V; FlashAttention rows [K|V] (flash_attn.py's own slicing)."""
    kv = torch.from_numpy(chunk_kv(40).astype(np.float32))
    ids = [3, 0, 5]
    (cpu, _), pages, _ = make_pool("cpu_attn", 6, 16)
    pages.write(ids, 0, kv)
    halves = cpu.view(6, H, 2, 16 * D)
    k_cache = halves[:, :, 0].reshape(6, H, D, 16).transpose(2, 3)  # [blocks, heads, bs, dim]
    v_cache = halves[:, :, 1].reshape(6, H, 16, D)
    (fa, _), pages, _ = make_pool("token_kv", 6, 16)
    pages.write(ids, 0, kv)
    k_fa, v_fa = fa.transpose(1, 2).split(D, dim=-1)  # [blocks, bs, heads, dim] each
    for p in (0, 17, 39):
        b, s = ids[p // 16], p % 16
        assert torch.equal(k_cache[b, :, s], kv[0, 0, :, p]) and torch.equal(v_cache[b, :, s], kv[0, 1, :, p])
        assert torch.equal(k_fa[b, s], kv[0, 0, :, p]) and torch.equal(v_fa[b, s], kv[0, 1, :, p])


def test_float16_pool_from_torch_float32_and_read_only_numpy():
    raws, pages, _ = make_pool("flashinfer", 8, 16, dtype=torch.float16)
    kv = chunk_kv(40)
    ro = kv.astype(np.float32)
    ro.flags.writeable = False
    pages.write([5, 1, 7], 0, ro)
    pages.write([5, 1, 7], 0, torch.from_numpy(kv.astype(np.float32)))
    assert pages.read([5, 1, 7], 0, 40).dtype == torch.float16
    np.testing.assert_array_equal(pages.read([5, 1, 7], 0, 40).numpy(), kv)


def test_write_checks_before_writing():
    raws, pages, _ = make_pool("flash_attn", 4, 16)
    kv = chunk_kv(32)
    for bad_ids, start in (([0, 9], 0), ([0], 0), ([2, 2], 0), ([0, 1], -1)):
        with pytest.raises(ValueError):
            pages.write(bad_ids, start, kv)
    with pytest.raises(ValueError, match="does not fit"):
        pages.write([0, 1], 0, kv[:, :, :1])
    with pytest.raises(ValueError, match="floating"):
        pages.write([0, 1], 0, kv.astype(np.int32))
    assert all((r == SENTINEL).all() for r in raws)
    pages.write([3, 1], 16, kv[:, :, :, :16])  # the second block only; the first id is never used
    assert (raws[0][:, 3] == SENTINEL).all() and not (raws[0][:, 1] == SENTINEL).all()


def test_unknown_ambiguous_and_non_contiguous_layouts_are_unsupported():
    with pytest.raises(Unsupported, match=r"\(3, 5, 16, 2, 8\)"):
        KVPages.from_vllm([torch.zeros(3, 5, 16, 2, 8)], H, D)
    with pytest.raises(Unsupported, match="several"):
        KVPages.from_vllm([torch.zeros(2, 2, 16, H, D)], H, D)  # FlashAttention or FlashInfer of 2 blocks
    with pytest.raises(Unsupported, match="fits no"):
        KVPages.from_vllm([torch.zeros(4, H, 16, 2 * D)], H, D, block_size=32)
    strided = torch.zeros(4, H, 16, 4 * D)[..., : 2 * D]  # rows padded: not contiguous
    with pytest.raises(Unsupported, match="contiguous"):
        KVPages.from_vllm([strided], H, D)
    with pytest.raises(Unsupported, match="TensorRT-LLM"):
        KVPages.from_trtllm(torch.zeros(4, L, 2, H * 16 * D), L, H, 32, D)
    with pytest.raises(Unsupported, match="unknown"):
        KVPages.from_vllm([torch.zeros(4, H, 16, 2 * D)], H, D, layout="nhd")


# -- RequestLoad -----------------------------------------------------------------------------
def _load(planned: int, bs: int = 16, nb: int = 80):
    raws, pages, _ = make_pool("flashinfer", nb, bs)
    ids = list(range(nb - 1, nb - 1 - (-(-planned // bs)), -1))
    return raws, pages, ids, RequestLoad(pages, ids, CHUNK, planned)


def test_load_out_of_order_ends_mid_chunk():
    kv = chunk_kv(768)
    raws, pages, ids, load = _load(592)  # block-aligned match ending inside chunk 2
    assert load.put(2, kv[:, :, :, 512:768])  # the whole chunk arrives; only 80 tokens are planned
    assert load.loaded_tokens == 0 and not load.complete
    load.put(0, kv[:, :, :, :256])
    assert load.loaded_tokens == 256
    load.put(1, kv[:, :, :, 256:512])
    assert load.complete and load.wait(0) and load.loaded_tokens == 592 and load.reason == ""
    np.testing.assert_array_equal(pages.read(ids, 0, 592).numpy(), kv[:, :, :, :592].astype(np.float32))
    written = 2 * H * 592 * D * L
    assert sum(int((r != SENTINEL).sum()) for r in raws) == written  # nothing past token 592
    with pytest.raises(ValueError, match="already"):
        load.put(0, kv[:, :, :, :256])
    with pytest.raises(ValueError, match="outside"):
        load.put(3, kv[:, :, :, :256])


def test_load_failed_middle_chunk_shortens_the_prefix():
    kv = chunk_kv(768)
    raws, pages, ids, load = _load(768)
    load.put(0, kv[:, :, :, :256])
    load.fail(1, "corrupt: checksum")
    assert not load.put(2, kv[:, :, :, 512:])  # past the failure: not written
    assert load.complete and load.loaded_tokens == 256 and "corrupt" in load.reason
    assert sum(int((r != SENTINEL).sum()) for r in raws) == 2 * H * 256 * D * L


def test_load_failure_rounds_down_to_blocks_and_threads_may_put():
    kv = chunk_kv(768)
    _, pages, ids, load = _load(768, bs=96, nb=20)  # 256 is not a multiple of 96
    threads = [threading.Thread(target=load.put, args=(0, kv[:, :, :, :256]))]
    threads.append(threading.Thread(target=load.fail, args=(1, "miss")))
    for t in threads:
        t.start()
    assert load.wait(5)
    for t in threads:
        t.join()
    assert load.loaded_tokens == 192


# -- plan ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stored, prompt, bs, computed, want", [
    (512, 600, 16, 0, 512),
    (768, 600, 16, 0, 592),  # stored >= prompt: 599 usable, block-aligned
    (768, 600, 128, 0, 512),
    (512, 512, 16, 0, 496),  # one prompt token is left to compute
    (512, 600, 32, 128, 384),
    (512, 600, 32, 600, 0),
    (0, 600, 16, 0, 0),
    (256, 1, 16, 0, 0),
    (256, 0, 16, 0, 0),
])
def test_matched_tokens(stored, prompt, bs, computed, want):
    got = matched_tokens(stored, prompt, bs, computed)
    assert got == want and (got + computed < prompt or got == 0)


def test_plan_rejects_bad_numbers():
    with pytest.raises(ValueError):
        matched_tokens(10, 20, 0)
    with pytest.raises(ValueError):
        matched_tokens(-1, 20, 16)
    with pytest.raises(ValueError):
        chunks_to_save(10, 0, 0)


def test_chunks_to_save_and_stored_prefix():
    assert chunks_to_save(600, 0, 256) == [(0, 0, 256), (1, 256, 512)]
    assert chunks_to_save(600, 256, 256) == [(1, 256, 512)]
    assert chunks_to_save(600, 300, 256) == [(1, 256, 512)]  # chunk 1 only partly reused
    assert chunks_to_save(600, 512, 256) == [] and chunks_to_save(255, 0, 256) == []
    assert chunks_to_save(2048, 0, 256, max_chunks=3) == [(0, 0, 256), (1, 256, 512), (2, 512, 768)]
    assert stored_prefix([True, True, False, True], 256) == 512 and stored_prefix([], 256) == 0


# -- WriteBack -------------------------------------------------------------------------------
def test_writeback_drops_when_full_counts_failures_and_flushes():
    gate, started, done = threading.Event(), threading.Event(), []

    def store(job):
        if job == "first":
            started.set()
            assert gate.wait(5)
        if job == "bad":
            raise RuntimeError("store down")
        done.append(job)

    wb = WriteBack(store, max_pending=2)
    try:
        assert wb.offer("first") and started.wait(5)  # the worker holds "first"
        assert wb.offer("bad") and wb.offer("b")
        assert not wb.offer("c")  # two wait already
        assert wb.stats()["pending"] == 3 and not wb.flush(0.01)
        gate.set()
        assert wb.flush(5)
        s = wb.stats()
        assert (s["queued"], s["stored"], s["dropped"], s["failed"], s["pending"]) == (3, 2, 1, 1, 0)
        assert s["busy_s"] > 0 and done == ["first", "b"]
    finally:
        gate.set()
        assert wb.close(5)
    assert not wb.offer("late") and wb.stats()["dropped"] == 2


def test_writeback_counts_become_metric_increments_summed_over_queues():
    from kvcodec.connector import Increments, merged

    inc = Increments()
    assert inc.since({"queued": 3, "stored": 2, "dropped": 1, "failed": 1}) == \
        {"queued": 3, "stored": 2, "dropped": 1, "failed": 1, "skipped": 0}
    assert inc.since({"queued": 5, "stored": 2, "dropped": 1, "failed": 3, "skipped": 1}) == \
        {"queued": 2, "stored": 0, "dropped": 0, "failed": 2, "skipped": 1}  # two puts the store refused
    assert inc.since({"queued": 1, "stored": 1, "dropped": 0, "failed": 0})["queued"] == 1  # a new queue
    both = merged([{"queued": 2, "failed": 1, "pending": 1, "busy_s": 0.5}, {"queued": 1, "stored": 1}])
    assert both == {"queued": 3, "stored": 1, "dropped": 0, "failed": 1, "skipped": 0, "written": 0, "present": 0,
                    "pending": 1, "busy_s": 0.5}
    chunks = Increments(("written", "present"))  # the sink's chunk copies, kvcodec_writeback_chunks_total
    assert chunks.since({"queued": 9, "written": 2, "present": 1}) == {"written": 2, "present": 1}
    assert chunks.since({"written": 2, "present": 4}) == {"written": 0, "present": 3}


# -- lookup ----------------------------------------------------------------------------------
