"""The model's tokenizer, shared by the engine, ingest and the client (same ids everywhere)."""
from __future__ import annotations

from typing import Callable, List, Sequence

from .model_files import ModelFiles


class Tokenizer:
    def __init__(self, files: ModelFiles) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(files.path)
        self.eos_token_id = self._tok.eos_token_id

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text``, no special tokens added."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """The text each new token adds, decoding only a short window instead of every token so far.

    Two offsets into the ids (as TGI and vLLM do): the text of ``ids[prefix:read]`` was already
    sent; a new token's text is ``decode(ids[prefix:])`` minus that, held back while it ends in an
    incomplete character (U+FFFD). ``flush`` sends what is still held back at the end.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.ids: List[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        sent = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) > len(sent) and (final or not text.endswith("\ufffd")):
            delta = text[len(sent):]
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""
