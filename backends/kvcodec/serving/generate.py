"""Step ``llm``, its work: generate from restored KV plus the rest of the prompt.

``generate(engine, ids, max_tokens, assembled)`` yields ``Event``s, one per new token: its id,
the text it adds (incremental detokenization: each token decodes a short window, not the whole
answer), and on the first and the last event the request's ``RequestStats``. The restored KV is
checked against the model before use; if it cannot be used the whole prompt is computed: the
answer is always the model's own. It is float16 or float32 (``raw`` on a float32 engine: its own
KV, exactly); the engine converts it to its own dtype.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

from ..errors import BadRequest
from .assemble import Assembled
from .stats import RequestStats


@dataclass
class Event:
    token: int
    text: str
    final: bool
    stats: Optional[RequestStats] = None  # on the first and the last event


def generate(engine, ids: Sequence[int], max_tokens: int, assembled: Assembled) -> Iterator[Event]:
    stats = assembled.stats()
    stats.prompt_tokens = len(ids)
    past = assembled.past_kv
    why = _unusable(engine, past, len(ids))
    if why:
        past, stats.reused_tokens, stats.miss_reason = None, 0, why
    stats.computed_tokens = len(ids) - stats.reused_tokens
    detok = engine.detokenizer()
    t0 = time.perf_counter()
    n = 0
    pending: Optional[Event] = None
    report: dict = {}
    for token in engine.stream(ids, max_tokens, past, report=report):
        if pending is not None:
            yield pending
        n += 1
        delta = detok.push(token)
        if n == 1:
            _took(stats, report, len(ids))
            stats.compute_first_token_s = round(time.perf_counter() - t0, 6)
            if stats.pipeline.bound_s:
                # The pipeline bound: the slowest stage's total plus the first-token compute.
                stats.pipeline.bound_with_compute_s = round(stats.pipeline.bound_s + stats.compute_first_token_s, 6)
            if stats.t_request:
                stats.server_ttft_s = round(time.time() - stats.t_request, 6)
            first = copy.deepcopy(stats)
            first.final = False
            pending = Event(token, delta, False, first)
        else:
            pending = Event(token, delta, False)
    if pending is None:
        raise BadRequest("max_tokens must be at least 1")
    stats.generated_tokens = n
    stats.engine.update({k: v for k, v in report.items() if k != "reused_tokens"})
    stats.generate_s = round(time.perf_counter() - t0, 6)
    stats.final = True
    pending.text += detok.flush()
    pending.final = True
    pending.stats = stats
    yield pending


def _took(stats: RequestStats, report: dict, n_ids: int) -> None:
    """What the engine says it reused: a paged engine takes whole blocks of the restored KV."""
    if "reused_tokens" in report:
        stats.reused_tokens = int(report["reused_tokens"])
        stats.computed_tokens = n_ids - stats.reused_tokens
    stats.engine.update({k: v for k, v in report.items() if k != "reused_tokens"})


def _unusable(engine, past, n_ids: int) -> str:
    """Why restored KV cannot be used for this prompt ('' when it can)."""
    if past is None:
        return ""
    if past.dtype not in (np.float16, np.float32):
        return f"restored KV is {past.dtype}, not float16 or float32"
    if past.shape[3] >= n_ids:
        return "restored KV covers the whole prompt"
    if tuple(past.shape) != engine.geometry(past.shape[3]).shape:
        return "restored KV does not fit this model"
    return ""
