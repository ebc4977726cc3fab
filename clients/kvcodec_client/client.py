"""Call the ``kvcodec`` ensemble over gRPC (tritonclient streaming) or HTTP (Triton's
``generate_stream`` endpoint, server-sent events), and measure time-to-first-token.

``KVCodecClient(url, protocol).generate(prompt, max_tokens, reuse=True, codecs=None, cache_salt=None, **sampling)``
returns a ``GenerateResult``: the generated token ids, the text, the TTFT seen by the client (from
sending the request to the first token's response), the total time, how many prompt tokens the
server reused and how many it read (``prompt_tokens``), and the server's statistics (JSON of the
first and last responses, merged). ``prompt`` is text (sent as ``text_input``, tokenized by the
server with the model's own tokenizer) or a sequence of token ids (``input_ids``). ``sampling``
takes the ensemble's inputs by their TensorRT-LLM names: ``temperature``, ``top_p``, ``top_k``,
``seed``, ``min_tokens``, ``end_id``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``, ``stop_words``, ``bad_words`` (lists of strings). The answer always streams
(one response per token: the TTFT is measured), without the prompt. ``codecs``
(a comma list of rung specs such as ``raw`` or ``video:12``) restricts the request to those rungs;
left out, the server's ladder and its adaptive choice apply. ``cache_salt`` (a string) names the
caller's tenant, as vLLM's OpenAI ``cache_salt``: only KV stored under the same salt is reused, and
the answer's KV is written back under it (sent as the ``cache_salt`` input).
A request the server refuses raises ``ClientError`` with the server's message and status.

``fallback_s`` (default 0: off) is the client's answer to a server that fails a request it did not
refuse: a stub that died in the request (Triton ends the request with "Stub process ... is not
healthy"), a connection refused or reset while a watchdog restarts the server, a 5xx, an error event
mid-stream. Within ``fallback_s`` of the first failure the client asks again, with ``reuse=False``
(the stored KV may be what crashed the decoder), backing off from 0.5 s to 4 s, and returns that
answer: the model's own, from its own prefill, with the failures in ``GenerateResult.failures`` and
in ``stats["client_fallback"]``. Refusals (INVALID_ARG, 4xx) and the client's own timeout are
never retried: asking again would not change them.

``tls`` (``ClientTls``: the CA that signed the server's certificate, and for mutual TLS the
client's certificate and key, PEM files) speaks TLS: gRPC to a server started with
``kvcodec serve --grpc-tls-cert ... [--grpc-tls-client-ca ...]``, HTTPS to a TLS proxy in front of
the HTTP endpoint (``docs/deploy.md``).
"""
from __future__ import annotations

import http.client
import json
import queue
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .routing import ROUTE_HEADER, route_key

MODEL = "kvcodec"
DEFAULT_URLS = {"grpc": "127.0.0.1:8001", "http": "127.0.0.1:8000"}
# Failures of the server, not of the request: worth asking again (as prefill).
RETRYABLE_GRPC = frozenset({"StatusCode.INTERNAL", "StatusCode.UNAVAILABLE", "StatusCode.UNKNOWN"})
CONNECTION = "connection"  # the status of a refused, reset or dropped connection
STREAM = "stream"  # the status of an error event in an HTTP stream that had begun (200)
BACKOFF_S = (0.5, 1.0, 2.0, 4.0)
# gRPC streams carry an error's message without its status; these messages are failures of the
# server (Triton's when a python stub has died, and while it shuts down; gRPC's on a lost or
# refused connection), anything else is taken as a refusal.
SERVER_FAILURES = ("is not healthy", "Server is stopping", "Socket closed", "Connection reset",
                   "Connection refused", "failed to connect", "Broken pipe")


