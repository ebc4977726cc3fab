"""Prefix-chained chunk keys.

A chunk of ``chunk_tokens`` tokens is stored under a key that chains the hash of every token id
from the start of the context up to the chunk's end, bound to the model identity and the codec
identity (scheme name, version and settings, layout version, chunk size). So a chunk is found
only for an identical token prefix of the same model with the same codec:

    h_0     = blake2b("kvcodec-keys-v1" | model_id | codec_id | chunk_tokens [| "salt" | cache salt])
    h_i     = blake2b(h_{i-1} | int32-LE token ids of chunk i)
    key_i   = "<model tag>/<codec tag>/<hex h_i>"

A *cache salt* (vLLM's ``cache_salt``, the ensemble's ``cache_salt`` input, TensorRT-LLM's salt, the
CLI's ``--cache-salt``) names a tenant: it is chained into ``h_0``, so a salted prompt and the same
prompt unsalted, or under another salt, share no key, and no one can find a tenant's chunks (or
confirm that a prompt was sent) without its salt. The empty salt keeps the unsalted keys exactly,
so chunks stored before salts existed are still found. ``tenant_id(salt)`` is a short public name
of a salt (the chunk header carries it; ``format.auth`` derives the tenant's encryption key from
it); it is "" for the empty salt.
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


MAX_SALT_CHARS = 256
_TENANT_PERSON = b"kvcodec-tenant"


def check_salt(salt: object) -> str:
    """A cache salt as keys take it: a string of at most ``MAX_SALT_CHARS`` characters (``ValueError``)."""
    if salt is None:
        return ""
    if not isinstance(salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
    if len(salt) > MAX_SALT_CHARS:
        raise ValueError(f"cache_salt is {len(salt)} characters, at most {MAX_SALT_CHARS}")
    return salt


def tenant_id(salt: str) -> str:
    """The public name of a cache salt's tenant: 16 hex digits, "" for the empty salt."""
    if not salt:
        return ""
    return hashlib.blake2b(salt.encode(), digest_size=8, person=_TENANT_PERSON).hexdigest()


def chunk_keys(
    token_ids: Sequence[int], model_id: str, codec_id: str, chunk_tokens: int, max_chunks: int | None = None,
    salt: str = "",
) -> List[str]:
    """Keys of every full chunk of ``token_ids`` (at most ``max_chunks``), in order; ``salt``: the
    request's cache salt (a tenant's chunks are keyed apart; "" keeps the unsalted keys)."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    ids = np.asarray(token_ids, dtype="<i4")
    n_full = len(ids) // chunk_tokens
    if max_chunks is not None:
        n_full = min(n_full, max_chunks)
    prefix = f"{_tag(model_id)}/{_tag(codec_id)}/"
    head = [KEY_SCHEME_VERSION.encode(), model_id.encode(), codec_id.encode(), str(chunk_tokens).encode()]
    if check_salt(salt):
        head += [b"salt", salt.encode()]
    h = _digest(*head)
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
