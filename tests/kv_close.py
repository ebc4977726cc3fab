"""KV compared across prefill shapes: the same prompt prefilled in one pass or chunk by chunk gives
the same KV up to float rounding (about 1e-5 on a CPU, where the matmul blocking follows the shape
and the thread count), never bit for bit. ``assert_same_kv`` allows that much and no more: its
tolerance is checked to sit far below the gap between two different chunks of the same prompt, so
a wrong, swapped or shifted chunk still fails."""
from __future__ import annotations

import numpy as np

ATOL = 1e-4  # rounding across prefill shapes is ~1e-5; two different chunks differ by ~1


def assert_same_kv(got, want, chunks) -> None:
    """``got`` is ``want`` up to ``ATOL``; ``chunks`` (two or more different chunks' KV, of one shape)
    prove that tolerance has teeth: every two of them differ by far more than it."""
    chunks = [np.asarray(c) for c in chunks]
    assert len(chunks) >= 2
    gap = min(float(np.abs(a - b).max()) for i, a in enumerate(chunks) for b in chunks[i + 1:])
    assert gap > 100 * ATOL, f"chunks differ by only {gap}: the tolerance {ATOL} would not tell them apart"
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=ATOL)
