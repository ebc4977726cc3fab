"""The load of one request: restored chunks written into its blocks as they arrive.

``RequestLoad(pages, block_ids, chunk_tokens, planned_tokens)`` covers prompt tokens
``[0, planned_tokens)`` (``matched_tokens``: block-aligned, so it may end mid-chunk), that is chunks
``0 .. ceil(planned_tokens / chunk_tokens) - 1``. Chunks may arrive in any order, from any thread:

- ``put(index, kv) -> bool``: writes chunk ``index`` (``kv`` ``[layers, 2, kv_heads, >= needed,
  head_dim]``, torch or numpy) into the blocks at once, only its tokens below ``planned_tokens``.
  False (nothing written) for a chunk after a failed one: it can no longer be used;
- ``fail(index, reason)``: chunk ``index`` will not come; the usable prefix ends before it;
- ``loaded_tokens``: tokens of the leading run of written chunks, capped at ``planned_tokens``; when
  that is short of the plan, rounded down to the pool's block size;
- ``complete``: no write in flight, and every chunk that still counts (all of them, or those before
  the first failure) written or failed. Only then may the engine compute from ``loaded_tokens``:
  the blocks after it are the engine's again;
- ``reason``: why loading stopped short ('' if it did not); ``wait(timeout_s) -> bool``: until
  ``complete``.

A chunk ``put`` twice, or an index outside the plan, raises ``ValueError``.
"""
from __future__ import annotations

import threading
from typing import Dict, Optional, Sequence

from .pages import KVPages

_WRITING, _WRITTEN, _FAILED = "writing", "written", "failed"


class RequestLoad:
    def __init__(self, pages: KVPages, block_ids: Sequence[int], chunk_tokens: int, planned_tokens: int) -> None:
        if chunk_tokens <= 0 or planned_tokens < 0:
            raise ValueError(f"bad load plan: chunk_tokens {chunk_tokens}, planned_tokens {planned_tokens}")
        self.pages = pages
        self.block_ids = list(block_ids)
        self.chunk_tokens = chunk_tokens
        self.planned_tokens = planned_tokens
        self.n_chunks = -(-planned_tokens // chunk_tokens)
        self._state: Dict[int, str] = {}
        self._reasons: Dict[int, str] = {}
        self._cond = threading.Condition()

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.n_chunks:
            raise ValueError(f"chunk {index} is outside the plan of {self.n_chunks} chunk(s)")
        if index in self._state:
            raise ValueError(f"chunk {index} was already {self._state[index]}")

    def _first_failed(self) -> Optional[int]:
        return min(self._reasons, default=None)

    def put(self, index: int, kv) -> bool:
        with self._cond:
            self._check_index(index)
            failed = self._first_failed()
            if failed is not None and index > failed:
                return False  # past the usable prefix: not recorded, it does not count
            self._state[index] = _WRITING
        start = index * self.chunk_tokens
        needed = min(self.chunk_tokens, self.planned_tokens - start)
        try:
            if kv.ndim != 5 or kv.shape[3] < needed:
                raise ValueError(f"chunk {index} has shape {tuple(kv.shape)}: needs {needed} tokens on axis 3")
            self.pages.write(self.block_ids, start, kv[:, :, :, :needed])
        except BaseException as exc:
            with self._cond:
                self._state[index] = _FAILED
                self._reasons[index] = f"write failed: {exc}"
                self._cond.notify_all()
            raise
        with self._cond:
            self._state[index] = _WRITTEN
            self._cond.notify_all()
        return True

    def fail(self, index: int, reason: str) -> None:
        with self._cond:
            self._check_index(index)
            self._state[index] = _FAILED
            self._reasons[index] = reason or "failed"
            self._cond.notify_all()

    @property
    def loaded_tokens(self) -> int:
        with self._cond:
            run = 0
            while self._state.get(run) == _WRITTEN:
                run += 1
        tokens = min(run * self.chunk_tokens, self.planned_tokens)
        if tokens < self.planned_tokens:
            tokens -= tokens % self.pages.block_size
        return tokens

    def _complete(self) -> bool:
        if _WRITING in self._state.values():
            return False
        failed = self._first_failed()
        end = self.n_chunks if failed is None else failed
        return all(i in self._state for i in range(end))

    @property
    def complete(self) -> bool:
        with self._cond:
            return self._complete()

    @property
    def reason(self) -> str:
        with self._cond:
            failed = self._first_failed()
            return "" if failed is None else f"chunk {failed}: {self._reasons[failed]}"

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        with self._cond:
            return self._cond.wait_for(self._complete, timeout_s)
