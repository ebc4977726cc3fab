"""llm: hand a request's restored chunks to the engine, generate; one response per new token.

The engine comes from the registry (``engine`` setting, ``KVCODEC_ENGINE``). ``execute`` only files
chunks (``Assembler``, on Triton's thread). An engine that loads chunks as they arrive
(``streams_loads``: vLLM) gets the request at its first chunk, answered on a worker thread through
that chunk's response sender while the later chunks flow into its load session; any other engine
gets the request once its chunks are all in. Up to ``engine.max_concurrency`` requests are answered
at once (1 for the transformers engine; many for vLLM, which batches them). Every request's stream
ends with a FINAL response, also when generation fails half-way.

One instance only (``instance_count`` > 1 fails the load): the chunks of a request arrive as
separate calls, and Triton gives each call to any instance, so they meet in one instance's
``Assembler``; requests run side by side inside it, batched by the engine (vLLM), as Triton's own
vLLM and TensorRT-LLM backends run one engine per model. The steps before it hold no state across
calls and take any ``instance_group`` count (``kvcodec repository --instances``).

Calls into ``pb_utils`` (responses, metrics) go through one lock: the stub's shared-memory
allocator is not thread-safe (concurrent metric updates crashed the server with
``boost::interprocess::lock_exception`` in ``Metric::SendIncrementRequest``).
"""
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from kvcodec.connector.writeback import COUNTS, Increments
from kvcodec.engines import open_engine
from kvcodec.errors import ConfigError, KVCodecError
from kvcodec.serving.assemble import Assembler
from kvcodec.serving.chunkinfo import ChunkInfo
from kvcodec.serving.costs import for_settings, record_request
from kvcodec.serving.generate import generate
from kvcodec.settings import Settings
from kvcodec.triton import (
    FINAL,
    error_response,
    get_array,
    get_scalar,
    get_tensor,
    get_text,
    instance_count,
    model_parameters,
    tensor,
    text_tensor,
)

log = logging.getLogger("kvcodec.llm")


class TritonPythonModel:
    def initialize(self, args):
        if instance_count(args) > 1:
            raise ConfigError(f"llm runs as one instance, got {instance_count(args)}: a request's chunks meet in one "
                              f"instance and its engine batches the requests; give kv_fetch, kv_decode and "
                              f"kv_restore more instances instead")
        self.settings = Settings.load(model_parameters(args))
        self.engine = open_engine(self.settings)
        self.costs = for_settings(self.settings, self.engine.geometry(1).fp16_bytes)
        self.assembler = Assembler()
        self.streams = self.engine.streams_loads and self.settings.stream_loads
        self.metrics = _Metrics()
        self.pb_lock = threading.Lock()  # one thread at a time in pb_utils (see the module's docstring)
        self.workers = ThreadPoolExecutor(max_workers=max(1, int(self.engine.max_concurrency)),
                                          thread_name_prefix="llm")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                info = ChunkInfo.from_json(get_text(request, "chunk_info"))
                # where kv_restore left it: a device tensor stays on the device into a streaming engine
                kv32 = get_tensor(request, "kv32", np.float32)  # float32 (raw, a float32 engine's own) or empty
                kv = kv32 if _size(kv32) else get_tensor(request, "kv", np.float16)
                arrival = self.assembler.arrive(info, kv)  # copied into the request's load session
                if arrival.assembled is not None:  # nothing to reuse
                    source = arrival.assembled
                elif self.streams and arrival.first:  # the engine takes the request now
                    source = arrival.chunks
                elif not self.streams and arrival.complete:
                    source = arrival.chunks.assembled()
                else:  # a chunk of a request already answered, or still gathering
                    self._send(sender, None, FINAL)
                    continue
                ids = get_array(request, "input_ids", np.int32, ndim=1).tolist()
                max_tokens = int(get_scalar(request, "max_tokens", np.int32))
            except Exception as exc:
                self._send(sender, error_response(exc), FINAL)
                continue
            self.workers.submit(self._answer, sender, ids, max_tokens, source)
        return None

    def _answer(self, sender, ids, max_tokens, source):
        """Generate and stream one request's tokens (a worker thread); always ends with FINAL."""
        final_sent = False
        events = generate(self.engine, ids, max_tokens, source)
        try:
            reused = tensor("reused_tokens", np.array([getattr(source, "reused_tokens", 0)], np.int32))
            for event in events:
                if event.final:
                    with self.pb_lock:
                        self.metrics.record(event.stats)
                        self.metrics.writeback(self.engine)
                    _safely(record_request, self.costs, event.stats, self.settings.chunk_tokens)
                if event.stats:
                    reused = tensor("reused_tokens", np.array([event.stats.reused_tokens], np.int32))
                stats = json.dumps(event.stats.to_dict()) if event.stats else "{}"
                self._send(sender, pb_utils.InferenceResponse([
                    tensor("output_ids", np.array([event.token], np.int32)),
                    text_tensor("text_output", event.text),
                    reused,
                    text_tensor("stats", stats),
                ]))
                if not event.final and self._cancelled(sender):  # the client went away: stop computing
                    with self.pb_lock:
                        self.metrics.cancelled()
                    break
        except Exception as exc:
            if not isinstance(exc, KVCodecError):
                log.exception("generation failed")
            self._send(sender, error_response(exc), FINAL)
            final_sent = True
        finally:
            events.close()  # a generation left early ends in the engine too (vLLM aborts the request)
            if not final_sent:
                self._send(sender, None, FINAL)

    def _cancelled(self, sender) -> bool:
        with self.pb_lock:
            return bool(sender.is_cancelled())

    def _send(self, sender, response, flags=0):
        with self.pb_lock:
            if response is None:
                sender.send(flags=flags)
            else:
                sender.send(response, flags=flags)

    def finalize(self):
        self.workers.shutdown(wait=True, cancel_futures=True)
        self.engine.close()
