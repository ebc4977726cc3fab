"""The scheduler half of a KV connector, engine-neutral: what to load, when to save, bounded.

Paged engines (vLLM's ``KVConnectorBase_V1``, TensorRT-LLM's ``KvCacheConnectorScheduler``) ask their
connector the same three things in different call shapes; an adapter translates its engine's calls
to these, and holds nothing of the job itself:

``match(rid, prompt_tokens, stored_tokens, computed_tokens, session, asynchronous, save=None) -> int``
    Called when the engine asks how many prompt tokens the connector can supply (vLLM and
    TensorRT-LLM: ``get_num_new_matched_tokens``).
    Args: ``stored_tokens``: how many leading prompt tokens ``session`` can deliver (a
    ``LoadSession`` planned from position 0; None: nothing to load); ``computed_tokens``: what the
    engine already holds (its own prefix cache); ``asynchronous``: the load may end after this step
    (the engine parks the request until the worker reports it); ``save``: None, or a dict of what
    the save sink needs (e.g. the prompt's ids): the prompt's full chunks past ``max(stored,
    computed)`` are then saved once computed (chunks of ``chunk_tokens``, the core's by default);
    ``extra``: kept on the ``Load``.
    Returns: ``n``, the new tokens promised: block-aligned, at least one prompt token left to
    compute, 0 when the engine's own prefix ends inside a block. Side effects: the match is kept
    until ``allocated`` or ``finished``; never blocks.
``narrow(rid, tokens)``
    The engine took fewer tokens than offered (TensorRT-LLM 1.3+ ``commit_new_matched_tokens``):
    the load covers only those; 0 drops it.
``allocated(rid, block_ids) -> Load | None``
    Called once the engine allocated the request's blocks (``update_state_after_alloc``): the
    request's block list for its saves, and, if something was matched, the ``Load`` to start
    (``session.attach(pages, block_ids, start, tokens)``). Never blocks.
``scheduled(rid, computed_after_step, new_block_ids=(), first=False) -> SaveJob | None``
    Called for each request in a step's scheduler output (``build_connector_meta``).
    ``computed_after_step``: the tokens the request's KV covers once this step's forward ran, the
    connector's loaded tokens included (adapters translate their engine's count: vLLM's
    ``num_computed_tokens`` includes them; TensorRT-LLM's first ``computed_position`` leaves out the
    tokens matched synchronously in that step and includes those of an asynchronous load);
    ``new_block_ids``: blocks added in this step (``first``: the request's whole list). Returns the request's ``SaveJob`` in the step whose
    forward completes its last chunk to save, else None.
``finished(rid)``
    The request ended (``request_finished``): everything kept for it goes.

Bookkeeping of requests the engine never finishes (warm-up, aborts) is bounded: the oldest of more
than ``max_tracked`` matches or saves are dropped.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Generic, Hashable, List, Optional, Sequence, TypeVar

from .plan import chunks_to_save, matched_tokens
from .save import SaveJob, SaveTracker
from .session import LoadSession

R = TypeVar("R", bound=Hashable)
MAX_TRACKED = 4096


@dataclass
class Load:
    """A load the engine accepted: positions ``[start, start + tokens)`` of ``session`` into ``block_ids``."""

    request_id: Hashable
    session: LoadSession
    start: int
    tokens: int
    asynchronous: bool
    block_ids: List[int]
    extra: Dict[str, Any]


@dataclass
class _Match:
    session: LoadSession
    start: int
    tokens: int
    asynchronous: bool
    extra: Dict[str, Any]


class SchedulerCore(Generic[R]):
    def __init__(self, block_size: int, chunk_tokens: int, max_tracked: int = MAX_TRACKED) -> None:
        if block_size <= 0 or chunk_tokens <= 0 or max_tracked <= 0:
            raise ValueError(f"bad scheduler core: block_size {block_size}, chunk_tokens {chunk_tokens}, "
                             f"max_tracked {max_tracked}")
        self.block_size = int(block_size)
        self.chunk_tokens = int(chunk_tokens)
        self.max_tracked = int(max_tracked)
        self._matched: "OrderedDict[R, _Match]" = OrderedDict()
        self._saves: SaveTracker = SaveTracker(max_tracked)

    def match(self, rid: R, prompt_tokens: int, stored_tokens: int, computed_tokens: int,
              session: Optional[LoadSession], asynchronous: bool, save: Optional[Dict[str, Any]] = None,
              chunk_tokens: Optional[int] = None, **extra: Any) -> int:
        computed = int(computed_tokens)
        aligned = computed % self.block_size == 0  # a device hit ending inside a block: no load
        stored = int(stored_tokens) if session is not None else 0
        n = matched_tokens(stored, prompt_tokens, self.block_size, computed) if aligned else 0
        if save is not None:
            todo = chunks_to_save(prompt_tokens, max(stored, computed), chunk_tokens or self.chunk_tokens)
            self._saves.track(rid, todo, **save)
        if n:
            self._matched[rid] = _Match(session, computed, n, bool(asynchronous), dict(extra))
            self._matched.move_to_end(rid)
            while len(self._matched) > self.max_tracked:
                self._matched.popitem(last=False)
        else:
            self._matched.pop(rid, None)
        return n

    def narrow(self, rid: R, tokens: int) -> None:
        entry = self._matched.get(rid)
        if entry is None or not 0 <= tokens < entry.tokens:
            return
        if tokens == 0:
            del self._matched[rid]
        else:
            entry.tokens = int(tokens)

    def allocated(self, rid: R, block_ids: Sequence[int]) -> Optional[Load]:
        blocks = [int(b) for b in block_ids]
        self._saves.add_blocks(rid, blocks, replace=True)
        entry = self._matched.pop(rid, None)
        if entry is None:
            return None
        return Load(rid, entry.session, entry.start, entry.tokens, entry.asynchronous, blocks, entry.extra)

    def scheduled(self, rid: R, computed_after_step: int, new_block_ids: Sequence[int] = (),
                  first: bool = False) -> Optional[SaveJob]:
        if rid not in self._saves:
            return None
        if new_block_ids:
            self._saves.add_blocks(rid, new_block_ids, replace=first)
        return self._saves.step(rid, int(computed_after_step))

    def finished(self, rid: R) -> None:
        self._matched.pop(rid, None)
        self._saves.forget(rid)

    @property
    def pending(self) -> Dict[str, int]:
        """How many matches and saves are kept (bounded by ``max_tracked`` each)."""
        return {"matches": len(self._matched), "saves": len(self._saves)}
