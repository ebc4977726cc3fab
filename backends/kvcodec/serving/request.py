"""``Request``: what a client asks of the ensemble, checked once at the door (step ``kv_fetch``).

Fields: ``ids`` (the prompt's token ids), ``max_tokens`` (tokens to generate), ``reuse`` (may
stored KV be used), ``codecs`` (rung specs this request is pinned to, or None for the server's
ladder), ``reply`` (how the ``llm`` step answers: a ``Reply``, which travels to it as the ``params``
JSON beside the chunks). ``validate(card)`` raises ``BadRequest`` (INVALID_ARG at the edge) with a short message
for each malformed request:

- an empty prompt; a negative token id; a token id at or above the model's vocabulary size;
- ``max_tokens`` outside ``1..MAX_TOKENS_LIMIT``; prompt plus ``max_tokens`` past the model's context;
- ``codecs`` naming an unknown rung, a bad quality, or a rung twice;
- a ``cache_salt`` longer than ``format.keys.MAX_SALT_CHARS``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import List, Optional

import numpy as np

from ..errors import BadRequest, ConfigError
from ..format.card import ModelCard
from ..format.keys import check_salt
from ..format.ladder import parse_ladder
from .sampling import GREEDY, Sampling

MAX_TOKENS_LIMIT = 4096


@dataclass(frozen=True)
class Reply:
    """How the ``llm`` step answers a request (TensorRT-LLM's ensemble's flags): ``stream`` one
    response per token with the text it adds (else one response with the whole answer),
    ``exclude_input`` (else a whole answer starts with the prompt: its text and ids),
    ``num_input_tokens`` / ``num_output_tokens`` (send those counts), ``sampling``, ``cache_salt``
    (whose request it is: the engine's prefix cache and write-back use that tenant's keys)."""

    stream: bool = True
    exclude_input: bool = True
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    sampling: Sampling = GREEDY
    cache_salt: str = ""  # the request's tenant (format.keys): the llm step's engine and write-back keep it apart

    def to_json(self) -> str:
        out = asdict(self)
        out["sampling"] = {name: getattr(self.sampling, name) for name in self.sampling.asked()}
        return json.dumps(out)

    @classmethod
    def from_json(cls, text) -> "Reply":
        raw = json.loads(text)
        sampling = dict(raw.pop("sampling", {}))
        for name in ("stop_words", "bad_words"):
            if name in sampling:
                sampling[name] = tuple(sampling[name])
        return cls(**raw, sampling=Sampling(**sampling))


@dataclass
class Request:
    ids: np.ndarray  # int32 [n]
    max_tokens: int
    reuse: bool = True
    codecs: Optional[List[str]] = None
    reply: Reply = field(default_factory=Reply)

    @property
    def salt(self) -> str:
        """The request's cache salt ("" unsalted): only its tenant's chunks are read and written."""
        return self.reply.cache_salt

    @staticmethod
    def parse_codecs(spec: Optional[str]) -> Optional[List[str]]:
        """A comma list of rung specs ('' or None: the server's ladder)."""
        if spec is None or not spec.strip():
            return None
        return [s.strip() for s in spec.split(",") if s.strip()] or None

    def validate(self, card: ModelCard) -> "Request":
        ids = self.ids
        if ids.ndim != 1:
            raise BadRequest(f"input_ids must have 1 dimension, got shape {list(ids.shape)}")
        if ids.size == 0:
            raise BadRequest("input_ids is empty: the prompt needs at least one token")
        if ids.min() < 0:
            raise BadRequest("input_ids holds negative token ids")
        if ids.max() >= card.vocab_size:
            raise BadRequest(f"input_ids holds token id {int(ids.max())}, the vocabulary has {card.vocab_size}")
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise BadRequest(f"max_tokens must be in 1..{MAX_TOKENS_LIMIT}, got {self.max_tokens}")
        if ids.size + self.max_tokens > card.max_context:
            raise BadRequest(f"prompt ({ids.size} tokens) plus max_tokens ({self.max_tokens}) is longer than the "
                             f"model's context ({card.max_context})")
        self.reply.sampling.check()
        try:
            check_salt(self.reply.cache_salt)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        if self.codecs:
            try:
                parse_ladder(self.codecs)
            except ConfigError as exc:
                raise BadRequest(f"codecs: {exc}") from None
        return self
