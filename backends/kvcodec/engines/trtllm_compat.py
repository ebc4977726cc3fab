"""What differs between TensorRT-LLM releases, in one place, for the connector (``trtllm_connector``).

Target: TensorRT-LLM 1.2.x (what tensorrtllm_backend builds). Read in its source (FINDINGS.md,
"TensorRT-LLM's connector"); none of it has run here (TensorRT-LLM does not install on these
machines): the tests replay its calls on CPU.

- The base classes: ``tensorrt_llm._torch.pyexecutor.kv_cache_connector`` (1.1, 1.2), moved to
  ``...pyexecutor.connectors.kv_cache_connector`` (1.3+). Where TensorRT-LLM is not installed the
  connector derives from stand-ins with the same constructor and metadata binding, so it imports
  and its tests run anywhere (``HAVE_TRTLLM`` says which).
- ``prompt(request)``, ``cache_salt(request)`` (1.2's ``LlmRequest.cache_salt_id``, later
  ``cache_salt``: part of the stage key, so salted prompts never share KV), ``is_dummy(request)``
  (warm-up and padding requests: CUDA-graph and attention-DP dummies never reach the store).
- ``client_id(request)``: the LLM API's id of the request (``LlmRequest.py_client_id``, the id
  ``generate_async``'s result carries as ``request_id``), not the executor's ``request_id``.
- CUDA graphs: before TensorRT-LLM PR #8275 (1.1.x, 1.2.0rc0/rc1) ``create_py_executor`` refused
  connector hooks with CUDA graphs on; ``check_cuda_graphs`` says so at start with the fix
  (add ``cuda_graph_config: null`` to model.yaml) instead of the executor's assertion.
  ``kvcodec repository`` and the ensemble's engine leave CUDA graphs on (TensorRT-LLM's default,
  for 1.2.0rc2 and later): on an older release that line is the operator's to add.
- 1.3+ (KVCacheManagerV2) may honour fewer tokens than the connector offered:
  ``commit_new_matched_tokens(request, num_tokens)`` narrows the load to what was committed.
"""
from __future__ import annotations

import importlib
import logging
import re
from typing import Any, List, Optional, Tuple

from ..errors import Unsupported

log = logging.getLogger("kvcodec.trtllm")

BASE_MODULES = ("tensorrt_llm._torch.pyexecutor.kv_cache_connector",  # 1.1, 1.2
                "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector")  # 1.3+


class SchedulerStandIn:
    """``KvCacheConnectorScheduler``'s constructor, where TensorRT-LLM is not installed."""

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args


class WorkerStandIn:
    """``KvCacheConnectorWorker``'s constructor and metadata binding, where TensorRT-LLM is not installed."""

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        self._metadata = None

    def bind_connector_meta(self, metadata: object) -> None:
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None


def bases() -> Tuple[type, type, Optional[str]]:
    for name in BASE_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                continue  # no TensorRT-LLM, or not this path of it; a dependency it lacks is raised
            raise
        return module.KvCacheConnectorScheduler, module.KvCacheConnectorWorker, name
    return SchedulerStandIn, WorkerStandIn, None


def version() -> Optional[Tuple[int, ...]]:
    try:
        import tensorrt_llm
    except ImportError:
        return None
    found = re.match(r"(\d+)\.(\d+)\.(\d+)(?:rc(\d+))?", str(getattr(tensorrt_llm, "__version__", "")))
    if not found:
        return None
    major, minor, patch, rc = found.groups()
    return int(major), int(minor), int(patch), int(rc) if rc is not None else 1 << 30


def check_cuda_graphs(llm_args: Any, release: Optional[Tuple[int, ...]]) -> None:
    """Refuse, with the fix, what the executor of releases before PR #8275 would assert on."""
    graphs = getattr(llm_args, "cuda_graph_config", None)
    if release is None or graphs is None:
        return
    if release < (1, 2, 0, 2):
        raise Unsupported("TensorRT-LLM before 1.2.0rc2 runs KV connectors only without CUDA graphs: set "
                          "`cuda_graph_config: null` in model.yaml (kvcodec repository leaves CUDA graphs on, as "
                          "TensorRT-LLM 1.2.0rc2 and later run them with a connector: add the line yourself)")


