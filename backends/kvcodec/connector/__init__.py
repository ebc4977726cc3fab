"""The engine-neutral core of a KV connector: lookup, load, save.

Paged engines (vLLM, TensorRT-LLM) keep KV in blocks and take outside KV through a connector: the
scheduler asks how many prompt tokens the connector can supply, allocates blocks for them, and a
worker writes them in. This package does each step once, for every engine; it imports neither
Triton nor any engine. An engine adapter (a thin module beside the engine) only translates:

- lookup (scheduler): ``stored_tokens_for`` (or ``fetcher_tokens``) -> stored prefix;
  ``matched_tokens(stored, prompt, block_size, computed)`` -> the count the engine is told;
- load (worker): ``KVPages.from_vllm`` / ``from_trtllm`` views the engine's pool without a copy;
  ``RequestLoad(pages, block_ids, chunk_tokens, planned)`` writes each restored chunk
  (``[layers, 2, kv_heads, tokens, head_dim]``) into the request's blocks as it arrives (out of
  order is fine), and says how many tokens are usable (``loaded_tokens``, ``complete``,
  ``reason``); the engine computes the rest;
- save (after a miss or a partial hit): ``chunks_to_save`` names the full chunks to store,
  ``KVPages.read`` copies them out of the blocks, and ``WriteBack`` runs the encode-and-put off
  the request's path, dropping (and counting) jobs when it falls behind.

Modules: ``pages`` (the pool views), ``plan`` (token arithmetic), ``load`` (one request's load),
``writeback`` (the background saver), ``lookup`` (store presence of a prompt's chunks).
"""
from .load import RequestLoad
from .lookup import fetcher_tokens, prompt_keys, stored_tokens, stored_tokens_for
from .pages import LAYOUTS, KVPages
from .plan import chunks_to_save, matched_tokens, stored_prefix
from .writeback import WriteBack

__all__ = [
    "KVPages",
    "LAYOUTS",
    "RequestLoad",
    "WriteBack",
    "chunks_to_save",
    "fetcher_tokens",
    "matched_tokens",
    "prompt_keys",
    "stored_prefix",
    "stored_tokens",
    "stored_tokens_for",
]
