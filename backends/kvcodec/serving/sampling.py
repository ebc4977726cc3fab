"""How one request picks its tokens: ``Sampling``, with the names of TensorRT-LLM's Triton ensemble.

Every field's default is its neutral value, and ``Sampling()`` (``GREEDY``) picks the most likely
token at each step. ``temperature`` 0 is greedy whatever ``top_p`` / ``top_k`` say (TensorRT-LLM's
and vLLM's rule); ``top_k`` 0 and ``top_p`` 1 keep every token; ``seed`` None draws a fresh seed.
``end_id`` (None: the model's end-of-sequence token) ends the answer; ``min_tokens`` keeps it from
ending sooner. ``repetition_penalty`` (1: none) divides a positive logit of every token already in
the prompt or the answer (multiplies a negative one); ``presence_penalty`` and
``frequency_penalty`` (0: none) subtract once per token of the answer seen / per occurrence.
``stop_words`` end the answer where one appears in its text (the text stops before it; the
``serving.generate`` step applies them, the same for every engine); ``bad_words`` are never
generated.

- ``check()`` raises ``BadRequest`` naming the first field out of range;
- ``asked()``: the fields set to something other than their neutral value, so an engine that
  cannot honour a field refuses a request that asks for it (``refuse``) and accepts its neutral
  value (the OpenAI frontend always sends penalties of 0);
- ``refuse(honoured, engine)`` raises ``BadRequest`` naming the fields asked for that the engine
  does not honour.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import AbstractSet, List, Optional, Tuple

from ..errors import BadRequest

MAX_SEED = (1 << 64) - 1  # TensorRT-LLM's seed is a UINT64
MAX_WORDS = 64  # stop or bad words in one request


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    min_tokens: int = 0
    end_id: Optional[int] = None
    stop_words: Tuple[str, ...] = ()
    bad_words: Tuple[str, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def check(self) -> "Sampling":
        def bad(name: str, why: str) -> BadRequest:
            return BadRequest(f"{name} {why}, got {getattr(self, name)!r}")

        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be >= 0 (0: every token)")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise bad("seed", "must be in [0, 2**64)")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.end_id is not None and self.end_id < 0:
            raise bad("end_id", "must be a token id (>= 0)")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise bad("repetition_penalty", "must be in (0, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        for name in ("stop_words", "bad_words"):
            words = getattr(self, name)
            if len(words) > MAX_WORDS or any(not isinstance(w, str) or not w for w in words):
                raise BadRequest(f"{name}: at most {MAX_WORDS} non-empty strings")
        return self

    def asked(self) -> List[str]:
        neutral = GREEDY
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(neutral, f.name)]

    def refuse(self, honoured: AbstractSet[str], engine: str) -> None:
        missing = [name for name in self.asked() if name not in honoured]
        if missing:
            raise BadRequest(f"the {engine} engine does not honour {', '.join(missing)}")


GREEDY = Sampling()
ALL = frozenset(f.name for f in fields(Sampling))
GENERATE_FIELDS = frozenset({"stop_words"})  # applied by serving.generate, for every engine
ENGINE_FIELDS = ALL - GENERATE_FIELDS  # what an engine may honour itself (its ``sampling_fields``)
