"""The worker half of a KV connector, engine-neutral: loads into blocks, their completion, saves out.

An adapter (vLLM's ``KVConnectorBase_V1`` worker role, TensorRT-LLM's ``KvCacheConnectorWorker``)
translates its engine's calls to these; the pool is the engine's own memory seen as ``KVPages``.

``register(pages)``
    The engine's pool, once at start (``register_kv_caches``).
``load_now(load, stream=None)``
    A synchronous load (the engine computes from the loaded position in this very step): the
    session's chunks, all kept already, are written into ``load.block_ids`` in the caller's
    thread, on ``stream`` where the pool is on a GPU (the step's stream: ordered before its
    forward, no synchronize). Raises ``LoadFailed`` when fewer tokens than promised were written:
    for an engine that cannot be told of a failed load (TensorRT-LLM) a raise is the only move that
    never lets it compute over stale blocks; callers promise only KV that is already in hand, in the
    pool's dtype, shape and device, so only a device error can get here.
    The session's chunks (``LoadSession.sources``) are held (``inflight``) until an event recorded
    on ``stream`` after the writes says the device is past them: the engine's stream may run a
    whole forward behind the host, and a chunk freed before its copy ran would give its memory
    (the caching allocator's, on another stream) to the next staged prompt's bytes.
``load_or_defer(load, stream=None, request_id=None, tokens=0)`` / ``raise_deferred()``
    For an engine whose load call must never raise (TensorRT-LLM 1.2: a raise there ends its
    executor): ``load_now``, or, for a load that is gone (None) or fails, the reason logged and kept;
    ``raise_deferred`` raises them all as one ``LoadFailed`` later, where the engine fails the
    step's requests instead (its forward's layer hook).
``begin(load)``
    An asynchronous load (or a synchronous one whose writes may still be in flight): the load is
    followed until it is loaded; its session writes the chunks as they arrive.
``finished() -> Finished``
    Loads that ended since the last call (``ended``): ``done`` (the asynchronous ones, to report as received),
    ``failed_blocks`` (the promised blocks past what was written: an engine with a failed-load API,
    vLLM's ``get_block_ids_with_load_errors``, recomputes them), counted. A synchronous load's
    writes in flight are waited for here (settled when promised: nothing is fetched).
``save(jobs, sink_for, stream=None)``
    For each ``SaveJob`` the step completed, each chunk is gathered out of the blocks on ``stream``
    and copied to host memory without blocking the caller (``HostCopy``: pinned memory, a CUDA
    event; ``get()`` waits for it on the thread that encodes), then handed to ``sink_for(job)`` (a
    ``SaveSink``; None: the job is skipped). A sink's failure is logged, never raised into the step.

``release()``
    Drops the held sources whose stream is past their copies (``InFlight.release``); ``load_now``
    calls it too, so what is held is at most what the engine's stream has not reached.

``counters``: ``loads``, ``loaded_tokens``, ``short_loads``, ``saved_chunks``, ``dropped_chunks``,
``save_copy_s``.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional, Protocol, Sequence, Set, Tuple

import torch

from ..errors import KVCodecError
from .pages import KVPages
from .save import SaveJob
from .scheduler import Load

log = logging.getLogger("kvcodec.connector")


class LoadFailed(KVCodecError, RuntimeError):
    """A promised load did not write every promised token into the engine's blocks."""


