"""Prefix-chained chunk keys.

A chunk of ``chunk_tokens`` tokens is stored under a key that chains the hash of every token id
from the start of the context up to the chunk's end, bound to the model identity and the codec
identity (scheme name, version and settings, layout version, chunk size). So a chunk is found
only for an identical token prefix of the same model with the same codec:

    h_0     = blake2b("kvcodec-keys-v1" | model_id | codec_id | chunk_tokens)
    h_i     = blake2b(h_{i-1} | int32-LE token ids of chunk i)
    key_i   = "<model tag>/<codec tag>/<hex h_i>"
"""
from __future__ import annotations

import hashlib
from typing import List, Sequence

import numpy as np

KEY_SCHEME_VERSION = "kvcodec-keys-v1"


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=20)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def _tag(text: str) -> str:
    """A short, path-safe tag of an identity string (for grouping keys in a store)."""
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def chunk_keys(
    token_ids: Sequence[int], model_id: str, codec_id: str, chunk_tokens: int, max_chunks: int | None = None
) -> List[str]:
    """Keys of every full chunk of ``token_ids`` (at most ``max_chunks``), in order."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    ids = np.asarray(token_ids, dtype="<i4")
    n_full = len(ids) // chunk_tokens
    if max_chunks is not None:
        n_full = min(n_full, max_chunks)
    prefix = f"{_tag(model_id)}/{_tag(codec_id)}/"
    h = _digest(KEY_SCHEME_VERSION.encode(), model_id.encode(), codec_id.encode(), str(chunk_tokens).encode())
    keys = []
    for i in range(n_full):
        h = _digest(h, ids[i * chunk_tokens : (i + 1) * chunk_tokens].tobytes())
        keys.append(prefix + h.hex())
    return keys


def reusable_chunks(n_prompt_tokens: int, chunk_tokens: int) -> int:
    """How many full chunks of a prompt may be reused.

    At least one prompt token is always left to compute, so that the engine produces the logits
    of the first generated token.
    """
    if n_prompt_tokens <= 1:
        return 0
    return (n_prompt_tokens - 1) // chunk_tokens
