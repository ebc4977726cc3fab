"""The vLLM engine (``vllm``): paged KV, continuous batching, restored KV through a KV connector.

It keeps the contract of ``kvcodec.engines``. One ``LLMEngine`` runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler, worker and model in one process, which the
in-process hand-off of ``vllm_connector`` needs) and one thread steps it; ``stream`` may be called
from many threads at once, and the requests in flight are batched by vLLM's scheduler, reuse and
prefill mixed.

- ``stream(ids, max_tokens, past_kv=None, report=None, load=None)``: posts the request's
  ``LoadSession`` (``load``: chunks still arriving, ``takes_session``; or ``past_kv``, KV in hand) as
  an ``Offer``, adds the request, yields its tokens as the engine steps. The connector loads the
  session into the request's blocks (block-aligned, at least one prompt token computed), chunk by
  chunk as they arrive while vLLM steps the other requests; ``report`` (an ``engines.StreamReport``),
  if given, receives ``reused_tokens`` (what the engine took), ``promised_tokens``, ``async_load``,
  ``load_s``, ``saved_chunks``, ``save_copy_s``.
- Write-back (``Settings.writeback``, default the ladder's first rung; ``off`` turns it off): the
  prompt's new full chunks are read out of the blocks after its prefill (``wait_for_save``) and
  encoded and stored by one background thread (``connector.WriteBack``, bounded: a full queue
  drops, counted), so encoding adds nothing to this request's TTFT.
- ``prefill_chunks`` (ingest) runs a one-token request whose save sink collects the chunks: the
  KV is the engine's own, exactly (``kv_dtype`` float32 on the CPU build).

The model's identity is the model files' identity plus ``/vllm-<dtype>``: vLLM's KV differs from
the transformers engine's in the last bits, so chunks of one engine are misses for the other, and
the ``raw`` rung is bit-exact to the engine that reuses it.

vLLM's own engine arguments (``EngineArgs`` names) come from the setting ``vllm_engine_args``
(``KVCODEC_VLLM_ENGINE_ARGS``, a JSON object), merged over this engine's defaults by ``engine_args``:
the model's whole context (``max_position_embeddings``), float16 on a GPU with vLLM's own CUDA
graphs, float32 and ``enforce_eager`` on the CPU build (what ran there: ../shared/FINDINGS.md).
``gpu_memory_utilization``, ``max_num_seqs``, ``quantization``, ``max_model_len``, ``enforce_eager``,
``dtype`` and the rest pass through as given; the model card (``kv_dtype``, ``max_context``, the
identity) follows what is passed. Refused, naming them: names ``EngineArgs`` does not have (checked
when vLLM is imported, at the engine's start), names a setting of ours owns (``OWN_ARGS``), and values
the connector cannot serve (``_check_args``).
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import replace
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence

import numpy as np

from ..compose import open_writes
from ..errors import BadRequest, ConfigError, Unsupported
from ..serving.sampling import ENGINE_FIELDS, GREEDY, Sampling
from . import ModelCard, StreamReport, model_files
from .vllm_handoff import ENSEMBLE, HANDOFF, MODE_KEY, Offer

log = logging.getLogger("kvcodec.vllm")

# Settings that worked on the CPU build (../shared/FINDINGS.md); an operator's own values win.
ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (182 blocks of 128 tokens for SmolLM2-135M)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # stdout is the program's (``--json`` output)
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def _utf8_locale() -> None:
    """An embedded interpreter (Triton's python stub) starts in the C locale, where ``open()``
    reads ASCII; torch, imported by vLLM, reads UTF-8 templates. Take the environment's locale
    (``LANG``/``LC_ALL``, UTF-8 in ``kvcodec_tools.tritonserver``) or C.UTF-8 for text encoding."""
    import locale

    if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
        return
    for name in ("", "C.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
        except locale.Error:
            continue
        if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
            return
    log.warning("no UTF-8 locale: importing vLLM may fail to read its templates")


# The engine's scheduling defaults, measured (``kvcodec bench load``, perf/results/reuse_under_load.json):
# with two reuse and two prefill requests in flight through a 100 Mbit/s link, vLLM's own (4096 tokens a
# step, whole prefills) gave reuse 0.97x prefill's TTFT; 512-token steps with 128-token prefill slices
# gave 0.43x (0.28x with 8 clients) at 0.90x (0.97x) the requests/s.
STEP_TOKENS = 512
PREFILL_SLICE = 128


def _scheduling(settings, max_model_len: Optional[int] = None) -> dict:
    """vLLM's scheduling levers from the settings (``step_tokens``, ``prefill_slice``; 0: this engine's
    defaults above; a slice as large as the step turns slicing off)."""
    slice_tokens = settings.prefill_slice or PREFILL_SLICE
    return {"max_num_batched_tokens": settings.step_tokens or STEP_TOKENS,
            "long_prefill_token_threshold": min(slice_tokens, max_model_len) if max_model_len else slice_tokens}


def _on_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _device_dtype() -> str:
    return "float16" if _on_gpu() else "float32"


# EngineArgs names a setting of ours owns, or the engine itself: vllm_engine_args refuses them, saying which.
OWN_ARGS = {
    "model": "the model folder is the setting model (KVCODEC_MODEL)",
    "tokenizer": "the tokenizer is the model folder's (setting model)",
    "kv_transfer_config": "the KVCodec connector is how restored chunks reach the engine",
    "enable_prefix_caching": "the setting prefix_cache (KVCODEC_PREFIX_CACHE) turns vLLM's prefix cache on or off",
    "max_num_batched_tokens": "the setting step_tokens (KVCODEC_STEP_TOKENS) sets it",
    "long_prefill_token_threshold": "the setting prefill_slice (KVCODEC_PREFILL_SLICE) sets it",
}
# what a card's kv_dtype may be (kvcodec.engines.KV_DTYPES), by vLLM's names for it
DTYPES = {"float16": "float16", "half": "float16", "float32": "float32", "float": "float32"}
SINGLE_PROCESS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def parse_engine_args(text: str) -> Dict[str, Any]:
    """``vllm_engine_args``' JSON object ("" -> {})."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"vllm_engine_args must be a JSON object of vLLM's EngineArgs names, got {text!r}: "
                          f"{exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"vllm_engine_args must be a JSON object of vLLM's EngineArgs names, got {text!r}")
    return value