class HostCopy:
    """A tensor's copy in host memory: a device tensor is copied into pinned memory on the current
    stream and a CUDA event marks its end (no synchronize where it starts); ``get()`` waits for the
    event and gives float32 numpy."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.event = None
        if kv.is_cuda:
            self.host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
            self.host.copy_(kv, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = kv

    def get(self):
        if self.event is not None:
            self.event.synchronize()
        return self.host.to(torch.float32).numpy()


class InFlight:
    """Tensors that device work queued on a stream still reads, kept alive until that work is done.

    ``hold(tensors, stream)`` records an event on ``stream`` (a ``torch.cuda.Stream``; None: the
    current stream) after the work that reads ``tensors`` was queued and keeps them with it; host
    tensors and numpy are not held (their copies are done when the call returns). ``release()``
    drops those whose event has completed (``query()``: never waits) and gives how many are still
    held; ``len()``. ``make_event`` makes the events (``torch.cuda.Event``; tests give a stand-in)
    and, given, holds whatever it is handed, device or not."""

    def __init__(self, make_event: Optional[Callable[[], object]] = None) -> None:
        self._make_event = make_event
        self._held: List[Tuple[object, list]] = []

    def hold(self, tensors: Sequence, stream=None) -> None:
        if self._make_event is None:
            tensors = [t for t in tensors if getattr(t, "is_cuda", False)]
            if not tensors:
                return
            event = torch.cuda.Event()
            event.record(stream if isinstance(stream, torch.cuda.Stream) else None)
        else:
            tensors = list(tensors)
            event = self._make_event()
            event.record(stream)
        self._held.append((event, tensors))

    def release(self) -> int:
        self._held = [(event, tensors) for event, tensors in self._held if not event.query()]
        return len(self._held)

    def __len__(self) -> int:
        return len(self._held)


class SaveSink(Protocol):
    def __call__(self, chunks: List[Tuple[int, int, HostCopy]]) -> Optional[int]:
        """Takes a request's chunks ``(index, token start, copy)``, never blocking on the store; the
        count accepted (None: all)."""


def on_stream(stream):
    """``torch.cuda.stream(stream)`` for a CUDA stream, else nothing."""
    if stream is not None and isinstance(stream, torch.cuda.Stream):
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()


@dataclass
class Finished:
    done: Set[Hashable] = field(default_factory=set)  # asynchronous loads to report as received
    failed_blocks: Set[int] = field(default_factory=set)  # promised blocks not written
    ended: List[Load] = field(default_factory=list)  # every load that ended (its session says how far)


class WorkerCore:
    def __init__(self) -> None:
        self.pages: Optional[KVPages] = None
        self.inflight = InFlight()
        self._loading: Dict[Hashable, Load] = {}
        self._deferred: List[str] = []  # loads that failed where the engine cannot be told (load_or_defer)
        self.counters = {"loads": 0, "loaded_tokens": 0, "short_loads": 0, "saved_chunks": 0, "dropped_chunks": 0,
                         "save_copy_s": 0.0}

    def register(self, pages: KVPages) -> None:
        self.pages = pages

    # -- loads ---------------------------------------------------------------------------------
    def load_now(self, load: Load, stream=None) -> int:
        if self.pages is None:
            raise LoadFailed(f"request {load.request_id}: no KV pool registered")
        end = load.start + load.tokens
        self.inflight.release()
        with on_stream(stream):
            try:
                load.session.attach(self.pages, load.block_ids, load.start, load.tokens)
            except Exception as exc:
                self.counters["short_loads"] += 1
                raise LoadFailed(f"request {load.request_id}: loading its promised tokens failed: {exc}") from exc
            finally:  # what was queued reads the chunks until the stream is past it, written or not
                self.inflight.hold(load.session.sources(), stream)
        written = load.session.loaded_tokens
        self._count(load, written)
        if not load.session.loaded or written < end:
            raise LoadFailed(f"request {load.request_id}: wrote {written - load.start} of {load.tokens} promised "
                             f"tokens ({load.session.reason or 'chunks missing'})")
        return written - load.start

    def load_or_defer(self, load: Optional[Load], stream=None, request_id: Hashable = None, tokens: int = 0) -> None:
        if load is None:
            return self._defer(f"request {request_id}: promised {tokens} tokens whose KV is gone")
        try:
            self.load_now(load, stream)
        except Exception as exc:  # LoadFailed, or anything else a write raised
            self._defer(str(exc) if isinstance(exc, LoadFailed) else
                        f"request {load.request_id}: loading its promised tokens failed: {exc}")

    def _defer(self, message: str) -> None:
        log.error("kvcodec connector: %s; the forward's requests are failed rather than computed over stale "
                  "blocks", message)
        self._deferred.append(message)

    def raise_deferred(self) -> None:
        if self._deferred:
            failed, self._deferred = self._deferred, []
            raise LoadFailed("; ".join(failed))

    def begin(self, load: Load) -> None:
        self._loading[load.request_id] = load

    def finished(self) -> Finished:
        out = Finished()
        for rid, load in list(self._loading.items()):
            session = load.session
            if not session.loaded:
                if load.asynchronous:
                    continue  # chunks still coming
                session.wait_loaded()  # settled when promised synchronously: only writes in flight
            del self._loading[rid]
            out.ended.append(load)
            if load.asynchronous:
                out.done.add(rid)
            self._count(load, session.loaded_tokens)
            bad = session.failed_block_ids()
            if bad:
                out.failed_blocks.update(bad)
                log.warning("request %s: loaded %d of %d promised tokens (%s): %d block(s) to recompute", rid,
                            session.loaded_tokens - load.start, load.tokens, session.reason, len(bad))
        return out

    def _count(self, load: Load, written: int) -> None:
        self.counters["loads"] += 1
        self.counters["loaded_tokens"] += max(0, written - load.start)
        if written < load.start + load.tokens:
            self.counters["short_loads"] += 1

    def release(self) -> int:
        """Drops the held load sources the device is done with; how many holds are left."""
        return self.inflight.release()

    @property
    def loading(self) -> int:
        return len(self._loading)

    # -- saves ---------------------------------------------------------------------------------
    def save(self, jobs: Sequence[SaveJob], sink_for: Callable[[SaveJob], Optional[SaveSink]], stream=None) -> None:
        for job in jobs:
            sink = sink_for(job)
            if sink is None or self.pages is None:
                continue
            t0 = time.perf_counter()
            with on_stream(stream):
                chunks = [(index, start, HostCopy(self.pages.read(job.block_ids, start, end - start)))
                          for index, start, end in job.chunks]
            self.counters["save_copy_s"] += time.perf_counter() - t0
            try:
                accepted = sink(chunks)
            except Exception:  # a sink's failure never fails the engine's step
                log.exception("saving the chunks of request %s failed", job.request_id)
                continue
            accepted = len(chunks) if accepted is None else int(accepted)
            self.counters["saved_chunks"] += accepted
            self.counters["dropped_chunks"] += len(chunks) - accepted
            if accepted < len(chunks):
                log.warning("request %s: write-back queue full, %d chunk(s) dropped", job.request_id,
                            len(chunks) - accepted)
