"""One request's load: restored chunks on their way into an engine's blocks, as they arrive.

The fetcher knows how many chunks it will stream when the first one's info arrives, so the engine
can take the request at once and load the chunks while later ones are still on the wire. A
``LoadSession`` is that hand-over, engine-neutral and thread-safe:

- producer side (the ``llm`` step, one call per chunk as the ensemble delivers it, any order):
  ``put(index, kv)`` keeps the chunk (a copy, finished on the device before ``put`` returns: the
  caller's buffer may be reused) and, once the
  engine has attached its blocks, writes it into them at once, in the producer's thread;
  ``fail(index, reason)``: chunk ``index`` will not come; the usable prefix ends before it;
- engine side: ``attach(pages, block_ids, start, tokens)`` once blocks exist for positions
  ``[start, start + tokens)`` (``start``: what the engine already holds, e.g. its device prefix
  cache; again after a finished load, e.g. for a preempted request's new blocks); the chunks kept so far are written in the caller's thread, later ones as they arrive;
  ``loaded`` (attached, settled and every write done), ``loaded_tokens`` (the end of the usable
  prefix: block-aligned when short of the plan), ``failed_block_ids()`` (the attached blocks past
  it: an engine that was promised them must recompute them, never reuse them);
- either side: ``settled`` (the usable prefix is final: every chunk before the first failure is in),
  ``wait_settled(timeout_s)``, ``bound_tokens`` (the most that can become usable), ``staged_tokens`` (the leading run kept so far: what can be used, final once ``settled``),
  ``reason`` and ``past_kv(host=False)`` (the leading run as one array, for dense engines and
  synchronous loads; ``host=True``: as numpy in host memory), ``sources()`` (the chunks kept: what a
  write still queued on a device stream reads, to be kept alive until that stream is past it).

Chunks may be numpy arrays or torch tensors on any device: a device tensor stays on its device from
the step that restored it into the engine's blocks (no host copy on the way), and ``past_kv`` of
device chunks is a device tensor.

``LoadSession.of(past_kv, chunk_tokens)`` makes a settled session from KV already in hand.
A chunk given twice or outside the plan raises ``ValueError``; a chunk that cannot be written into
the blocks (shape, dtype) counts as failed there, never as loaded.
"""
from __future__ import annotations

import logging
import threading
from typing import Dict, List, Optional, Sequence

import numpy as np

from .load import RequestLoad
from .pages import KVPages

log = logging.getLogger(__name__)


def _kept(kv):
    """A copy of a chunk that the session may keep: numpy stays numpy, torch stays on its device. A
    device copy is only queued when ``clone`` returns: it is waited for here (``copied``), so the
    caller's buffer (a Triton input, reused once ``execute`` returns) is never read after the call."""
    if isinstance(kv, np.ndarray):
        return np.array(kv, copy=True)
    clone = getattr(kv, "clone", None)
    if clone is None:
        raise ValueError(f"a chunk must be a numpy array or a torch tensor, got {type(kv).__name__}")
    kept = clone()
    if getattr(kept, "is_cuda", False):
        copied(kept)
    return kept


def copied(tensor) -> None:
    """Waits (this thread only) until the work queued so far on ``tensor``'s device's current stream,
    the copy that made ``tensor`` included, is done: an event recorded there, then synchronized."""
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    event.synchronize()


