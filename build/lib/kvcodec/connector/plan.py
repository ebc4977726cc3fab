"""Token arithmetic of a connector: what to load, what to save (pure functions).

- ``matched_tokens(stored_tokens, prompt_tokens, block_size, computed_tokens=0)``: how many NEW
  prompt tokens the connector can supply: the stored prefix, cut so that at least one prompt token
  is left to compute (the engine needs it for the first logits), rounded down to a multiple of the
  engine's ``block_size`` (16, 32, 128..., not the chunk size), minus the ``computed_tokens`` the
  engine already has (its own prefix cache); never negative;
- ``chunks_to_save(prompt_tokens, reused_tokens, chunk_tokens, max_chunks=None)``: ``(index, start,
  end)`` of each full chunk of the prompt not already covered by ``reused_tokens`` (pass the stored
  prefix when known, so that chunks the store holds are not written again); never a partial chunk;
- ``stored_prefix(present, chunk_tokens)``: tokens covered by the leading run of present chunks.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


def _check(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def matched_tokens(stored_tokens: int, prompt_tokens: int, block_size: int, computed_tokens: int = 0) -> int:
    _check(stored_tokens=stored_tokens, prompt_tokens=prompt_tokens, computed_tokens=computed_tokens)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    usable = max(0, min(stored_tokens, prompt_tokens - 1))
    usable -= usable % block_size
    return max(0, usable - computed_tokens)


def chunks_to_save(prompt_tokens: int, reused_tokens: int, chunk_tokens: int,
                   max_chunks: Optional[int] = None) -> List[Tuple[int, int, int]]:
    _check(prompt_tokens=prompt_tokens, reused_tokens=reused_tokens)
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    first = reused_tokens // chunk_tokens  # chunks [0, first) lie wholly inside the reused prefix
    out = [(i, i * chunk_tokens, (i + 1) * chunk_tokens) for i in range(first, prompt_tokens // chunk_tokens)]
    return out if max_chunks is None else out[:max(0, max_chunks)]


def stored_prefix(present: Sequence[bool], chunk_tokens: int) -> int:
    n = 0
    while n < len(present) and present[n]:
        n += 1
    return n * chunk_tokens
