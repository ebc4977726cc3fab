"""TensorRT-LLM's KV cache connector over the engine-neutral core (``kvcodec.connector``): the module
``KvCacheConnectorConfig`` names (``connector_module``), holding the two classes and what they share
in one process.

Enabled with ``LLM(model, backend="pytorch", kv_connector_config=kv_connector_config())``; the
connector's own settings come from ``trtllm_config`` (a JSON file named by ``TRTLLM_KVCODEC_CONFIG``).
Split by job:

- ``trtllm_compat``: what differs between releases (base classes and their module path, CUDA graphs,
  cache salt, dummies, the 1.3+ count commitment); stand-ins where TensorRT-LLM is not installed;
- ``trtllm_shared``: what the halves and the engine share in one process (the stage of restored KV
  by prompt prefix, bounded in bytes; the pool; the accepted loads): only staged tokens are promised;
- ``trtllm_scheduler``: ``KVCodecScheduler`` (rank 0, on the executor thread; never blocks) over
  ``connector.SchedulerCore``;
- ``trtllm_worker``: ``KVCodecWorker`` (the pool, loads on the step's stream, saves off the
  executor's path) over ``connector.WorkerCore``;
- ``trtllm_prefetch``: the stock deployment's background reader into the stage;
- the read path (store -> decode -> restore) is ``serving.reader``, used by the stock deployment's
  prefetcher; in the ensemble deployment (``trtllm_engine``) the kv_fetch -> kv_decode ->
  kv_restore steps read and the ``llm`` step stages.

The API, as read in NVIDIA/TensorRT-LLM 1.2 (``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py``;
``.../pyexecutor/connectors/kv_cache_connector.py`` in 1.3+; ``py_executor_creator.py``,
``py_executor.py``, ``resource_manager.py``, ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``;
``docs/source/features/kv-cache-connector.md``). Both halves are made with ``cls(llm_args)``, the
scheduler on rank 0 only, a worker on every rank; on rank 0 both sit in one process. Per step:
``get_num_new_matched_tokens`` and ``update_state_after_alloc`` for each new request (inside C++
``addSequence``), ``build_connector_meta`` (pickled to every rank), worker ``start_load_kv``, per
layer ``wait_for_layer_load`` / ``save_kv_layer``, ``wait_for_save``, ``get_finished(finished_gen,
started_loading)``; ``request_finished`` at the end. ``(n, True)`` would park a request (left out of
the scheduler output) until ``get_finished`` reports it loaded; this connector answers ``(n, False)``
only, for KV already staged on the pool's device, and writes it in ``start_load_kv``. None of it has run against TensorRT-LLM
itself (it does not install on these machines): ``tests/unit/test_trtllm_connector.py`` replays the
calls on CPU.
"""
from __future__ import annotations

from . import trtllm_compat as compat
from .trtllm_scheduler import KVCodecMeta, KVCodecScheduler, LoadJob
from .trtllm_shared import SHARED, Shared
from .trtllm_worker import KVCodecWorker

_, _, TRTLLM_MODULE = compat.bases()
HAVE_TRTLLM = TRTLLM_MODULE is not None


def kv_connector_config():
    """TensorRT-LLM's ``KvCacheConnectorConfig`` naming this connector (``LLM(kv_connector_config=...)``)."""
    return compat.kv_connector_config(__name__)


__all__ = ["HAVE_TRTLLM", "KVCodecMeta", "KVCodecScheduler", "KVCodecWorker", "LoadJob", "SHARED", "Shared",
           "TRTLLM_MODULE", "kv_connector_config"]