class ClientError(RuntimeError):
    def __init__(self, message: str, status: str = "") -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message

    @property
    def retryable(self) -> bool:
        """A failure of the server (see the module's docstring), not a refusal of the request."""
        if self.status in RETRYABLE_GRPC or self.status in (CONNECTION, STREAM):
            return True
        if self.status.isdigit() and int(self.status) >= 500:
            return True
        # Triton's HTTP endpoint answers 400 for a request whose python stub died mid-way: the
        # message, not the status, says it is the server's failure
        return any(p in self.message for p in SERVER_FAILURES)


@dataclass
class GenerateResult:
    tokens: List[int]
    text: str
    ttft_s: float
    total_s: float
    reused_tokens: int
    stats: dict = field(default_factory=dict)
    failures: List[str] = field(default_factory=list)  # the server failures answered by asking again
    prompt_tokens: Optional[int] = None  # the prompt's tokens, as the server counted them

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "ttft_s": round(self.ttft_s, 6),
                "reused_tokens": self.reused_tokens, "prompt_tokens": self.prompt_tokens,
                "total_s": round(self.total_s, 6), "stats": self.stats, "failures": self.failures}


class _Collector:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.ttft: Optional[float] = None
        self.tokens: List[int] = []
        self.text: List[str] = []
        self.reused = 0
        self.stats: dict = {}
        self.prompt_tokens: Optional[int] = None

    def add(self, ids, text, reused, stats, prompt_tokens=None) -> None:
        if prompt_tokens is not None:
            self.prompt_tokens = int(prompt_tokens)
        if ids is None or len(ids) == 0:
            return
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.t0
        self.tokens.extend(int(t) for t in ids)
        self.text.append(text)
        self.reused = int(reused)
        if stats:
            self.stats.update(stats)

    def result(self) -> GenerateResult:
        if self.ttft is None:
            raise ClientError("the server sent no token")
        if self.stats and not self.stats.get("final", True):
            # the last token's event carries the request's final stats: a stream that ended before it
            # was cut (a server stopping mid-answer ends its HTTP streams cleanly): ask again
            raise ClientError(f"the answer ended after {len(self.tokens)} token(s), before its last one "
                              "(the server went away mid-answer)", STREAM)
        return GenerateResult(self.tokens, "".join(self.text), self.ttft, time.perf_counter() - self.t0,
                              self.reused, self.stats, prompt_tokens=self.prompt_tokens)


@dataclass(frozen=True)
class ClientTls:
    ca: str  # PEM: the CA that signed the server's certificate
    cert: Optional[str] = None  # PEM: this client's certificate (mutual TLS)
    key: Optional[str] = None  # PEM: its private key

    def ssl_context(self):
        import ssl

        context = ssl.create_default_context(cafile=self.ca)
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context


