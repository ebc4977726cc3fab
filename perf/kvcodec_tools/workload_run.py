"""Sending the peers' workloads (``kvcodec_tools.workload``) to a server and timing them.

Targets (loopback addresses only), each streamed and greedy:

- ``OpenAITarget``: any OpenAI-compatible server's ``/v1/completions`` (``vllm serve`` with the
  KVCodec connector, vLLM with LMCache, plain vLLM); ``cache_salt`` as OpenAI's field. Prefill's
  answer (the reference) is asked with a fresh random ``cache_salt``: vLLM keeps salts apart in its
  prefix cache and the KVCodec connector keys the store by salt, so nothing is reused for it.
- ``EnsembleTarget``: Triton's ensemble through HTTP ``/v2/models/kvcodec/generate_stream``
  (``text_input``, ``max_tokens``, ``stream``, ``exclude_input_in_output``, ``cache_salt``); the
  reference is asked with ``reuse: false``.

Prefix-aware routing: every request carries ``X-KVCodec-Prefix`` (``kvcodec_client.route_key``)
of its prompt's stable prefix, its document's head for long-document QA (``ROUTE_CHARS``), its
conversation's head (system prompt and user context) for multi-round; a router in front
(``Balancer(routing="prefix")``: nginx's consistent hash) sends a prefix to one replica, a single
server ignores it.

TTFT is the time from a request's send to its first non-empty text. A round's requests go through
a thread pool of ``inflight`` workers (at most that many in flight); each request has a timeout.
The references are asked after the measured rounds, one at a time, once per distinct prompt, so
they never load the server while it is measured. ``restart`` (a callable returning the new
target) runs between the warm-up and the query round.
"""
from __future__ import annotations

import json
import secrets
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from kvcodec_client.routing import ROUTE_HEADER, route_key

from .workload import (
    LongDocConfig,
    MultiRoundConfig,
    Record,
    arrival_schedule,
    conversation_prompt,
    documents,
    query_round,
    round_span,
    system_prompt,
    user_context,
)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
ROUTE_CHARS = 1024  # a long-document QA prompt's head that names its document (a miss's differs)
WARM_PROMPT = "Hello there, this is a warm-up request."


class WorkloadError(RuntimeError):
    """A request failed (HTTP error, server error, timeout): the run stops."""


@dataclass
class Answer:
    ttft_s: float
    text: str
    cached_tokens: Optional[int]
    elapsed_s: float


class Target(Protocol):
    """A server a workload runs against. ``send``: one streamed greedy request (``salt``: the
    cache salt, None for none); ``reference``: prefill's answer to the prompt, nothing reused."""
    url: str

    def send(self, prompt: str, max_tokens: int, salt: Optional[str] = None, route: Optional[str] = None) -> Answer:
        ...

    def reference(self, prompt: str, max_tokens: int) -> str: ...


def check_loopback(url: str) -> str:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host not in LOOPBACK:
        raise ValueError(f"only loopback servers are measured here ({', '.join(LOOPBACK)}), got {url!r}")
    return url.rstrip("/")


def _events(request: urllib.request.Request, timeout_s: float):
    """The server-sent events' JSON objects of a streamed answer."""
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if isinstance(event, dict) and "error" in event:
                    raise WorkloadError(f"{request.full_url}: {str(event['error'])[:300]}")
                yield event
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", "replace")[:300]
        raise WorkloadError(f"{request.full_url}: HTTP {exc.code}: {body}") from None
    except (OSError, ValueError) as exc:
        raise WorkloadError(f"{request.full_url}: {exc}") from None


def _post(url: str, body: dict, route: Optional[str] = None) -> urllib.request.Request:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if route is not None:
        headers[ROUTE_HEADER] = route_key(route)
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)