def engine_args(settings, model_context: int, on_gpu: bool,
                known: Optional[frozenset] = None) -> Dict[str, Any]:
    """vLLM's engine arguments for ``settings`` but the model and the connector: this engine's
    defaults (the model's context ``model_context``; float32 and eager on the CPU build, float16 and
    vLLM's CUDA graphs on a GPU; seed 0; the scheduling levers) with ``vllm_engine_args`` over them.
    ``known``: ``EngineArgs``' field names, when vLLM is imported (unknown names are refused then).
    ``ConfigError`` names every name or value refused."""
    given = parse_engine_args(getattr(settings, "vllm_engine_args", "") or "")
    problems = []
    unknown = sorted(name for name in given if known is not None and name not in known)
    if unknown:
        problems.append(f"not vLLM EngineArgs names: {', '.join(unknown)}")
    owned = sorted(name for name in given if name in OWN_ARGS)
    problems += [f"{name}: {OWN_ARGS[name]}" for name in owned]
    if problems:
        raise ConfigError("vllm_engine_args: " + "; ".join(problems))
    args: Dict[str, Any] = {"dtype": "float16" if on_gpu else "float32", "max_model_len": model_context, "seed": 0,
                            "disable_log_stats": True,
                            "max_logprobs": -1}  # continuation_logprobs asks for the whole vocabulary
    if not on_gpu:
        args["enforce_eager"] = True  # the CPU build: what ran (FINDINGS)
    args.update(given)
    _check_args(args, model_context)
    args["dtype"] = DTYPES[str(args["dtype"])]
    args.update(_scheduling(settings, int(args["max_model_len"])))
    return args


def _check_args(args: Mapping[str, Any], model_context: int) -> None:
    """What the connector and the card need of vLLM's arguments, each refusal naming the argument."""
    problems = []
    if str(args["dtype"]) not in DTYPES:
        problems.append(f"dtype {args['dtype']!r}: the stored KV is float16 or float32 "
                        f"({', '.join(DTYPES)}); bfloat16 and auto are not served")
    if str(args.get("kv_cache_dtype", "auto")) != "auto":
        problems.append(f"kv_cache_dtype {args['kv_cache_dtype']!r}: the connector reads and writes the KV in "
                        "the model's dtype (auto)")
    length = args["max_model_len"]
    if isinstance(length, bool) or not isinstance(length, int) or not 1 <= length <= model_context:
        problems.append(f"max_model_len {length!r}: a whole number of tokens, at most the model's "
                        f"max_position_embeddings ({model_context})")
    for name in SINGLE_PROCESS:
        if args.get(name, 1) != 1:
            problems.append(f"{name} {args[name]!r}: the llm step hands restored chunks to vLLM's worker in its own "
                            "process; workers in other processes never see them (1 only)")
    seqs = args.get("max_num_seqs", 1)
    if isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 1:
        problems.append(f"max_num_seqs {seqs!r}: a positive whole number")
    if args.get("distributed_executor_backend", "uni") not in ("uni", None):
        problems.append(f"distributed_executor_backend {args['distributed_executor_backend']!r}: uni only "
                        "(the connector's halves meet in one process)")
    if problems:
        raise ConfigError("vllm_engine_args: " + "; ".join(problems))


