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
from kvcodec.serving.answer import pieces
from kvcodec.serving.assemble import Assembler
from kvcodec.serving.chunkinfo import ChunkInfo
from kvcodec.serving.costs import for_settings, record_request
from kvcodec.serving.generate import generate
from kvcodec.serving.request import Reply
from kvcodec.settings import Settings
from kvcodec.triton import (
    FINAL,
    error_response,
    get_array,
    get_scalar,
    get_tensor,
    get_text,
    has_input,
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
                reply = Reply.from_json(get_text(request, "params")) if has_input(request, "params") else Reply()
            except Exception as exc:
                self._send(sender, error_response(exc), FINAL)
                continue
            self.workers.submit(self._answer, sender, ids, max_tokens, source, reply)
        return None

    def _answer(self, sender, ids, max_tokens, source, reply):
        """Generate one request's answer and send it as ``reply`` asks, token by token or whole (a
        worker thread; ``serving.answer``); always ends with FINAL."""
        final_sent = answered = False
        events = generate(self.engine, ids, max_tokens, source, reply.sampling, reply.cache_salt)
        try:
            reused = tensor("reused_tokens", np.array([getattr(source, "reused_tokens", 0)], np.int32))
            for piece in pieces(events, reply, ids, lambda: self.engine.tokenizer.decode(ids),
                                lambda: self._cancelled(sender)):
                if piece.final:
                    answered = True
                    with self.pb_lock:
                        self.metrics.record(piece.stats)
                        self.metrics.writeback(self.engine)
                    _safely(record_request, self.costs, piece.stats, self.settings.chunk_tokens)
                if piece.stats:
                    reused = tensor("reused_tokens", np.array([piece.stats.reused_tokens], np.int32))
                outputs = [tensor("output_ids", np.array(piece.ids, np.int32)), text_tensor("text_output", piece.text),
                           reused, text_tensor("stats", json.dumps(piece.stats.to_dict()) if piece.stats else "{}")]
                for name in ("num_input_tokens", "num_output_tokens"):
                    if getattr(piece, name) is not None:
                        outputs.append(tensor(name, np.array([getattr(piece, name)], np.int32)))
                whole = piece.final and not reply.stream  # one response, the stream's last
                self._send(sender, pb_utils.InferenceResponse(outputs), FINAL if whole else 0)
                final_sent = final_sent or whole
            if not answered:  # the client went away: generation stopped early
                with self.pb_lock:
                    self.metrics.cancelled()
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
