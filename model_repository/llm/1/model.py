"""llm: gather a request's restored chunks, then generate; one response per new token."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from kvcodec.assembler import Assembler
from kvcodec.chunkinfo import ChunkInfo
from kvcodec.costs import for_settings, record_request
from kvcodec.engines.model_files import ensure_model
from kvcodec.engines.transformers_engine import TransformersEngine
from kvcodec.generate import generate
from kvcodec.settings import Settings
from kvcodec.triton import FINAL, error_response, get_array, get_scalar, get_text, model_parameters, tensor, text_tensor


class TritonPythonModel:
    def initialize(self, args):
        self.settings = Settings.load(model_parameters(args))
        self.engine = TransformersEngine(ensure_model(self.settings.model_cache), threads=self.settings.threads)
        self.costs = for_settings(self.settings, self.engine.geometry(1).fp16_bytes)
        self.assembler = Assembler()
        self.metrics = _Metrics()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                info = ChunkInfo.from_json(get_text(request, "chunk_info"))
                kv = get_array(request, "kv", np.float16)
                assembled = self.assembler.add(info, kv)
                if assembled is None:  # more chunks of this request to come
                    sender.send(flags=FINAL)
                    continue
                ids = get_array(request, "input_ids", np.int32, ndim=1).tolist()
                max_tokens = int(get_scalar(request, "max_tokens", np.int32))
                for event in generate(self.engine, ids, max_tokens, assembled):
                    if event.final:
                        self.metrics.record(event.stats)
                        _safely(record_request, self.costs, event.stats, self.settings.chunk_tokens)
                    sender.send(pb_utils.InferenceResponse([
                        tensor("output_ids", np.array([event.token], np.int32)),
                        text_tensor("text_output", event.text),
                        tensor("reused_tokens", np.array([assembled.reused_tokens], np.int32)),
                        text_tensor("stats", json.dumps(event.stats) if event.stats else "{}"),
                    ]))
                sender.send(flags=FINAL)
            except Exception as exc:
                sender.send(error_response(exc), flags=FINAL)
        return None


def _safely(fn, *args):
    try:
        fn(*args)
    except OSError:  # a cost file we cannot write only makes the fetcher's estimates staler
        pass


class _Metrics:
    """Prometheus counters on the server's metrics endpoint (reuse and fallbacks)."""

    def __init__(self):
        counter = pb_utils.MetricFamily.COUNTER
        self.requests = pb_utils.MetricFamily("kvcodec_requests_total", "Requests answered, by outcome", counter)
        self.tokens = pb_utils.MetricFamily("kvcodec_reused_tokens_total", "Prompt tokens served from stored KV", counter)
        self.bytes = pb_utils.MetricFamily("kvcodec_fetched_bytes_total", "KV chunk bytes fetched", counter)
        self._by_outcome = {}
        self._tokens = self.tokens.Metric(labels={})
        self._bytes = self.bytes.Metric(labels={})

    def record(self, stats):
        if stats.get("reused_tokens"):
            outcome = "partial" if stats.get("miss_reason") else "reuse"
        else:
            outcome = "prefill"
        if outcome not in self._by_outcome:
            self._by_outcome[outcome] = self.requests.Metric(labels={"outcome": outcome})
        self._by_outcome[outcome].increment(1)
        self._tokens.increment(int(stats.get("reused_tokens", 0)))
        self._bytes.increment(int(stats.get("bytes_fetched", 0)))