class KVCodecClient:
    def __init__(self, url: Optional[str] = None, protocol: str = "grpc", timeout_s: float = 600.0,
                 fallback_s: float = 0.0, tls: Optional[ClientTls] = None) -> None:
        if protocol not in DEFAULT_URLS:
            raise ValueError(f"protocol must be grpc or http, got {protocol!r}")
        if fallback_s < 0:
            raise ValueError(f"fallback_s must be >= 0, got {fallback_s}")
        self.protocol = protocol
        self.url = (url or DEFAULT_URLS[protocol]).removeprefix("http://").removeprefix("https://") \
            .removeprefix("grpc://")
        self.timeout_s = timeout_s
        self.tls = tls
        self.fallback_s = fallback_s

    def generate(self, prompt: Union[str, Sequence[int]], max_tokens: int, reuse: bool = True,
                 codecs: Optional[str] = None, cache_salt: Optional[str] = None,
                 route: Optional[Union[str, Sequence[int]]] = None, **sampling: Any) -> GenerateResult:
        """``route``: the prompt's stable head (a text or token ids: the document, the conversation's
        head); the request then carries ``X-KVCodec-Prefix`` (``routing.route_key``) for a
        prefix-aware router in front of several servers (gRPC: as metadata)."""
        unknown = set(sampling) - set(SAMPLING)
        if unknown:
            raise ValueError(f"unknown sampling input(s): {', '.join(sorted(unknown))} (known: {', '.join(SAMPLING)})")
        failures: List[str] = []
        deadline: Optional[float] = None
        while True:
            try:
                result = self._once(request_inputs(prompt, max_tokens, reuse and not failures, codecs, sampling,
                                                   cache_salt), route)
            except ClientError as exc:
                if not exc.retryable or self.fallback_s <= 0:
                    raise
                now = time.monotonic()
                deadline = now + self.fallback_s if deadline is None else deadline
                failures.append(str(exc))
                pause = BACKOFF_S[min(len(failures), len(BACKOFF_S)) - 1]
                if now + pause >= deadline:
                    raise ClientError(f"the server failed {len(failures)} time(s) within {self.fallback_s:g} s; "
                                      f"last: {exc.message}", exc.status) from exc
                time.sleep(pause)
                continue
            if failures:
                result.failures = failures
                result.stats["client_fallback"] = {"reason": failures[0], "attempts": len(failures) + 1,
                                                   "reuse": False}
            return result

    def _once(self, inputs, route=None) -> GenerateResult:
        headers = {} if route is None else {ROUTE_HEADER: route_key(route)}
        try:
            if self.protocol == "grpc":
                return self._grpc(inputs, {k.lower(): v for k, v in headers.items()})  # gRPC metadata: lower case
            return self._http(inputs, headers)
        except ssl.SSLError as exc:  # a handshake refused: asking again would not change it
            raise ClientError(f"TLS: {exc}", "tls") from exc
        except (ConnectionError, http.client.HTTPException, socket.gaierror) as exc:
            raise ClientError(f"{type(exc).__name__}: {exc}", CONNECTION) from exc

    def _grpc(self, request, headers: Dict[str, str]) -> GenerateResult:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        inputs = []
        for name, array, dtype in request:
            tensor = grpcclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        events: "queue.Queue" = queue.Queue()
        secure = {} if self.tls is None else {"ssl": True, "root_certificates": self.tls.ca,
                                              "private_key": self.tls.key, "certificate_chain": self.tls.cert}
        client = grpcclient.InferenceServerClient(self.url, **secure)
        try:
            try:
                client.start_stream(callback=lambda result, error: events.put((result, error)), headers=headers or None)
                collector = _Collector()
                client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
            except InferenceServerException as exc:
                raise ClientError(exc.message(), exc.status() or CONNECTION) from exc
            while True:
                try:
                    result, error = events.get(timeout=self.timeout_s)
                except queue.Empty:
                    raise ClientError(f"no response within {self.timeout_s:.0f} s") from None
                if error is not None:
                    status = error.status() if isinstance(error, InferenceServerException) else ""
                    message = error.message() if hasattr(error, "message") else str(error)
                    if not status and any(p in message for p in SERVER_FAILURES):
                        status = STREAM
                    raise ClientError(message, status or "")
                ids = result.as_numpy("output_ids")
                if ids is not None:
                    ids = ids.reshape(-1)  # the one row of the batch
                    text = result.as_numpy("text_output").reshape(-1)[0].decode("utf-8", "replace")
                    stats = json.loads(result.as_numpy("stats").reshape(-1)[0] or b"{}")
                    n_in = result.as_numpy("num_input_tokens")
                    collector.add(ids, text, result.as_numpy("reused_tokens").reshape(-1)[0], stats,
                                  None if n_in is None else n_in.reshape(-1)[0])
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    break
            return collector.result()
        finally:
            client.stop_stream()
            client.close()

    def _http(self, request, headers: Dict[str, str]) -> GenerateResult:
        host, _, port = self.url.partition(":")
        body = json.dumps({name: _json_value(name, array) for name, array, _ in request})
        conn = (http.client.HTTPConnection(host, int(port or 80), timeout=self.timeout_s) if self.tls is None else
                http.client.HTTPSConnection(host, int(port or 443), timeout=self.timeout_s,
                                            context=self.tls.ssl_context()))
        try:
            collector = _Collector()
            conn.request("POST", f"/v2/models/{MODEL}/generate_stream", body=body,
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream", **headers})
            response = conn.getresponse()
            if response.status != 200:
                raise ClientError(_error_text(response.read()), str(response.status))
            for raw in response:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise ClientError(event["error"], STREAM)
                ids = event.get("output_ids")
                if isinstance(ids, int):
                    ids = [ids]
                stats = event.get("stats") or "{}"
                n_in = event.get("num_input_tokens")
                collector.add(ids, event.get("text_output", ""), _scalar(event.get("reused_tokens", 0)),
                              json.loads(stats if isinstance(stats, str) else stats[0]),
                              None if n_in is None else _scalar(n_in))
            return collector.result()
        finally:
            conn.close()


def _scalar(value):
    return value[0] if isinstance(value, list) else value


# the ensemble's sampling inputs (TensorRT-LLM's names) and their Triton types
SAMPLING = {"temperature": "FP32", "top_p": "FP32", "top_k": "INT32", "seed": "UINT64", "min_tokens": "INT32",
            "end_id": "INT32", "repetition_penalty": "FP32", "presence_penalty": "FP32", "frequency_penalty": "FP32",
            "stop_words": "BYTES", "bad_words": "BYTES"}
_NUMPY = {"FP32": np.float32, "INT32": np.int32, "UINT64": np.uint64, "BOOL": np.bool_}


def request_inputs(prompt: Union[str, Sequence[int]], max_tokens: int, reuse: bool, codecs: Optional[str],
                   sampling: dict, cache_salt: Optional[str] = None) -> List[Tuple[str, np.ndarray, str]]:
    """The request's inputs as (name, array, Triton type), each with the ensemble's batch dimension
    (one sequence: ``[1, ...]``): text as ``text_input``, token ids as ``input_ids``; always
    streamed, the prompt left out of the answer, its token count asked for."""
    if isinstance(prompt, str):
        out = [("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES")]
    else:
        out = [("input_ids", np.asarray(list(prompt), np.int32), "INT32")]
    out += [("max_tokens", np.array([max_tokens], np.int32), "INT32"), ("reuse", np.array([reuse], np.bool_), "BOOL"),
            ("stream", np.array([True]), "BOOL"), ("exclude_input_in_output", np.array([True]), "BOOL"),
            ("return_num_input_tokens", np.array([True]), "BOOL")]
    if codecs:
        out.append(("codecs", np.array([codecs.encode()], dtype=np.object_), "BYTES"))
    if cache_salt:
        out.append(("cache_salt", np.array([cache_salt.encode("utf-8")], dtype=np.object_), "BYTES"))
    for name, value in sampling.items():
        if value is None:
            continue
        dtype = SAMPLING[name]
        if dtype == "BYTES":
            words = [value] if isinstance(value, str) else list(value)
            out.append((name, np.array([w.encode("utf-8") for w in words], dtype=np.object_), dtype))
        else:
            out.append((name, np.array([value], _NUMPY[dtype]), dtype))
    return [(name, array[None], dtype) for name, array, dtype in out]


def _json_value(name: str, array: np.ndarray):
    """The JSON form Triton's generate endpoints take: a list for the inputs of dims [-1], else the
    one value."""
    values = [v.decode("utf-8") if isinstance(v, bytes) else v.item() for v in array.reshape(-1)]
    return values if name in LISTS else values[0]


LISTS = ("input_ids", "stop_words", "bad_words")  # the inputs of dims [-1]


def _error_text(body: bytes) -> str:
    text = body.decode("utf-8", "replace").strip()
    if text.startswith("data:"):  # generate_stream answers errors as one server-sent event
        text = text[5:]
    try:
        return json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return text[:300]
