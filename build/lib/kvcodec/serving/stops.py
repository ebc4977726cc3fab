"""Stop words over streamed text: ``StopText(words)`` cuts an answer's text before the first stop
word, for every engine alike (``serving.generate``).

``push(delta) -> str`` takes the text a new token adds and returns what may be sent now: text that
could still turn out to be the start of a stop word is held back until the next pieces tell;
once a stop word appears, ``stopped`` is True and the text before it is the last returned (the
stop word itself is never sent, as TensorRT-LLM and vLLM leave it out by default). ``flush()``
returns what is held back when the answer ends without one.
"""
from __future__ import annotations

from typing import Sequence


class StopText:
    def __init__(self, words: Sequence[str]) -> None:
        self.words = [w for w in words if w]
        self.stopped = False
        self._held = ""

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.words:
            return delta
        text = self._held + delta
        hits = [i for i in (text.find(w) for w in self.words) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[:min(hits)]
        keep = max((k for w in self.words for k in range(1, min(len(w), len(text) + 1))
                    if text.endswith(w[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
