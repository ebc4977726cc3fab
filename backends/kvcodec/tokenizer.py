"""The model's tokenizer, shared by the engine, ingest and the client (same ids everywhere)."""
from __future__ import annotations

from typing import List, Sequence

from .engines.model_files import ModelFiles


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
