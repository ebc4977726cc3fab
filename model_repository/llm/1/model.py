"""llm: hand a request's restored chunks to the engine, generate; one response per new token.

The engine comes from the registry (``engine`` setting, ``KVCODEC_ENGINE``). ``execute`` only files
chunks (``Assembler``, on Triton's thread). An engine that loads chunks as they arrive
(``takes_session``: vLLM) gets the request at its first chunk, answered on a worker thread through
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
from kvcodec.triton.metrics import LlmMetrics

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
        self.streams = self.engine.takes_session and self.settings.stream_loads
        self.metrics = LlmMetrics()
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
