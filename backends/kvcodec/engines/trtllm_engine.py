"""The TensorRT-LLM engine (``trtllm``): the ensemble's ``llm`` step hosting TensorRT-LLM's LLM API
(PyTorch backend), fed by the kv_fetch -> kv_decode -> kv_restore steps through its KV connector.

Written against TensorRT-LLM 1.2.x's documented LLM API (``tensorrt_llm.LLM``, ``SamplingParams``,
``generate_async(..., streaming=True)``) and its KV connector; it has not run here: TensorRT-LLM
does not install on these machines, nor on the lent GPU machine (no registry there). The connector
it drives is replay-tested on CPU (``tests/unit/test_trtllm_connector.py``), the same way the vLLM
engine's connector runs for real in CI.

- In process: ``TLLM_WORKER_USE_SINGLE_PROCESS=1`` (set before the first ``LLM(...)``; TensorRT-LLM's
  own connector tests use it) keeps the executor and both connector halves in this process, as the
  vLLM engine does with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so restored chunks are handed over in
  memory (``trtllm_shared.SHARED``), never through a file or CUDA IPC.
- ``stream(ids, max_tokens, load=session)`` (``takes_session``): the llm step hands the request over
  at its first chunk; this waits (in the step's worker thread, never on TensorRT-LLM's executor)
  until the session's usable prefix is settled, stages that KV under the prompt's prefix (in the
  pool's dtype, on its device: a device tensor from ``kv_restore`` stays there), then submits the
  prompt. The connector's scheduler finds it staged and promises exactly those tokens, written in
  the same step before the forward; nothing that can still fail is promised (TensorRT-LLM has no
  way to take a promise back). ``report`` receives
  ``reused_tokens`` (what the connector promised) and ``staged_tokens``.
- Write-back after a miss is the connector worker's (``trtllm_worker``, ``writeback`` rungs); the
  connector's settings come from ``Settings`` through a config file this engine writes under
  ``<home>/trtllm/`` and names in ``TRTLLM_KVCODEC_CONFIG`` (``prefetch`` off: the steps read).
- ``prefill_chunks`` (ingest) and ``continuation_logprobs`` (eval) are not offered: ingest through the
  transformers engine is not this engine's KV; send the context once instead (its write-back stores
  it) or use the stock LLM-API deployment's prefetch (docs/deploy-trtllm.md).

The model's identity is the model files' identity plus ``/trtllm-float16`` (TensorRT-LLM's KV differs
from the other engines' in the last bits; ``raw`` chunks are bit-exact to the engine that reuses
them).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, replace
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ..errors import BadRequest, Unsupported
from ..serving.sampling import ENGINE_FIELDS, GREEDY, Sampling
from . import ModelCard, StreamReport, model_files

log = logging.getLogger("kvcodec.trtllm")

KV_DTYPE = "float16"
SINGLE_PROCESS_ENV = "TLLM_WORKER_USE_SINGLE_PROCESS"
CONNECTOR_MODULE = "kvcodec.engines.trtllm_connector"


DEFAULT_KV_FRACTION = 0.6  # Settings.trtllm_kv_fraction's default (TensorRT-LLM's own is 0.9)


def llm_arguments(model: str, tokens_per_block: int = 32, kv_fraction: float = DEFAULT_KV_FRACTION,
                  overlap: bool = False) -> Dict[str, Any]:
    """``LLM(**arguments)``: what the connector needs of TensorRT-LLM (also ``model.yaml`` of the stock
    deployment, by ``kvcodec repository``). ``kv_fraction``: ``kv_cache_config.free_gpu_memory_fraction``,
    the share of the GPU memory free after the weights (and TensorRT-LLM's activation estimate) that its
    KV pool takes; the rest is what the stage, ``to_pool``'s transit copies and the other processes on
    the GPU (kv_decode, kv_restore) may grow into (docs/deploy-trtllm.md, "GPU memory"). ``overlap``:
    TensorRT-LLM's overlap scheduler; off by default (``disable_overlap_scheduler``), since in 1.2 only
    ``_executor_loop`` survives a failed KV load (the overlap loop's ``assert sample_state is not
    None`` after a failed forward ends the executor: TensorRT-LLM issue #17913; docs/deploy-trtllm.md)."""
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
    if not 0.0 < kv_fraction < 1.0:
        raise ValueError(f"kv_fraction (free_gpu_memory_fraction) must be in (0, 1), got {kv_fraction}")
    return {
        "model": model,
        "backend": "pytorch",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "dtype": KV_DTYPE,  # the model card's kv_dtype: the KV pool is float16, the raw rung stores it
        "attn_backend": "TRTLLM",  # the block layout the connector writes
        "kv_cache_config": {"enable_block_reuse": True, "tokens_per_block": tokens_per_block,
                            "free_gpu_memory_fraction": float(kv_fraction)},
        "scheduler_config": {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"},
        "disable_overlap_scheduler": not overlap,
        "kv_connector_config": {"connector_module": CONNECTOR_MODULE,
                                "connector_scheduler_class": "KVCodecScheduler",
                                "connector_worker_class": "KVCodecWorker"},
    }


def connector_settings(settings, card: ModelCard, prefetch: bool) -> Dict[str, Any]:
    """The connector's config file (``trtllm_config.from_mapping``) from ``Settings`` and the card."""
    return {"store": settings.store, "ladder": list(settings.ladder), "chunk_tokens": settings.chunk_tokens,
            "writeback": list(settings.writeback) or "off", "key_file": str(settings.key_file),
            "decoder": settings.decoder, "threads": max(1, settings.threads),
            "fetch_timeout_s": settings.fetch_timeout_s, "prefetch": prefetch, "model": asdict(card),
            "max_pending": settings.writeback_pending, "encrypt_chunks": settings.encrypt_chunks,
            "home": str(settings.home), "local_store": settings.local_store, "local_store_mb": settings.local_store_mb}


class TrtllmEngine(model_files.EngineFiles):
    name = "trtllm"
    max_concurrency = 64  # requests in flight; TensorRT-LLM's executor batches them
    takes_session = True  # the chunks stay where kv_restore left them (the device); waits for the settled run
    sampling_fields = ENGINE_FIELDS  # every field but stop_words (serving.generate's), as its SamplingParams

    @classmethod
    def model_card(cls, settings) -> ModelCard:
        base = model_files.card_for(settings)
        return replace(base, model_id=f"{base.model_id}/trtllm-{KV_DTYPE}", kv_dtype=KV_DTYPE)

    @classmethod
    def from_settings(cls, settings) -> "TrtllmEngine":
        return cls(settings)

    def __init__(self, settings, tokens_per_block: int = 32) -> None:
        os.environ[SINGLE_PROCESS_ENV] = "1"  # before the first LLM(): executor and connector in this process
        try:
            from tensorrt_llm import LLM
            from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig
        except ImportError as exc:
            raise Unsupported(f"the trtllm engine needs TensorRT-LLM 1.2 (NGC's tritonserver -trtllm-python "
                              f"container): {exc}") from None
        from .trtllm_config import CONFIG_ENV

        files = self._bind(settings)
        folder = settings.home / "trtllm"
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "kvcodec-trtllm.json"
        config.write_text(json.dumps(connector_settings(settings, self.card, prefetch=False), indent=2))
        os.environ[CONFIG_ENV] = str(config)
        # Settings.trtllm_kv_fraction; read by name so a Settings without it (older) keeps the default
        kv_fraction = getattr(settings, "trtllm_kv_fraction", DEFAULT_KV_FRACTION)
        args = llm_arguments(str(files.path), tokens_per_block, kv_fraction,
                             overlap=getattr(settings, "trtllm_overlap_scheduler", False))
        args["kv_connector_config"] = KvCacheConnectorConfig(**args["kv_connector_config"])
        self._llm = LLM(**args)

    # -- the contract (geometry, tokenize, detokenizer: model_files.EngineFiles) ------------------
    def stream(self, ids: Sequence[int], max_tokens: int, past_kv: Optional[np.ndarray] = None,
               report: Optional[StreamReport] = None, load=None, sampling: Sampling = GREEDY,
               salt: str = "") -> Iterator[int]:
        from tensorrt_llm import SamplingParams

        from .trtllm_compat import stage_salt
        from .trtllm_shared import SHARED

        if len(ids) == 0:
            raise BadRequest("prompt is empty")
        staged_as = stage_salt(salt)  # what the connector will read off TensorRT-LLM's request
        SHARED.salts.post(staged_as, salt)  # its write-back stores under the tenant's own salt
        staged = stage_restored(list(ids), load, past_kv, self.chunk_tokens, self.settings.fetch_timeout_s,
                                salt=staged_as)
        params = SamplingParams(max_tokens=int(max_tokens), **trtllm_sampling(sampling))
        first = True
        tenant = {"cache_salt": salt} if salt else {}  # TensorRT-LLM's own block reuse keeps tenants apart
        result = self._llm.generate_async(list(ids), sampling_params=params, streaming=True, **tenant)
        client = getattr(result, "request_id", None)  # the LlmRequest's py_client_id (trtllm_compat.client_id)
        for output in result:
            if first and report is not None:
                report.staged_tokens, report.reused_tokens = staged, promised_tokens(ids, client=client)
                first = False
            for token in output.outputs[0].token_ids_diff:
                yield int(token)

    def prefill_chunks(self, ids: Sequence[int], chunk_tokens: int) -> Iterator[np.ndarray]:
        raise Unsupported("the trtllm engine does not ingest: send the context once (its write-back stores it)")

    def continuation_logprobs(self, past_kv: np.ndarray, ids: Sequence[int]) -> np.ndarray:
        raise Unsupported("the trtllm engine does not score codecs: use kvcodec eval --engine transformers or vllm")

    def writeback_stats(self) -> Optional[dict]:
        """The connector workers' write-back counts (``trtllm_worker.writeback_stats``)."""
        from .trtllm_worker import writeback_stats

        return writeback_stats()

    def close(self) -> None:
        self._llm.shutdown()


def stage_restored(ids: List[int], load, past_kv, chunk_tokens: int, timeout_s: float, shared=None,
                   salt: str = "") -> int:
    """Put what the request brings into the connector's stage (its settled, verified prefix) in the
    pool's dtype and on its device (``trtllm_shared.to_pool``): numpy from the host or torch on any
    device, as the ``kv_restore`` step left it; the tokens staged (0 when the stage refused it).
    ``salt``: the stage salt of the request (``trtllm_compat.stage_salt``)."""
    from .trtllm_shared import SHARED, to_pool

    shared = SHARED if shared is None else shared
    if load is not None:
        if not load.wait_settled(timeout_s):
            log.warning("chunks still missing after %.0f s: the prompt is computed", timeout_s)
            return 0
        past_kv = load.past_kv()
    if past_kv is None:
        return 0
    n = min(int(past_kv.shape[3]), len(ids) - 1)
    n -= n % chunk_tokens
    if n <= 0:
        return 0
    kv = to_pool(past_kv[:, :, :, :n], shared.pages)
    return n if shared.stage.put(ids, kv, salt, chunk_tokens) else 0


def promised_tokens(ids: Sequence[int], shared=None, client: Optional[int] = None) -> int:
    """What the connector promised for this request (its scheduler records it by the LLM API's client
    id, ``client``; by prompt where the request it saw had none: ``trtllm_shared.Promised``)."""
    from .trtllm_shared import SHARED

    return (SHARED if shared is None else shared).promised.pop(client=client, ids=list(ids))


def trtllm_sampling(sampling: Sampling) -> dict:
    """TensorRT-LLM ``SamplingParams`` arguments of ``sampling``: greedy is ``top_k=1`` (its LLM API's
    rule, ``SamplingParams._greedy_decoding``; a temperature must be > 0 there), else the fields
    asked for, ``bad_words`` as ``bad``; neutral values are left to its defaults."""
    asked = sampling.asked()
    out = {name: getattr(sampling, name) for name in asked
           if name in ("min_tokens", "end_id", "repetition_penalty", "presence_penalty", "frequency_penalty")}
    if sampling.greedy:
        out["top_k"] = 1
    else:
        out.update((name, getattr(sampling, name)) for name in asked if name in ("temperature", "top_p", "top_k", "seed"))
    if sampling.bad_words:
        out["bad"] = list(sampling.bad_words)
    return out