class OpenAITarget:
    def __init__(self, url: str, model: str = "model", cache_salt: Optional[str] = None,
                 timeout_s: float = 600.0) -> None:
        self.url, self.model, self.cache_salt, self.timeout_s = check_loopback(url), model, cache_salt, timeout_s

    def send(self, prompt: str, max_tokens: int, salt: Optional[str] = None, route: Optional[str] = None) -> Answer:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        salt = salt if salt is not None else self.cache_salt
        if salt:
            body["cache_salt"] = salt
        from .services.vllm_serve import completion_stream

        t0 = time.perf_counter()
        ttft, text, cached = completion_stream(_events(_post(f"{self.url}/v1/completions", body, route), self.timeout_s),
                                               t0)
        return Answer(ttft, text, cached, time.perf_counter() - t0)

    def reference(self, prompt: str, max_tokens: int) -> str:
        return self.send(prompt, max_tokens, salt="reference-" + secrets.token_hex(8)).text


class EnsembleTarget:
    def __init__(self, url: str, model: str = "kvcodec", cache_salt: Optional[str] = None,
                 timeout_s: float = 600.0) -> None:
        self.url, self.model, self.cache_salt, self.timeout_s = check_loopback(url), model, cache_salt, timeout_s

    def _stream(self, prompt: str, max_tokens: int, extra: dict, route: Optional[str] = None) -> Answer:
        body = {"text_input": prompt, "max_tokens": max_tokens, "stream": True, "exclude_input_in_output": True,
                **extra}
        if self.cache_salt:
            body["cache_salt"] = self.cache_salt
        t0 = time.perf_counter()
        ttft, texts, reused = None, [], None
        for event in _events(_post(f"{self.url}/v2/models/{self.model}/generate_stream", body, route),
                             self.timeout_s):
            text = event.get("text_output") or ""
            if isinstance(text, list):
                text = "".join(text)
            if text:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                texts.append(text)
            value = event.get("reused_tokens")
            if value is not None:
                reused = int(value[0] if isinstance(value, list) else value)
        elapsed = time.perf_counter() - t0
        return Answer(elapsed if ttft is None else ttft, "".join(texts), reused, elapsed)

    def send(self, prompt: str, max_tokens: int, salt: Optional[str] = None, route: Optional[str] = None) -> Answer:
        return self._stream(prompt, max_tokens, {"cache_salt": salt} if salt else {}, route)

    def reference(self, prompt: str, max_tokens: int) -> str:
        return self._stream(prompt, max_tokens, {"reuse": False}).text


def _bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not progress, file=sys.stderr, leave=True)


def run_round(target: Target, name: str, items: Sequence[Tuple[str, dict]], max_tokens: int, inflight: int,
              progress: bool = True) -> Tuple[List[Record], float]:
    """Send ``items`` ((prompt, record fields)) with at most ``inflight`` in flight; the records (times
    from the round's start) and the round's time (first send to last answer)."""
    t0 = time.perf_counter()
    with _bar(len(items), name, progress) as bar:
        def one(item: Tuple[str, dict]) -> Record:
            prompt, fields = item
            start = time.perf_counter() - t0
            answer = target.send(prompt, max_tokens, route=prompt[:ROUTE_CHARS])
            bar.update(1)
            return Record(round=name, start_s=start, ttft_s=answer.ttft_s, end_s=start + answer.elapsed_s,
                          cached_tokens=answer.cached_tokens, text=answer.text, prompt=prompt, **fields)

        with ThreadPoolExecutor(max_workers=inflight) as pool:
            records = list(pool.map(one, items))
    return records, time.perf_counter() - t0


def check_answers(target: Target, records: Sequence[Record], max_tokens_of: Callable[[Record], int],
                  progress: bool = True) -> Dict[str, str]:
    """Ask prefill's answer of each distinct prompt (one at a time) and set each record's ``equal``."""
    refs: Dict[str, str] = {}
    with _bar(len({r.prompt for r in records}), "reference", progress) as bar:
        for r in records:
            if r.prompt not in refs:
                refs[r.prompt] = target.reference(r.prompt, max_tokens_of(r))
                bar.update(1)
            r.equal = r.text == refs[r.prompt]
    return refs


