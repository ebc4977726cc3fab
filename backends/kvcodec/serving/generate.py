"""Step ``llm``, its work: generate from restored KV plus the rest of the prompt.

``generate(engine, ids, max_tokens, source, sampling=GREEDY)`` yields ``Event``s, one per new
token: its id, the text it adds (incremental detokenization: each token decodes a short window,
not the whole answer; text that may begin a stop word is held back, and the answer ends before the
first stop word, ``serving.stops``), and on the first and the last event the request's
``RequestStats``. ``sampling`` (``engines.Sampling``) is checked first: a field asked for that the
engine does not honour (its ``sampling_fields``; stop words are honoured here, for every engine)
is a ``BadRequest`` naming it. ``source`` is the
request's ``Assembled`` KV, or its ``Chunks`` still arriving: an engine that ``takes_session``
is handed the request at once with the chunks' ``LoadSession``, where the chunks are (vLLM loads
them into its blocks as they come; TensorRT-LLM waits for the settled run and stages it on the
pool's device; what it took is what it reports), any other engine gets the assembled KV in host
memory once the request is complete. The restored
KV is checked against the model before use; if it cannot be used the whole prompt is computed: the
answer is always the model's own. It is float16 or float32 (``raw`` on a float32 engine: its own
KV, exactly); the engine converts it to its own dtype.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from ..errors import BadRequest
from .assemble import Assembled, Chunks
from .sampling import GENERATE_FIELDS, GREEDY, Sampling
from .stats import RequestStats, StreamReport
from .stops import StopText


@dataclass
class Event:
    token: int
    text: str
    final: bool
    stats: Optional[RequestStats] = None  # on the first and the last event


STATS_WAIT_S = 5.0  # at the first token, how long to wait for the infos of chunks still coming


def generate(engine, ids: Sequence[int], max_tokens: int, source: Union[Assembled, Chunks],
             sampling: Sampling = GREEDY, salt: str = "") -> Iterator[Event]:
    """``salt``: the request's cache salt (its tenant), passed to the engine when not empty."""
    sampling.check().refuse(engine.sampling_fields | GENERATE_FIELDS, engine.name)
    load = None
    if isinstance(source, Chunks):
        if engine.takes_session:
            load = source
        else:
            source.wait_complete()
            source = source.assembled()
    if load is not None:
        stats, past = load.assembled(with_kv=False).stats(), None  # refreshed at the first token
    else:
        stats = source.stats()
        past = source.past_kv
    stats.prompt_tokens = len(ids)
    why = _unusable(engine, past, len(ids))
    if why:
        past, stats.reused_tokens, stats.miss_reason = None, 0, why
    stats.computed_tokens = len(ids) - stats.reused_tokens
    detok = engine.detokenizer()
    t0 = time.perf_counter()
    n = 0
    pending: Optional[Event] = None
    report = StreamReport()
    tenant = {"salt": salt} if salt else {}  # an engine that knows no salts still serves unsalted requests
    tokens = engine.stream(ids, max_tokens, None, report=report, load=load.session, sampling=sampling, **tenant) \
        if load is not None else engine.stream(ids, max_tokens, past, report=report, sampling=sampling, **tenant)
    stops = StopText(sampling.stop_words)
    for token in tokens:
        if pending is not None:
            yield pending
        n += 1
        delta = stops.push(detok.push(token))
        if n == 1:
            if load is not None:  # the chunks' infos, now that the engine has taken what it could
                load.wait_complete(STATS_WAIT_S)
                stats = _refreshed(stats, load.assembled(with_kv=False).stats(), why)
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
        if stops.stopped:
            tokens.close()  # the engine ends the request (vLLM aborts it)
            break
    if pending is None:
        raise BadRequest("max_tokens must be at least 1")
    stats.generated_tokens = n
    stats.engine.update(report.engine_stats())
    stats.generate_s = round(time.perf_counter() - t0, 6)
    stats.final = True
    tail = stops.push(detok.flush())
    pending.text += tail + stops.flush()
    pending.final = True
    pending.stats = stats
    yield pending


def _refreshed(before: RequestStats, after: RequestStats, why: str) -> RequestStats:
    """The chunk statistics of ``after`` with what ``generate`` set on ``before`` (``why``: its own
    reason not to reuse, if any)."""
    after.prompt_tokens = before.prompt_tokens
    after.miss_reason = why or after.miss_reason
    after.computed_tokens = before.prompt_tokens - after.reused_tokens
    return after


def _took(stats: RequestStats, report: StreamReport, n_ids: int) -> None:
    """What the engine says it reused: a paged engine takes whole blocks of the restored KV."""
    if report.reused_tokens is not None:  # from the store, and from the engine's own prefix cache
        stats.reused_tokens = int(report.reused_tokens) + int(report.local_tokens or 0)
        stats.computed_tokens = n_ids - stats.reused_tokens
    stats.engine.update(report.engine_stats())


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
