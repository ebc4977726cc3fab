"""kv_fetch: read and validate the request, then stream the longest stored prefix chunk by chunk.

The request's inputs are TensorRT-LLM's ensemble's (``kvcodec.triton.interface``): ``text_input`` is
tokenized here, with the served model's own tokenizer, once; sampling the engine would refuse
(``engines.sampling_fields``) is refused here, before anything is fetched; how the llm step answers (stream,
sampling, ...) goes on with every chunk as the ``params`` JSON (``serving.request.Reply``). The
optional ``codecs`` input (a comma list of rung specs, e.g. ``raw`` or ``video:12``) restricts
this request to those rungs, chosen statically; without it the server's ladder is used, chosen
per chunk by the adaptive fetcher when the ``adaptive`` setting is on. The optional ``cache_salt``
(or the request parameter of that name) names the request's tenant: only chunks stored under it are
looked up, and it travels in ``params`` to the llm step (its engine's prefix cache, write-back). The model is never loaded
here: its card (identity, vocabulary, context, codec profile, KV dtype) is all this step needs.

The store's health is this step's to report (it owns the store's calls, ``kvcodec.serving.calls``):
Prometheus gauges per instance, set after each request (the breaker moves only with requests:
requests trigger its probes), on the server's metrics endpoint:

- ``kvcodec_store_breaker_state{store,instance}``: 0 closed, 1 half-open, 2 open;
- ``kvcodec_store_calls{store,instance,state}``: store calls ``running``, ``queued`` and
  ``abandoned`` (running, their request no longer waiting: they end by their own deadline);
- ``kvcodec_store_breaker_opens_total{store,instance}``: times the breaker opened.
Each request also carries the snapshot in its stats (``RequestStats.store``).
"""
import logging
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from kvcodec.compose import open_reads
from kvcodec.engines import model_card, open_tokenizer, sampling_fields
from kvcodec.settings import Settings
from kvcodec.store.breaker import STATES
from kvcodec.triton import (
    FINAL,
    error_response,
    model_parameters,
    tensor,
    text_tensor,
)
from kvcodec.triton.interface import read_request

log = logging.getLogger("kvcodec.kv_fetch")


class TritonPythonModel:
    def initialize(self, args):
        self.settings = Settings.load(model_parameters(args))
        self.card = model_card(self.settings)
        self.tokenizer = open_tokenizer(self.settings)  # the model's own: text_input -> the ids ingest keys
        self.honoured = sampling_fields(self.settings, self.card)  # what the llm step's engine would take
        # the deployment's read path (kvcodec.compose): one connection pool for this instance, its local
        # tier first; the fetcher (plan, adaptive rungs, the store's breaker and deadlines)
        self.reads = open_reads(self.settings, self.card)
        self.store, self.fetcher = self.reads.store, self.reads.fetcher
        self.metrics = _StoreMetrics(self.store.url, args.get("model_instance_name", "kv_fetch"))
        self.metrics.record(self.fetcher.calls.snapshot())

    def _parse(self, request):
        req = read_request(request, self.tokenizer.encode, self.settings.exclude_input_in_output).validate(self.card)
        req.reply.sampling.refuse(self.honoured, self.settings.engine)  # refused here: nothing fetched
        return req

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                req = self._parse(request)
            except Exception as exc:  # bad request: INVALID_ARG, nothing sent downstream
                sender.send(error_response(exc), flags=FINAL)
                continue
            ids_t = tensor("input_ids", req.ids)
            max_t = tensor("max_tokens", np.array([req.max_tokens], np.int32))
            params = text_tensor("params", req.reply.to_json())
            try:
                for info, data in self.fetcher.fetch(req.ids.tolist(), uuid.uuid4().hex, req.reuse, req.codecs,
                                                     req.salt):
                    chunk = np.frombuffer(data, dtype=np.uint8)
                    sender.send(pb_utils.InferenceResponse([ids_t, max_t, params, tensor("chunk", chunk),
                                                            text_tensor("chunk_info", info.to_json())]))
            except Exception as exc:  # the stream still ends, with the error as its last response
                log.exception("kv_fetch failed mid-stream")
                sender.send(error_response(exc), flags=FINAL)
            else:
                sender.send(flags=FINAL)
            self.metrics.record(self.fetcher.calls.snapshot())
        return None

    def finalize(self):
        self.reads.close()


class _StoreMetrics:
    """The gauges of the module's docstring (set from this step's one thread: ``execute``)."""

    def __init__(self, store: str, instance: str):
        labels = {"store": store, "instance": instance}
        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        # The families are kept: a metric outlives its family's Python object only at a cost (Triton
        # refuses to set a metric whose family was deleted).
        self.families = [
            pb_utils.MetricFamily("kvcodec_store_breaker_state",
                                  "The store's circuit breaker: 0 closed, 1 half-open, 2 open", gauge),
            pb_utils.MetricFamily("kvcodec_store_calls", "Store calls of kv_fetch's fixed pool, by state", gauge),
            pb_utils.MetricFamily("kvcodec_store_breaker_opens_total", "Times the store's breaker opened", counter),
        ]
        state, calls, opens = self.families
        self.state = state.Metric(labels=labels)
        self.calls = {k: calls.Metric(labels=dict(labels, state=k)) for k in ("running", "queued", "abandoned")}
        self.opens = opens.Metric(labels=labels)
        self._opened = 0

    def record(self, snapshot: dict):
        self.state.set(STATES[snapshot["breaker"]])
        for name, metric in self.calls.items():
            metric.set(snapshot[name])
        if snapshot["opened"] > self._opened:
            self.opens.increment(snapshot["opened"] - self._opened)
            self._opened = snapshot["opened"]
