"""Real texts for the tooling: the Python standard library's source, and whole lines of a text cut
to a number of tokens.

The standard library is on every machine with this project's Python, so the demo's context, the
perf inputs, the bench's contexts, the quality eval set and the integration tests' texts all come
from here.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_path(rel: str) -> Path:
    """A file of the standard library, by its path under it (``"json/decoder.py"``). A module that a
    later Python made a package (``zipfile.py`` is ``zipfile/__init__.py`` from 3.12) is its
    ``__init__.py``. The texts are this interpreter's: another Python's standard library differs."""
    path = STDLIB / rel
    if not path.exists() and rel.endswith(".py") and (STDLIB / rel[:-3] / "__init__.py").is_file():
        return STDLIB / rel[:-3] / "__init__.py"
    return path


def stdlib_text(rel: str) -> str:
    """The text of a standard-library file (UTF-8)."""
    return stdlib_path(rel).read_text(encoding="utf-8")


def cut_to_tokens(tokenizer, text: str, tokens: int, step: int = 1) -> str:
    """The fewest whole lines of ``text`` holding at least ``tokens`` tokens (all of it if fewer):
    just over ``tokens``, cut at a line end. With ``step`` > 1 the count of lines is a multiple
    of ``step`` (or all of them): a coarser cut, for callers whose texts were chosen with one."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    lines = text.splitlines(keepends=True)
    lo, hi = 1, -(-len(lines) // step)  # in units of ``step`` lines
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.encode("".join(lines[:mid * step]))) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return "".join(lines[:lo * step])