def _size(value) -> int:
    return int(value.size if isinstance(value, np.ndarray) else value.numel())


def _safely(fn, *args):
    try:
        fn(*args)
    except OSError:  # a cost file we cannot write only makes the fetcher's estimates staler
        pass


SECONDS_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


class _Metrics:
    """Prometheus metrics on the server's metrics endpoint: requests by outcome and by why reuse
    stopped, reused tokens, fetched bytes, and histograms of each request's TTFT (server side) and
    of its fetch, decode and restore seconds; the engine's write-back counts by state and the jobs
    pending, brought up to date at the end of each request (docs/operations.md, "Metrics")."""

    def __init__(self):
        counter = pb_utils.MetricFamily.COUNTER
        histogram = pb_utils.MetricFamily.HISTOGRAM
        self.misses = pb_utils.MetricFamily("kvcodec_misses_total", "Requests whose reuse stopped short, by reason",
                                            counter)
        self._by_reason = {}
        self._seconds = {}
        for name, what in (("ttft", "Server time to first token"), ("fetch", "Store read seconds of a request"),
                           ("decode", "Decode seconds of a request"), ("restore", "Restore seconds of a request")):
            family = pb_utils.MetricFamily(f"kvcodec_{name}_seconds", what, histogram)
            self._seconds[name] = (family, family.Metric(labels={}, buckets=SECONDS_BUCKETS))
        self.requests = pb_utils.MetricFamily("kvcodec_requests_total", "Requests answered, by outcome", counter)
        self.tokens = pb_utils.MetricFamily("kvcodec_reused_tokens_total", "Prompt tokens served from stored KV",
                                            counter)
        self.bytes = pb_utils.MetricFamily("kvcodec_fetched_bytes_total", "KV chunk bytes fetched", counter)
        self._by_outcome = {}
        # a MetricFamily must outlive its metrics (a deleted family fails their updates): each is kept
        self.cancels = pb_utils.MetricFamily("kvcodec_cancelled_total",
                                             "Requests whose client went away before the last token", counter)
        self._cancelled = self.cancels.Metric(labels={})
        self._tokens = self.tokens.Metric(labels={})
        self._bytes = self.bytes.Metric(labels={})
        self.saves = pb_utils.MetricFamily("kvcodec_writeback_total", "Write-back jobs after a miss, by state "
                                           "(queued, stored, dropped: queue full, failed: the store refused)", counter)
        self._saves = {state: self.saves.Metric(labels={"state": state}) for state in COUNTS}
        self.pending = pb_utils.MetricFamily("kvcodec_writeback_pending", "Write-back jobs waiting or running",
                                             pb_utils.MetricFamily.GAUGE)
        self._pending = self.pending.Metric(labels={})
        self._save_increments = Increments()

    def writeback(self, engine):
        stats = engine.writeback_stats()
        if not stats:
            return
        for state, n in self._save_increments.since(stats).items():
            if n:
                self._saves[state].increment(n)
        self._pending.set(float(stats.get("pending", 0)))

    def cancelled(self):
        self._cancelled.increment(1)

    def record(self, stats):
        outcome = stats.outcome
        if outcome not in self._by_outcome:
            self._by_outcome[outcome] = self.requests.Metric(labels={"outcome": outcome})
        self._by_outcome[outcome].increment(1)
        self._tokens.increment(int(stats.reused_tokens))
        self._bytes.increment(int(stats.bytes_fetched))
        reason = stats.miss_status
        if reason:
            if reason not in self._by_reason:
                self._by_reason[reason] = self.misses.Metric(labels={"reason": reason})
            self._by_reason[reason].increment(1)
        for name, value in (("ttft", stats.server_ttft_s), ("fetch", stats.fetch_s), ("decode", stats.decode_s),
                            ("restore", stats.restore_s)):
            if value is not None:
                self._seconds[name][1].observe(float(value))
