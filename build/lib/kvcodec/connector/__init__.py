"""The engine-neutral core of a KV connector: lookup, load, save.

Paged engines (vLLM, TensorRT-LLM) keep KV in blocks and take outside KV through a connector: the
scheduler asks how many prompt tokens the connector can supply, allocates blocks for them, and a
worker writes them in. This package does each step once, for every engine; it imports neither
Triton nor any engine. An engine adapter (a thin module beside the engine) only translates call
shapes:

- hand-off (``handoff``): the ``llm`` step posts what a request brings under a key, in the engine's
  process; the connector's halves find it by the engine's request id or the prompt's hash;
- load (``session``, ``load``, ``pages``, ``plan``): a ``LoadSession`` per request receives the
  restored chunks as the ensemble delivers them; the engine learns the count of stored tokens from
  it at once (``matched_tokens``: block-aligned, one prompt token left), attaches its blocks
  (``KVPages`` views the pool without a copy) and each chunk is written as it arrives
  (``RequestLoad``, out of order is fine); the load completes or fails through the engine's own
  completion hook, and ``failed_block_ids`` names the blocks an engine must recompute;
- save (``save``, ``writeback``): ``SaveTracker`` says in which step a request's new full chunks
  (``chunks_to_save``) are complete in its blocks; ``KVPages.read`` copies them out; ``ChunkSaver``
  encodes, signs and puts them (ingest uses it too), run off the request's path by ``WriteBack``,
  which drops (and counts) jobs when it falls behind;
- lookup is the fetcher's (``serving.fetch.Fetcher.plan``): the ensemble's kv_fetch answers it, and
  a connector that reads the store itself (TensorRT-LLM's stock deployment) plans with a ``Fetcher``.
"""
from .handoff import HandOff, prompt_key
from .load import RequestLoad
from .pages import LAYOUTS, KVPages
from .plan import chunks_to_save, matched_tokens, stored_prefix
from .save import ChunkSaver, SaveJob, SaveTracker
from .scheduler import Load, SchedulerCore
from .session import LoadSession
from .sink import WriteBackSink, open_sink
from .stage import Stage, prefix_keys
from .worker import HostCopy, LoadFailed, WorkerCore
from .writeback import Increments, WriteBack, merged

__all__ = [
    "ChunkSaver",
    "HostCopy",
    "Load",
    "LoadFailed",
    "SchedulerCore",
    "Stage",
    "WorkerCore",
    "WriteBackSink",
    "open_sink",
    "prefix_keys",
    "HandOff",
    "KVPages",
    "LAYOUTS",
    "LoadSession",
    "RequestLoad",
    "SaveJob",
    "SaveTracker",
    "Increments",
    "WriteBack",
    "merged",
    "chunks_to_save",
    "matched_tokens",
    "prompt_key",
    "stored_prefix",
]