def engine_arg_names() -> frozenset:
    """``EngineArgs``' field names (imports vLLM)."""
    from dataclasses import fields

    from vllm import EngineArgs

    return frozenset(f.name for f in fields(EngineArgs))


# vLLM-CPU 0.32 keeps a seeded request's draws in a torch CPU generator, and rewinds it after a step
# that prefilled the request only in part (``gpu_model_runner._bookkeeping_sync``:
# ``gen.set_offset(...)``), which a CPU generator refuses ("CPU Generator does not use offset"): the
# step fails, and with it every request in it. A prompt's prefill is split whenever it does not fit
# the step's token budget (long prompts, or the budget shared with other requests), so on the CPU
# build a seed is refused (INVALID_ARG naming it); sampling without a seed works.
CPU_UNSEEDED = frozenset({"seed"})


class VllmEngine(model_files.EngineFiles):
    name = "vllm"
    sampling_fields = ENGINE_FIELDS  # every field but stop_words (serving.generate's), as vLLM's SamplingParams
    # (on the CPU build all but seed: CPU_UNSEEDED)
    max_concurrency = 32  # requests in flight; vLLM's scheduler batches them (and queues past its KV space)
    takes_session = True  # takes a request at its first chunk and loads the rest as it arrives

    @classmethod
    def model_card(cls, settings) -> ModelCard:
        """The model files' card with what vLLM is given (``engine_args``): its dtype (in the identity
        too) and its context."""
        base = model_files.card_for(settings)
        args = engine_args(settings, base.max_context, _on_gpu())
        dtype = args["dtype"]
        return replace(base, model_id=f"{base.model_id}/vllm-{dtype}", kv_dtype=dtype,
                       max_context=int(args["max_model_len"]))

    @classmethod
    def honoured_fields(cls, card) -> frozenset:
        """All of ENGINE_FIELDS; on the CPU build (float32 KV) all but CPU_UNSEEDED."""
        return ENGINE_FIELDS - CPU_UNSEEDED if card.kv_dtype == "float32" else ENGINE_FIELDS

    @classmethod
    def from_settings(cls, settings) -> "VllmEngine":
        return cls(settings)

    def __init__(self, settings) -> None:
        for name, value in ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise Unsupported("the vllm engine needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (the connector's hand-off is "
                              "in-process)")
        if settings.threads:
            os.environ.setdefault("OMP_NUM_THREADS", str(settings.threads))
        _utf8_locale()
        from vllm import EngineArgs, LLMEngine
        from vllm.config import KVTransferConfig


        files = self._bind(settings)
        chosen = engine_args(settings, model_files.card_for(settings).max_context, _on_gpu(),
                             known=engine_arg_names())
        if (chosen["dtype"], chosen["max_model_len"]) != (self.card.kv_dtype, self.card.max_context):
            raise ConfigError(f"vllm_engine_args give dtype {chosen['dtype']}, max_model_len {chosen['max_model_len']}; "
                              f"the model card says {self.card.kv_dtype}, {self.card.max_context}")
        if "max_num_seqs" in chosen:  # the llm step keeps this many requests in flight
            self.max_concurrency = int(chosen["max_num_seqs"])
        log.info("vLLM engine arguments: %s", json.dumps(chosen, sort_keys=True, default=str))
        args = EngineArgs(
            model=str(files.path), enable_prefix_caching=settings.prefix_cache,  # the first tier (setting prefix_cache)
            **chosen,
            kv_transfer_config=KVTransferConfig(kv_connector="KVCodecConnector", kv_role="kv_both",
                                                kv_connector_module_path="kvcodec.engines.vllm_connector",
                                                # the llm step posts each request's offer (not standalone)
                                                kv_connector_extra_config={MODE_KEY: ENSEMBLE},
                                                # a chunk that fails after its tokens were promised:
                                                # vLLM recomputes its blocks (its default fails the request)
                                                kv_load_failure_policy="recompute"),
        )
        self._engine = LLMEngine.from_engine_args(args)
        self.sampling_fields = self.honoured_fields(self.card)  # the CPU build: seeded draws would break its steps
        self._inbox: "queue.Queue" = queue.Queue()
        self._streams: Dict[str, tuple] = {}  # request id -> (its queue, whether it wants its whole output)
        self._ids = itertools.count()
        self._told: set = set()  # requests whose cached-token count was passed on
        self._stop = threading.Event()
        self.writeback = open_writes(settings, self.card)
        self._thread = threading.Thread(target=self._loop, name="vllm-engine", daemon=True)
        self._thread.start()

    # -- the contract (geometry, tokenize, detokenizer: model_files.EngineFiles) ------------------
    def stream(self, ids: Sequence[int], max_tokens: int, past_kv: Optional[np.ndarray] = None,
               report: Optional[StreamReport] = None, load=None, sampling: Sampling = GREEDY,
               salt: str = "") -> Iterator[int]:
        if len(ids) == 0:
            raise BadRequest("prompt is empty")
        if past_kv is not None and past_kv.shape[3] >= len(ids):
            raise BadRequest("restored KV covers the whole prompt; at least one token must be computed")
        save = self.writeback.for_prompt(list(ids), salt) if self.writeback is not None else None
        yield from self._run(ids, max_tokens, load if load is not None else past_kv, save, report,
                             sampling=sampling, salt=salt)

    def prefill_chunks(self, ids: Sequence[int], chunk_tokens: int) -> Iterator[np.ndarray]:
        if chunk_tokens != self.chunk_tokens:
            raise Unsupported(f"the vllm engine saves chunks of {self.chunk_tokens} tokens, asked for {chunk_tokens}")
        chunks: Dict[int, np.ndarray] = {}

        def capture(saved) -> None:
            chunks.update((index, kv.get()) for index, _, kv in saved)

        for _ in self._run(ids, 1, None, capture, None, private=True):  # computed: every chunk saved
            pass
        for index in range(len(ids) // chunk_tokens):
            yield chunks[index]

    def continuation_logprobs(self, past_kv: np.ndarray, ids: Sequence[int]) -> np.ndarray:
        """Log-probabilities over the whole vocabulary (``[len(ids), vocab]``) of the token after
        each of ``ids``, on ``past_kv`` loaded through the connector: one request per position
        (``ids[:i+1]`` after the prefix, one token with its full distribution), all batched.
        vLLM's prompt log-probabilities would need one request, but a request that asks for them
        takes no KV from a connector (every prompt token must be computed). The prefix's token ids
        do not matter (its KV is loaded, never computed), so it must be whole blocks."""
        from concurrent.futures import ThreadPoolExecutor

        n = int(past_kv.shape[3])
        block = self._block_size()
        if n % block:
            raise Unsupported(f"the vllm engine scores a prefix of whole {block}-token blocks, got {n} tokens")
        extra = dict(logprobs=-1, detokenize=False)

        def row(i: int) -> np.ndarray:
            report = StreamReport()
            output = list(self._run([0] * n + list(ids[:i + 1]), 1, past_kv, None, report, extra, private=True))[-1]
            if report.reused_tokens != n:
                raise Unsupported(f"vLLM took {report.reused_tokens} of the {n} prefix tokens")
            dist = output.outputs[0].logprobs[0]
            out = np.full(self.card.vocab_size, -np.inf, dtype=np.float32)
            out[np.fromiter(dist.keys(), dtype=np.int64, count=len(dist))] = np.fromiter(
                (v.logprob for v in dist.values()), dtype=np.float32, count=len(dist))
            return out

        with ThreadPoolExecutor(8) as pool:
            return np.stack(list(pool.map(row, range(len(ids)))))

    def _block_size(self) -> int:
        return int(self._engine.vllm_config.cache_config.block_size)

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)
        super().close()  # the write-back sink

    # -- one request --------------------------------------------------------------------------
    def _run(self, ids, max_tokens: int, past, save, report: Optional[StreamReport],
             extra: Optional[dict] = None, sampling: Sampling = GREEDY, private: bool = False,
             salt: str = "") -> Iterator:
        """The request's tokens as they come; with ``extra`` (more sampling parameters) its one
        final ``RequestOutput`` instead. ``past``: a ``LoadSession``, KV in hand, or None.
        ``private``: a cache salt of its own, so vLLM's prefix cache gives it nothing (ingest must
        compute every chunk it saves; scoring must load the KV it is given); else ``salt``, the
        request's cache salt: vLLM's prefix cache keeps tenants apart by it."""
        from ..connector import LoadSession

        request_id = f"kvc{next(self._ids)}x{uuid.uuid4().hex[:8]}"
        session = LoadSession.of(past, self.chunk_tokens) if isinstance(past, np.ndarray) else past
        offer = Offer(session=session, chunk_tokens=self.chunk_tokens, save=save,
                      defer=not self.settings.async_loads)
        HANDOFF.post(request_id, offer)
        tokens: "queue.Queue" = queue.Queue()
        params = extra if extra else vllm_sampling(sampling)  # a scoring request's, or the sampling's
        prompt = {"prompt_token_ids": list(ids)}
        if private or salt:
            prompt["cache_salt"] = request_id if private else salt
        self._inbox.put(("add", request_id, prompt, int(max_tokens), tokens, params))
        done = False
        try:
            while True:
                item = tokens.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    done = True
                    return
                if isinstance(item, tuple):  # ("cached", n): what vLLM did not compute, local and loaded
                    if report is not None and self.settings.prefix_cache:
                        report.local_tokens = max(0, int(item[1]) - offer.promised_tokens)
                    continue
                if report is not None and report.reused_tokens is None:
                    report.reused_tokens, report.promised_tokens = offer.loaded_tokens, offer.promised_tokens
                    report.async_load, report.load_s = offer.asynchronous, round(offer.load_s, 6)
                yield item
        finally:
            if not done:
                self._inbox.put(("abort", request_id))
            HANDOFF.pop(request_id)
            if report is not None:
                report.saved_chunks = offer.saved_chunks
                report.save_copy_s = round(offer.save_s, 6)

    def _loop(self) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self._engine
        while not self._stop.is_set():
            commands = [] if self._streams else [self._inbox.get()]  # idle: wait for work
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is None:
                    return
                if command[0] == "add":
                    _, request_id, prompt, max_tokens, out, extra = command
                    try:
                        whole = "logprobs" in extra  # a scoring request: its one final output
                        kind = RequestOutputKind.FINAL_ONLY if whole else RequestOutputKind.DELTA
                        params = SamplingParams(max_tokens=max_tokens, output_kind=kind,
                                                **{"temperature": 0.0, **extra})
                        engine.add_request(request_id, prompt, params)
                        self._streams[request_id] = (out, whole)
                    except Exception as exc:  # e.g. a prompt longer than the engine's context, a bad word
                        out.put(BadRequest(str(exc)[:300]) if _refused(exc) else exc)
                elif command[0] == "abort":
                    self._told.discard(command[1])
                    if self._streams.pop(command[1], None) is not None:  # still running
                        engine.abort_request([command[1]])
            if not self._streams:
                continue
            try:
                outputs = engine.step()
                if not outputs:  # a prefill step in chunks, or only requests waiting for their chunks:
                    time.sleep(0.002)  # do not spin a core the fetch and decode steps need
            except Exception as exc:
                log.exception("vLLM engine step failed")
                for out, _ in self._streams.values():
                    out.put(exc)
                self._streams.clear()
                continue
            for output in outputs:
                if output.request_id not in self._streams:
                    continue
                out, whole = self._streams[output.request_id]
                if whole:  # a scoring request (``extra``): its one final output
                    out.put(output)
                else:
                    if output.num_cached_tokens is not None and output.request_id not in self._told:
                        out.put(("cached", output.num_cached_tokens))  # once, before the first token
                        self._told.add(output.request_id)
                    for token in output.outputs[0].token_ids:
                        out.put(int(token))
                if output.finished:
                    out.put(None)
                    del self._streams[output.request_id]
                    self._told.discard(output.request_id)


def _refused(exc: Exception) -> bool:
    """Whether vLLM refused the request itself (bad input, not a failure of the engine)."""
    from vllm.exceptions import VLLMClientError

    return isinstance(exc, (ValueError, VLLMClientError))


def vllm_sampling(sampling: Sampling) -> dict:
    """``SamplingParams`` arguments of ``sampling`` (its neutral values left to vLLM's defaults);
    ``end_id`` ends the answer in place of the model's end-of-sequence token."""
    out = {name: getattr(sampling, name) for name in sampling.asked()
           if name in ("temperature", "top_p", "top_k", "seed", "min_tokens", "repetition_penalty",
                       "presence_penalty", "frequency_penalty")}
    if sampling.end_id is not None:
        out.update(stop_token_ids=[sampling.end_id], ignore_eos=True)
    if sampling.bad_words:
        out["bad_words"] = list(sampling.bad_words)
    return out