def warm_engine(target: Target) -> None:
    """One short request with nothing in common with the workload's prompts: a new server's one-time
    costs (LMCache's scripts send such a request first too)."""
    target.send(WARM_PROMPT, 2)


def run_long_doc_qa(target: Target, tokenizer, config: LongDocConfig,
                    restart: Optional[Callable[[], Target]] = None,
                    progress: bool = True) -> Tuple[List[Record], Dict[str, float]]:
    """LMCache's long-document QA: a warm-up round (each document once), ``restart`` if given, then
    the query round; every answer checked against prefill's. The records and the rounds' times."""
    prompts = documents(tokenizer, config.documents, config.document_tokens)
    warm_engine(target)
    warm, warm_s = run_round(target, "warmup", [(p, {"doc": i}) for i, p in enumerate(prompts)],
                             config.output_tokens, config.inflight, progress)
    if restart is not None:
        target = restart()
        warm_engine(target)
    queries = query_round(prompts, config)
    query, query_s = run_round(target, "query", [(q.prompt, {"doc": q.doc, "miss": q.miss}) for q in queries],
                               config.output_tokens, config.inflight, progress)
    records = warm + query
    check_answers(target, records, lambda r: config.output_tokens, progress)
    return records, {"warmup_round_s": warm_s, "query_round_s": query_s}


def run_multi_round(target: Target, tokenizer, config: MultiRoundConfig,
                    restart: Optional[Callable[[], Target]] = None,
                    progress: bool = True) -> Tuple[List[Record], Dict[str, float]]:
    """LMCache's multi-round QA: users arriving over time, each a growing conversation after the
    shared system prompt; turn 1 is the warm-up round, later turns the query. With ``restart``, every
    user's turn 1 runs first, then the server restarts, then the later turns (turn k + 1 finds
    turns 1..k only where the server keeps them across a restart)."""
    system = system_prompt(tokenizer, config.system_tokens)
    contexts = [user_context(tokenizer, u, config.user_info_tokens) for u in range(config.users)]
    answers: List[List[str]] = [[] for _ in range(config.users)]
    phases = [(1, config.rounds)] if restart is None or config.rounds == 1 else [(1, 1), (2, config.rounds)]
    records: List[Record] = []
    warm_engine(target)
    for first, last in phases:
        if first > 1:
            target = restart()
            warm_engine(target)
        schedule = arrival_schedule(config, first, last)
        t0 = time.perf_counter()
        with _bar(len(schedule), f"turns {first}-{last}", progress) as bar, \
                ThreadPoolExecutor(max_workers=config.users) as pool:
            jobs = [pool.submit(_user_turns, target, [s for s in schedule if s[1] == u], t0, system + contexts[u],
                                answers[u], config.answer_tokens, bar) for u in range(config.users)]
            for job in jobs:
                records.extend(job.result())
    records.sort(key=lambda r: (r.turn, r.user))
    check_answers(target, records, lambda r: config.answer_tokens, progress)
    warm = [r for r in records if r.round == "warmup"]
    query = [r for r in records if r.round == "query"]
    return records, {"warmup_round_s": round_span(warm) or 0.0, "query_round_s": round_span(query) or 0.0}


def _user_turns(target: Target, turns: Sequence[Tuple[float, int, int]], t0: float, head: str, answers: List[str],
                answer_tokens: int, bar) -> List[Record]:
    """One user's ``turns`` ((time from ``t0``, user, turn)), in order, each sent at its time or when
    the previous answer is back, whichever is later; its answers appended to ``answers``."""
    out = []
    for at, user, turn in turns:
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        prompt = conversation_prompt(head, "", answers)
        start = time.perf_counter() - t0
        answer = target.send(prompt, answer_tokens, route=head)
        answers.append(answer.text)
        out.append(Record(round="warmup" if turn == 1 else "query", start_s=start, ttft_s=answer.ttft_s,
                          end_s=start + answer.elapsed_s, cached_tokens=answer.cached_tokens, user=user, turn=turn,
                          text=answer.text, prompt=prompt))
        bar.update(1)
    return out


def config_dict(config) -> dict:
    return asdict(config)
