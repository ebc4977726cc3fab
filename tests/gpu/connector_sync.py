"""The connector's GPU path never synchronizes the host with the device (TensorRT-LLM calls
``start_load_kv`` and ``wait_for_save`` on its executor thread: a synchronize there waits for the
step's forward). ``check(device)`` runs a load from staged device KV and a save into pinned host
memory on a side stream under ``torch.cuda.set_sync_debug_mode("error")``, then compares the data
(outside the checked region). On a CPU device (the dry run) the same calls run without the mode."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Tuple

import torch

from kvcodec.connector import KVPages, Load, LoadSession, WorkerCore

L, H, D, BS, CHUNK = 4, 3, 64, 32, 256


@contextlib.contextmanager
def _no_sync(device: str):
    if device != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check(device: str) -> Tuple[bool, Dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    pool = torch.zeros(64, L, 2, H * BS * D, dtype=torch.float16, device=device)
    pages = KVPages.from_trtllm(pool, L, H, BS, D)
    kv = torch.randn(L, 2, H, 2 * CHUNK, D, generator=gen).to(device=device, dtype=torch.float16)
    blocks = list(range(63, 63 - 2 * CHUNK // BS - 1, -1))
    core = WorkerCore()
    core.register(pages)
    saved: Dict[int, Any] = {}
    stream = torch.cuda.Stream() if device == "cuda" else None
    if device == "cuda":
        torch.cuda.synchronize()
    out: Dict[str, Any] = {"device": device, "sync_debug_mode": "error" if device == "cuda" else "off (CPU)"}
    try:
        with _no_sync(device):
            load = Load(1, LoadSession.of(kv, CHUNK), 0, 2 * CHUNK, False, blocks, {})
            core.load_now(load, stream)
            job = type("Job", (), {"request_id": 1, "block_ids": blocks, "chunks": [(1, CHUNK, 2 * CHUNK)]})()
            core.save([job], lambda j: (lambda chunks: saved.update((i, c) for i, _, c in chunks) or len(chunks)),
                      stream)
    except RuntimeError as exc:
        out["error"] = str(exc)[:300]
        return False, out
    back = saved[1].get()  # waits for the copy's event: outside the checked region
    if device == "cuda":
        torch.cuda.synchronize()
    out["load_equal"] = bool(torch.equal(pages.read(blocks, 0, 2 * CHUNK), kv))
    out["save_equal"] = bool((torch.from_numpy(back) == kv[:, :, :, CHUNK:].float().cpu()).all())
    return out["load_equal"] and out["save_equal"], out
