"""The ``llm`` step's work: generate from restored KV plus the rest of the prompt.

``generate(engine, ids, max_tokens, assembled)`` yields ``Event``s, one per new token: its id,
the text it adds, and (on the first and the last event) the request's statistics. The restored KV
is checked against the model before use; if it cannot be used the whole prompt is computed:
the answer is always the model's own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, List, Sequence

from .assembler import Assembled
from .errors import BadRequest


@dataclass
class Event:
    token: int
    text: str
    final: bool
    stats: dict = field(default_factory=dict)


def generate(engine, ids: Sequence[int], max_tokens: int, assembled: Assembled) -> Iterator[Event]:
    stats = assembled.stats()
    stats["prompt_tokens"] = len(ids)
    past = assembled.past_kv
    why = _unusable(engine, past, len(ids))
    if why:
        past, stats["reused_tokens"], stats["miss_reason"] = None, 0, why
    stats["computed_tokens"] = len(ids) - stats["reused_tokens"]
    t0 = time.perf_counter()
    tokens: List[int] = []
    text = ""
    pending = None
    for token in engine.stream(ids, max_tokens, past):
        if pending is not None:
            yield pending
        tokens.append(token)
        full = engine.detokenize(tokens)
        delta, text = full[len(text):], full
        now = time.perf_counter()
        if len(tokens) == 1:
            stats["compute_first_token_s"] = round(now - t0, 6)
            pipe = stats.get("pipeline") or {}
            if pipe.get("bound_s"):
                # The pipeline bound: the slowest stage's total plus the first-token compute.
                pipe["bound_with_compute_s"] = round(pipe["bound_s"] + stats["compute_first_token_s"], 6)
            if stats.get("t_request"):
                stats["server_ttft_s"] = round(time.time() - stats["t_request"], 6)
            pending = Event(token, delta, False, dict(stats, final=False))
        else:
            pending = Event(token, delta, False)
    if pending is None:
        raise BadRequest("max_tokens must be at least 1")
    stats["generated_tokens"] = len(tokens)
    stats["generate_s"] = round(time.perf_counter() - t0, 6)
    pending.final = True
    pending.stats = dict(stats, final=True)
    yield pending


def _unusable(engine, past, n_ids: int) -> str:
    """Why restored KV cannot be used for this prompt ('' when it can)."""
    if past is None:
        return ""
    if past.shape[3] >= n_ids:
        return "restored KV covers the whole prompt"
    if tuple(past.shape) != engine.geometry(past.shape[3]).shape:
        return "restored KV does not fit this model"
    return ""