class LoadSession:
    def __init__(self, chunk_tokens: int, n_chunks: int, planned_tokens: Optional[int] = None) -> None:
        if chunk_tokens <= 0 or n_chunks < 0:
            raise ValueError(f"bad load session: chunk_tokens {chunk_tokens}, n_chunks {n_chunks}")
        self.chunk_tokens = chunk_tokens
        self.n_chunks = n_chunks
        self.planned_tokens = n_chunks * chunk_tokens if planned_tokens is None else int(planned_tokens)
        if not 0 <= self.planned_tokens <= n_chunks * chunk_tokens:
            raise ValueError(f"planned_tokens {self.planned_tokens} outside {n_chunks} chunk(s)")
        self._chunks: Dict[int, np.ndarray] = {}
        self._failed: Dict[int, str] = {}
        self._cond = threading.Condition()
        self._load: Optional[RequestLoad] = None
        self._start = 0
        self._block_ids: List[int] = []
        self._block_size = 1

    @classmethod
    def of(cls, past_kv: np.ndarray, chunk_tokens: int) -> "LoadSession":
        tokens = int(past_kv.shape[3])
        session = cls(chunk_tokens, -(-tokens // chunk_tokens), tokens)
        for i in range(session.n_chunks):
            session._chunks[i] = past_kv[:, :, :, i * chunk_tokens:(i + 1) * chunk_tokens]
        return session

    # -- producer ----------------------------------------------------------------------------------
    def put(self, index: int, kv) -> None:
        kv = _kept(kv)  # the caller's buffer (a Triton input) may be reused after the call
        with self._cond:
            self._check(index)
            self._chunks[index] = kv
            load = self._load
            self._cond.notify_all()
        if load is not None:
            self._write(load, index, kv)

    def fail(self, index: int, reason: str) -> None:
        with self._cond:
            self._check(index)
            self._failed[index] = reason or "failed"
            load = self._load
            self._cond.notify_all()
        if load is not None and self._covers(index):
            self._fail_load(load, index, reason or "failed")

    def _check(self, index: int) -> None:
        if not 0 <= index < self.n_chunks:
            raise ValueError(f"chunk {index} is outside the plan of {self.n_chunks} chunk(s)")
        if index in self._chunks or index in self._failed:
            raise ValueError(f"chunk {index} was already given")

    # -- either side -------------------------------------------------------------------------------
    def _run(self) -> int:
        run = 0
        while run in self._chunks:
            run += 1
        return run

    def _settled(self) -> bool:
        first_failed = min(self._failed, default=self.n_chunks)
        return all(i in self._chunks for i in range(first_failed))

    @property
    def settled(self) -> bool:
        with self._cond:
            return self._settled()

    def wait_settled(self, timeout_s: Optional[float] = None) -> bool:
        with self._cond:
            return self._cond.wait_for(self._settled, timeout_s)

    @property
    def staged_tokens(self) -> int:
        with self._cond:
            return min(self._run() * self.chunk_tokens, self.planned_tokens)

    @property
    def bound_tokens(self) -> int:
        """At most this many tokens can become usable: the plan, cut at the first failed chunk."""
        with self._cond:
            return min(self.planned_tokens, min(self._failed, default=self.n_chunks) * self.chunk_tokens)

    @property
    def reason(self) -> str:
        with self._cond:
            if not self._failed:
                return ""
            first = min(self._failed)
            return f"chunk {first}: {self._failed[first]}"

    def past_kv(self, host: bool = False):
        """The leading run of kept chunks as one array (float32 if any chunk is), or None: numpy, or a
        torch tensor where the chunks are (``host``: numpy in host memory either way)."""
        with self._cond:
            run = [self._chunks[i] for i in range(self._run())]
        if not run:
            return None
        if host or all(isinstance(c, np.ndarray) for c in run):
            run = [c if isinstance(c, np.ndarray) else c.detach().cpu().numpy() for c in run]
            dtype = np.result_type(*[c.dtype for c in run])
            kv = np.concatenate([c.astype(dtype, copy=False) for c in run], axis=3)
        else:
            import torch

            device = next(c.device for c in run if not isinstance(c, np.ndarray))
            run = [torch.from_numpy(c).to(device) if isinstance(c, np.ndarray) else c for c in run]
            dtype = torch.float32 if any(c.dtype == torch.float32 for c in run) else run[0].dtype
            kv = torch.cat([c.to(dtype) for c in run], dim=3)
        return kv[:, :, :, :self.planned_tokens]

    def sources(self) -> List:
        """The chunks kept so far (numpy or torch): what a queued write into the blocks reads from."""
        with self._cond:
            return list(self._chunks.values())

    # -- engine side -------------------------------------------------------------------------------
    def attach(self, pages: KVPages, block_ids: Sequence[int], start: int, tokens: int) -> None:
        """Blocks for positions ``[start, start + tokens)``; writes what is kept, then what comes."""
        end = start + tokens
        if start < 0 or tokens <= 0 or end > self.planned_tokens:
            raise ValueError(f"cannot load positions [{start}, {end}) of a {self.planned_tokens}-token plan")
        if start % pages.block_size:
            raise ValueError(f"a load must start on a block boundary ({pages.block_size}), got {start}")
        load = RequestLoad(pages, list(block_ids)[start // pages.block_size:], self.chunk_tokens, tokens,
                           offset=start)
        with self._cond:
            if self._load is not None and not (self._settled() and self._load.complete):
                raise ValueError("the session is attached to a load still in flight")
            self._load, self._start = load, start
            self._block_ids, self._block_size = [int(b) for b in block_ids], pages.block_size
            kept = sorted(self._chunks.items())
            failed = sorted(self._failed.items())
        for index, kv in kept:
            self._write(load, index, kv)
        for index, reason in failed:
            if self._covers(index):
                self._fail_load(load, index, reason)

    def _covers(self, index: int) -> bool:
        load = self._load
        return load is not None and load.covers(index)

    def _write(self, load: RequestLoad, index: int, kv: np.ndarray) -> None:
        if not load.covers(index):
            return
        try:
            load.put_chunk(index, kv)
        except (ValueError, RuntimeError) as exc:  # recorded as failed by RequestLoad
            log.warning("chunk %d could not be written into the engine's blocks: %s", index, exc)

    def _fail_load(self, load: RequestLoad, index: int, reason: str) -> None:
        try:
            load.fail_chunk(index, reason)
        except ValueError:
            pass  # already written or failed there

    @property
    def span(self) -> tuple:
        """``(start, end)``: the positions the attached load covers (``(0, 0)`` before ``attach``)."""
        load = self._load
        return (0, 0) if load is None else (load.offset, load.offset + load.planned_tokens)

    @property
    def attached(self) -> bool:
        with self._cond:
            return self._load is not None

    @property
    def loaded(self) -> bool:
        load = self._load
        return load is not None and self.settled and load.complete

    @property
    def loaded_tokens(self) -> int:
        """The end (a position) of what was written from the start of the load; ``start`` if nothing."""
        load = self._load
        return self._start if load is None else load.loaded_tokens

    def wait_loaded(self, timeout_s: Optional[float] = None) -> bool:
        load = self._load
        if load is None:
            raise ValueError("the session is not attached")
        return self.wait_settled(timeout_s) and load.wait(timeout_s)

    def failed_block_ids(self) -> List[int]:
        """The attached blocks at or after the first one not wholly loaded (once ``loaded``)."""
        load = self._load
        if load is None:
            return []
        end = load.offset + load.planned_tokens
        good = load.loaded_tokens
        first_bad, last = good // self._block_size, -(-end // self._block_size)
        return self._block_ids[first_bad:last] if good < end else []
