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

With ``offset`` (a block-aligned position, default 0) the load covers positions ``[offset, offset +
planned_tokens)`` of the request and ``block_ids`` start at the block holding ``offset``; chunks keep
their own grid (chunk ``i`` is positions ``[i*chunk_tokens, (i+1)*chunk_tokens)``): ``covers(i)``,
``put_chunk(i, kv)`` (a whole stored chunk; only its positions inside the load are written) and
``fail_chunk(i, reason)`` take such indices, and ``loaded_tokens`` is then a position (the end of the
usable prefix, ``offset`` if nothing loaded).
"""
from __future__ import annotations

import threading
from typing import Dict, Optional, Sequence, Tuple

from .pages import KVPages

_WRITING, _WRITTEN, _FAILED = "writing", "written", "failed"


class RequestLoad:
    def __init__(self, pages: KVPages, block_ids: Sequence[int], chunk_tokens: int, planned_tokens: int,
                 offset: int = 0) -> None:
        if chunk_tokens <= 0 or planned_tokens < 0 or offset < 0 or offset % pages.block_size:
            raise ValueError(f"bad load plan: chunk_tokens {chunk_tokens}, planned_tokens {planned_tokens}, "
                             f"offset {offset} (block size {pages.block_size})")
        self.pages = pages
        self.block_ids = list(block_ids)
        self.chunk_tokens = chunk_tokens
        self.planned_tokens = planned_tokens
        self.offset = offset
        # the chunk grid's indices (``put_chunk``) that meet [offset, offset + planned_tokens)
        self.first_chunk = offset // chunk_tokens
        self.end_chunk = -(-(offset + planned_tokens) // chunk_tokens) if planned_tokens else self.first_chunk
        self.n_chunks = self.end_chunk - self.first_chunk  # with offset 0: ceil(planned_tokens / chunk_tokens)
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
        if self.offset:
            raise ValueError("a load with an offset takes whole chunks of the grid: put_chunk")
        start = index * self.chunk_tokens
        needed = min(self.chunk_tokens, self.planned_tokens - start)
        if 0 <= index < self.n_chunks and (kv.ndim != 5 or kv.shape[3] < needed):
            with self._cond:
                self._check_index(index)
            self.fail(index, f"chunk of shape {tuple(kv.shape)} is short of {needed} tokens")
            raise ValueError(f"chunk {index} has shape {tuple(kv.shape)}: needs {needed} tokens on axis 3")
        return self._put_at(index, start, kv[:, :, :, :needed] if kv.ndim == 5 else kv)

    def _put_at(self, index: int, start: int, kv) -> bool:
        """Write ``kv`` (already cut to the load) at load position ``start`` as chunk ``index``."""
        with self._cond:
            self._check_index(index)
            failed = self._first_failed()
            if failed is not None and index > failed:
                return False  # past the usable prefix: not recorded, it does not count
            self._state[index] = _WRITING
        try:
            self.pages.write(self.block_ids, start, kv)
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

    # -- the chunk grid, with an offset ---------------------------------------------------------
    def covers(self, index: int) -> bool:
        return self.first_chunk <= index < self.end_chunk

    def _piece(self, index: int) -> Tuple[int, int]:
        """Positions ``[lo, hi)`` of grid chunk ``index`` that the load covers."""
        if not self.covers(index):
            raise ValueError(f"chunk {index} is outside the load's chunks [{self.first_chunk}, {self.end_chunk})")
        c = self.chunk_tokens
        return max(self.offset, index * c), min(self.offset + self.planned_tokens, (index + 1) * c)

    def put_chunk(self, index: int, kv) -> bool:
        lo, hi = self._piece(index)
        c = self.chunk_tokens
        if self.offset == 0:
            return self.put(index, kv)
        if kv.ndim != 5 or kv.shape[3] < hi - index * c:
            with self._cond:
                self._check_index(index - self.first_chunk)
            self.fail_chunk(index, f"chunk of shape {tuple(kv.shape)} is short of {hi - index * c} tokens")
            raise ValueError(f"chunk {index} has shape {tuple(kv.shape)}: needs {hi - index * c} tokens on axis 3")
        return self._put_at(index - self.first_chunk, lo - self.offset, kv[:, :, :, lo - index * c:hi - index * c])

    def fail_chunk(self, index: int, reason: str) -> None:
        self._piece(index)
        self.fail(index - self.first_chunk, reason)

    @property
    def loaded_tokens(self) -> int:
        with self._cond:
            run = 0
            while self._state.get(run) == _WRITTEN:
                run += 1
        if self.offset:  # on the chunk grid: the run ends at the end of its last chunk (a position)
            end = self.offset + self.planned_tokens
            tokens = end if run >= self.end_chunk - self.first_chunk else \
                max(self.offset, (self.first_chunk + run) * self.chunk_tokens)
            if tokens < end:
                tokens -= tokens % self.pages.block_size
            return max(tokens, self.offset)
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