def kv_connector_config(module: str):
    """TensorRT-LLM's ``KvCacheConnectorConfig`` naming the connector (``LLM(kv_connector_config=...)``)."""
    from tensorrt_llm.llmapi.llm_args import KvCacheConnectorConfig

    return KvCacheConnectorConfig(connector_module=module, connector_scheduler_class="KVCodecScheduler",
                                  connector_worker_class="KVCodecWorker")


def check_pool_args(llm_args: Any) -> None:
    """``Unsupported`` for what the connector cannot write into: tensor or pipeline parallelism, a
    host (secondary) pool (block ids may then name blocks outside the primary pool), an attention
    backend other than TRTLLM (FlashInfer and vanilla view blocks token-major)."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        if int(getattr(llm_args, name, 1) or 1) != 1:
            raise Unsupported(f"{name} {getattr(llm_args, name)}: the connector needs every layer and head on one rank")
    host_cache = getattr(getattr(llm_args, "kv_cache_config", None), "host_cache_size", None)
    if host_cache:
        raise Unsupported(f"kv_cache_config.host_cache_size {host_cache}: with a host (secondary) KV pool block ids "
                          "may name blocks outside the primary pool the connector writes; leave host_cache_size "
                          "unset (0) with this connector")
    backend = str(getattr(llm_args, "attn_backend", "TRTLLM") or "TRTLLM")
    if backend.upper() != "TRTLLM":
        raise Unsupported(f"attention backend {backend}: the connector writes the TRTLLM backend's block layout")


def tokens_per_block(llm_args: Any) -> Optional[int]:
    value = getattr(getattr(llm_args, "kv_cache_config", None), "tokens_per_block", None)
    return int(value) if value else None


def prompt(request: Any) -> List[int]:
    tokens = [int(t) for t in request.get_tokens(0)]
    n = getattr(request, "prompt_len", None)
    return tokens[:n] if isinstance(n, int) and 0 < n <= len(tokens) else tokens


def client_id(request: Any) -> Optional[int]:
    """The LLM API's id of the request (``LlmRequest.py_client_id``, set from the executor request's
    ``client_id``, which ``GenerationExecutor`` makes ``GenerationRequest.id``: what the result of
    ``LLM.generate_async`` gives as ``request_id``); None where the request has none."""
    value = getattr(request, "py_client_id", None)
    return None if value is None else int(value)


def cache_salt(request: Any) -> str:
    """The request's cache salt as part of the stage key: 1.2's ``LlmRequest`` binds ``cache_salt_id``
    (an integer, from ``LLM.generate(cache_salt=...)``; PR #7106), later releases may also carry
    ``cache_salt``; the id is preferred where both are (the ensemble's engine computes the same id
    with TensorRT-LLM's own function: ``stage_salt``); salted prompts never share staged KV with
    other salts or with unsalted ones."""
    for holder in (request, getattr(request, "py_request", None)):
        if holder is None:
            continue
        for name in ("cache_salt_id", "cache_salt"):
            salt = getattr(holder, name, None)
            if salt is not None:
                return f"{name}={salt}"
    return ""


def stage_salt(salt: str) -> str:
    """What ``cache_salt`` says of a request that ``LLM.generate_async(cache_salt=salt)`` made: its
    ``cache_salt_id`` as TensorRT-LLM computes it (``tensorrt_llm.inputs.utils.get_cache_salt_id``);
    "" for no salt."""
    if not salt:
        return ""
    from tensorrt_llm.inputs.utils import get_cache_salt_id

    return f"cache_salt_id={get_cache_salt_id(salt)}"


def is_dummy(request: Any) -> bool:
    return any(bool(getattr(request, name, False)) for name in
               ("is_dummy", "is_dummy_request", "is_cuda_graph_dummy", "is_attention_dp_dummy"))
