"""Engines: what runs the model on restored KV. One seam, chosen by name.

An engine entry is registered in ``ENGINES`` as ``"module:Class"`` (imported only when chosen, so
a heavy engine costs nothing to those who do not pick it); ``--engine NAME`` / ``KVCODEC_ENGINE``
(setting ``engine``, default ``transformers``) picks one. Adding an engine is one ``register``
line and a class that keeps the contract below.

Contract of an engine class:

- ``Class.model_card(settings) -> ModelCard`` (classmethod, cheap: no weights loaded, nothing
  converted): the model's identity (bound into every chunk key), KV geometry, vocabulary size,
  context length, RoPE settings, codec profile name and KV dtype. The model is the settings'
  ``model`` folder (``--model DIR``, ``KVCODEC_MODEL``) or the embedded SmolLM2-135M-Instruct
  (``model_files``: ``card_for``, ``files_for``). The steps that only fetch and decode (``kv_fetch``,
  ``kv_decode``) use this and never load the model.
- ``Class.prepare(settings)``: make the model's files ready (may convert them, once; cheap after).
- ``Class.tokenizer(settings)``: the model's tokenizer (``encode(text)``, ``decode(ids)``) alone,
  for clients that send token ids.
- ``Class.from_settings(settings) -> Engine``: load the model.
- ``engine.card``: its ``ModelCard``; ``engine.geometry(tokens)``: KV geometry of ``tokens``.
- ``engine.tokenize(text) -> list[int]`` (no special tokens added) and
  ``engine.detokenizer() -> Detokenizer`` (incremental: ``push(token) -> text added``).
- ``engine.prefill_chunks(ids, chunk_tokens)``: the KV of each full chunk of ``ids``, float32
  ``[layers, 2, kv_heads, chunk_tokens, head_dim]`` (ingest, the quality harness).
- ``engine.stream(ids, max_tokens, past_kv=None, sampling=GREEDY)``: token ids one by one, picked as
  ``sampling`` (``serving.sampling.Sampling``) asks, of which the engine honours its
  ``sampling_fields`` (``serving.generate`` refuses a request asking for another); with ``past_kv``
  (the KV of ``ids[:n]``, ``n < len(ids)``; float16 or float32, converted to the engine's own
  dtype) only ``ids[n:]`` is computed. Its own ``kv_dtype`` KV in must give exactly the tokens of
  its own full prefill (the ``raw`` rung's promise).
- ``engine.continuation_logprobs(past_kv, ids)``: teacher-forced next-token log-probabilities
  ``[len(ids), vocab]`` (the quality harness).
- ``engine.max_concurrency``, ``engine.takes_session``, ``engine.writeback_stats()``, ``engine.close()``
  (``model_files.EngineFiles`` gives the defaults: one request at a time, no streamed loads, no
  write-back, nothing to release).
"""
from __future__ import annotations

from typing import FrozenSet, Iterator, List, Optional, Protocol, Sequence

import numpy as np

from ..format.card import KV_DTYPES, ModelCard
from ..format.geometry import Geometry
from ..registry import ENGINES
from ..serving.sampling import GREEDY, Sampling
from ..serving.stats import StreamReport

__all__ = ["ENGINES", "KV_DTYPES", "Detokenizer", "Engine", "ModelCard", "StreamReport", "model_card",
           "open_engine", "open_tokenizer", "prepare", "sampling_fields"]

class Detokenizer(Protocol):
    def push(self, token: int) -> str:
        """The text that ``token`` adds (may be '' until a multi-token character is complete)."""

    def flush(self) -> str:
        """Whatever text is still held back at the end."""


class Engine(Protocol):
    name: str  # its registry name
    card: ModelCard
    max_concurrency: int
    # True: ``stream`` takes ``load=`` (a ``connector.LoadSession`` whose chunks may still be arriving)
    # and takes them where they are; otherwise the llm step waits for every chunk and passes ``past_kv``
    takes_session: bool
    sampling_fields: FrozenSet[str]  # the ``Sampling`` fields ``stream`` honours (``sampling.ENGINE_FIELDS`` at most)

    def geometry(self, tokens: int) -> Geometry:
        """The KV geometry of ``tokens`` tokens of this engine's model (no side effects)."""

    def tokenize(self, text: str) -> List[int]:
        """The model's own token ids of ``text`` (``engines.tokenizer.Tokenizer.encode``: what ingest and kv_fetch key chunks by)."""

    def detokenizer(self) -> Detokenizer:
        """A fresh incremental detokenizer for one answer (not shared between requests)."""

    def prefill_chunks(self, ids: Sequence[int], chunk_tokens: int) -> Iterator[np.ndarray]:
        """The KV of each full chunk of ``ids`` (``[layers, 2, kv_heads, chunk_tokens, head_dim]``, the
        card's ``kv_dtype``), computed from scratch, in order (ingest); may block for a prefill;
        ``Unsupported`` from an engine that cannot (trtllm: its write-back stores instead)."""

    def stream(self, ids: Sequence[int], max_tokens: int, past_kv: Optional[np.ndarray] = None,
               report: Optional["StreamReport"] = None, load=None, sampling: Sampling = GREEDY,
               salt: str = "") -> Iterator[int]:
        """The answer's tokens, as they are made (at most ``max_tokens``; the end token ends it). KV comes
        from ``past_kv`` (the restored prefix, host array) or ``load`` (a ``connector.LoadSession``,
        engines that ``takes_session``), never both; at least one prompt token is always computed
        (``BadRequest`` otherwise). ``report`` is filled as the engine goes (``StreamReport``). The
        prompt's new full chunks may be handed to write-back (off the caller's thread). ``salt``: the
        request's cache salt (its tenant): the engine's own prefix cache and write-back keep it apart
        from other salts (``format.keys``); only passed when not empty. Raises ``BadRequest`` for a
        request the engine refuses; blocks only for its own compute."""

    def continuation_logprobs(self, past_kv: np.ndarray, ids: Sequence[int]) -> np.ndarray:
        """Log-probabilities of each next token of ``ids`` given ``past_kv`` before them (the quality
        gate: teacher-forced scoring of restored KV); ``Unsupported`` from an engine that cannot."""

    def writeback_stats(self) -> Optional[dict]:
        """The write-back sink's counts (queued, stored, dropped, failed, pending); None: no write-back."""

    def close(self) -> None:
        """Release threads, write-back (finishing what was accepted) and store connections."""


def model_card(settings) -> ModelCard:
    """The chosen engine's model card (cheap)."""
    return ENGINES.get(settings.engine).model_card(settings)


def sampling_fields(settings, card: ModelCard) -> FrozenSet[str]:
    """The ``Sampling`` fields a request may ask of the chosen engine for ``card``'s model: the ones
    it honours (``honoured_fields``, known without loading it) and stop words (``serving.generate``
    applies them for every engine)."""
    from ..serving.sampling import GENERATE_FIELDS

    return ENGINES.get(settings.engine).honoured_fields(card) | GENERATE_FIELDS


def prepare(settings) -> None:
    """Make the chosen engine's model files ready (``kvcodec serve`` does it before the server starts)."""
    ENGINES.get(settings.engine).prepare(settings)


def open_tokenizer(settings):
    """The chosen engine's tokenizer (named apart from the submodule ``tokenizer``, which defines it)."""
    return ENGINES.get(settings.engine).tokenizer(settings)


def open_engine(settings) -> Engine:
    """The chosen engine, loaded."""
    return ENGINES.get(settings.engine).from_settings(settings)
