"""The quality harness: what a codec does to the model's behaviour.

``evaluate(engine, ids, prefix_tokens, continuation_tokens, scheme)`` takes the KV of the first
``prefix_tokens`` of ``ids`` (a multiple of the chunk size), passes it through the codec chunk by
chunk (encode, decode, restore), and compares the model run on the restored KV with the run on
the original KV:

- over the next ``continuation_tokens`` tokens of ``ids``, teacher-forced: ``top1_agreement``
  (share of positions whose argmax matches) and ``mean_kl`` (mean KL(original || restored) of the
  next-token distributions);
- ``greedy_match_tokens``: how many of ``greedy_tokens`` greedy tokens generated after the prefix
  (the first continuation token computed on top of it) agree before the first difference;
- ``ratio_vs_fp16`` (fp16 KV bytes / stored bytes), ``encode_s``, ``decode_s`` (decode + restore).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import List, Sequence

import numpy as np

from kvcodec.encode import ChunkEncoder
from kvcodec.errors import BadRequest
from kvcodec.format.auth import ChunkAuth
from kvcodec.format.codecs import Scheme
from kvcodec.serving.decode import ChunkDecoder
from kvcodec.serving.restore import restore


@dataclass
class EvalResult:
    codec: str
    codec_id: str
    prefix_tokens: int
    continuation_tokens: int
    ratio_vs_fp16: float
    top1_agreement: float
    mean_kl: float
    greedy_match_tokens: int
    greedy_tokens: int
    encode_s: float
    decode_s: float
    fp16_bytes: int = 0
    stored_bytes: int = 0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Reference:
    """The original run on one text: the prefix KV chunks, the teacher-forced next-token
    log-probabilities over the continuation, and the greedy tokens after the prefix."""
    prefix: List[int]
    continuation: List[int]
    chunks: List[np.ndarray]
    chunk_tokens: int
    logprobs: np.ndarray
    greedy: List[int]


def reference(engine, ids: Sequence[int], prefix_tokens: int, continuation_tokens: int, chunk_tokens: int = 256,
              greedy_tokens: int = 32) -> Reference:
    if prefix_tokens <= 0 or prefix_tokens % chunk_tokens:
        raise BadRequest(f"prefix_tokens must be a positive multiple of {chunk_tokens}, got {prefix_tokens}")
    if continuation_tokens < 1:
        raise BadRequest(f"continuation_tokens must be at least 1, got {continuation_tokens}")
    if len(ids) < prefix_tokens + continuation_tokens:
        raise BadRequest(f"the text has {len(ids)} tokens, fewer than prefix + continuation "
                         f"({prefix_tokens} + {continuation_tokens})")
    prefix = list(ids[:prefix_tokens])
    continuation = list(ids[prefix_tokens:prefix_tokens + continuation_tokens])
    chunks = list(engine.prefill_chunks(prefix, chunk_tokens))
    past = np.concatenate(chunks, axis=3)
    logprobs = engine.continuation_logprobs(past, continuation)
    greedy = list(engine.stream(prefix + continuation[:1], greedy_tokens, past))
    return Reference(prefix, continuation, chunks, chunk_tokens, logprobs, greedy)


def compare(engine, ref: Reference, scheme: Scheme, threads: int = 1) -> EvalResult:
    """Pass the reference's KV through ``scheme`` and compare the model's behaviour on it."""
    c = ref.chunk_tokens
    auth = ChunkAuth.random()  # the chunks never leave this process
    encoder = ChunkEncoder(scheme, engine.model_id, auth=auth, threads=threads)
    decoder = ChunkDecoder(engine.model_id, auth=auth, threads=threads)
    t0 = time.perf_counter()
    blobs = [encoder.encode(kv, f"eval{i}", i, i * c) for i, kv in enumerate(ref.chunks)]
    t1 = time.perf_counter()
    restored = [restore(decoder.decode(b, key=f"eval{i}")) for i, b in enumerate(blobs)]
    t2 = time.perf_counter()
    decoder.close()
    past = np.concatenate(restored, axis=3)
    new = engine.continuation_logprobs(past, ref.continuation)
    top1 = float(np.mean(ref.logprobs.argmax(-1) == new.argmax(-1)))
    kl = float(np.mean(np.sum(np.exp(ref.logprobs) * (ref.logprobs - new), axis=-1)))
    greedy = list(engine.stream(ref.prefix + ref.continuation[:1], len(ref.greedy), past))
    pairs = enumerate(zip(ref.greedy, greedy, strict=False))
    match = next((i for i, (a, b) in pairs if a != b), min(len(ref.greedy), len(greedy)))
    fp16 = sum(kv.size * 2 for kv in ref.chunks)
    stored = sum(len(b) for b in blobs)
    return EvalResult(scheme.name, scheme.identity, len(ref.prefix), len(ref.continuation),
                      round(fp16 / stored, 4), round(top1, 4), round(max(kl, 0.0), 6), int(match), len(ref.greedy),
                      round(t1 - t0, 4), round(t2 - t1, 4), int(fp16), int(stored))


def evaluate(engine, ids: Sequence[int], prefix_tokens: int, continuation_tokens: int, scheme: Scheme,
             chunk_tokens: int = 256, greedy_tokens: int = 32) -> EvalResult:
    return compare(engine, reference(engine, ids, prefix_tokens, continuation_tokens, chunk_tokens, greedy_tokens),
                   scheme)
