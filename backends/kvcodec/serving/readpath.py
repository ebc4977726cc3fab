"""The ensemble's read path in one process, for a connector that reads the store itself (``vllm
serve`` with ``KVCodecConnector``): the same steps, chunk by chunk, in the order the ensemble runs
them, and the same objects: ``Fetcher.fetch`` (kv_fetch: the plan, the adaptive rung per chunk over
the measured link, recompute when faster, the store's breaker and deadlines), ``DecodeStep``
(kv_decode: verification with the chunk key, the isolated decoder), ``RestoreStep`` (kv_restore)
and ``Assembler`` (the llm step: the request's ``connector.LoadSession``, filled as chunks arrive).

``ReadPath(reads)`` (``reads``: the deployment's ``kvcodec.compose.Reads``: store, local tier, fetcher,
chunk key, re-signing, cost model); ``start(ids) -> Reading`` returns at once: a background thread runs
the request's read; ``Reading.ready`` is set once the first chunk's info is in (the plan is known:
``Reading.chunks`` holds the ``LoadSession`` that later chunks stream into, or ``Reading.chunks`` is
None and ``Reading.reason`` says why nothing is read). ``Reading.stats()`` once done: the request's
``RequestStats`` (the costs file learns each chunk's decode and restore time, as after an ensemble
request, and ``observer``, if given, is called with it: the connector's metrics).
``counters``: ``reads``, ``planned_tokens``, ``loaded_chunks``, ``failed``.
"""
from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Optional, Sequence

from .assemble import Assembler, Chunks
from .costs import record_request
from .restore import RestoreStep

log = logging.getLogger("kvcodec.readpath")


class Reading:
    """One request's read, as the connector sees it."""

    def __init__(self) -> None:
        self.ready = threading.Event()  # the plan is known (or nothing will be read)
        self.done = threading.Event()  # every chunk delivered or failed
        self.chunks: Optional[Chunks] = None
        self.reason = ""

    @property
    def session(self):
        return self.chunks.session if self.chunks is not None else None

    def stats(self):
        return self.chunks.assembled(with_kv=False).stats() if self.chunks is not None and self.done.is_set() else None


class ReadPath:
    def __init__(self, reads, workers: int = 2, observer: Optional[Callable[[object], None]] = None) -> None:
        self.reads, self.observer = reads, observer
        self.settings, self.card = reads.settings, reads.card
        self.store, self.costs, self.fetcher = reads.store, reads.costs, reads.fetcher
        self.resigner = reads.resigner  # chunks a previous key verified are signed again (a key rotating)
        self.decode = reads.decode_step()
        self.restore = RestoreStep()
        self.assembler = Assembler()
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="kv-read")
        self._lock = threading.Lock()
        # one decode and restore at a time: the decoders keep state that two threads must not share
        # (a zstd decompressor gave "Data corruption detected" with four reads at once)
        self._decoding = threading.Lock()
        self.counters: Dict[str, int] = {"reads": 0, "planned_tokens": 0, "loaded_chunks": 0, "failed": 0}

    def start(self, ids: Sequence[int], salt: str = "") -> Reading:
        """Read the stored prefix of ``ids`` under cache salt ``salt`` (its tenant's chunks) in the background."""
        reading = Reading()
        self._pool.submit(self._run, [int(t) for t in ids], reading, salt)
        return reading

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _run(self, ids, reading: Reading, salt: str = "") -> None:
        self._count("reads")
        try:
            for info, data in self.fetcher.fetch(ids, uuid.uuid4().hex, salt=salt):  # fetches overlap; decodes take turns
                with self._decoding:
                    kv = self.restore.run(info, self.decode.run(info, data))
                arrival = self.assembler.arrive(info, kv)
                if arrival.first:
                    reading.chunks = arrival.chunks
                    reading.reason = info.reason if arrival.chunks is None else ""
                    if arrival.chunks is not None:
                        self._count("planned_tokens", arrival.chunks.session.planned_tokens)
                    reading.ready.set()
                if info.ok and info.count:
                    self._count("loaded_chunks")
        except Exception as exc:  # a read that fails is a miss: whatever arrived stays usable
            self._count("failed")
            log.warning("read failed: %s", exc, exc_info=not hasattr(exc, "status"))
            reading.reason = reading.reason or f"read failed: {exc}"
            session = reading.session
            if session is not None:
                for index in range(session.n_chunks):
                    try:
                        session.fail(index, reading.reason)
                    except ValueError:  # already in
                        pass
        finally:
            reading.ready.set()
            reading.done.set()
            stats = reading.stats()
            if stats is not None and stats.miss_reason:  # the read stopped short of its plan: say why
                log.warning("read used %d of %d planned tokens: %s", stats.reused_tokens,
                            reading.session.planned_tokens, stats.miss_reason)
            if stats is not None:
                try:
                    record_request(self.costs, stats, self.settings.chunk_tokens)
                except OSError:  # a cost file we cannot write only makes the estimates staler
                    pass
                if self.observer is not None:
                    self.observer(stats)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.decode.close()
        self.reads.close()  # the fetcher, the re-signer, the store if it opened it
