"""The prompts ``kvcodec soak`` and ``kvcodec soak --chaos`` ask: contexts of whole lines of
standard-library modules (``context_ids``) and the question after them (``QUESTION``).
"""
from __future__ import annotations

from typing import List

from .bench import SOURCES
from .texts import cut_to_tokens, stdlib_text

QUESTION = "\n\n# Question: what does the code above do?\n# Answer:"


def context_ids(tokenizer, tokens: int, index: int) -> List[int]:
    """Whole lines of a standard-library module, just over ``tokens`` tokens (module ``index``)."""
    return tokenizer.encode(cut_to_tokens(tokenizer, stdlib_text(SOURCES[index % len(SOURCES)]), tokens))
