"""The texts codecs are judged on, and the texts codec profiles are fitted on (kept apart).

All are real files on every Debian machine with this project's Python: source of the Python
standard library (code) and the license texts in ``/usr/share/common-licenses`` plus Python's own
``LICENSE.txt`` (prose). ``EVAL_SET`` has 13 code and 9 prose texts, each longer than 4096 tokens
or at least 1024 + 64; ``FIT_SET`` shares no file with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

from kvcodec.errors import ConfigError
from kvcodec_tools.texts import stdlib_path

LICENSES = Path("/usr/share/common-licenses")


@dataclass(frozen=True)
class Text:
    name: str
    kind: str  # "code" | "prose"
    path: Path

    def read(self) -> str:
        try:
            return self.path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise ConfigError(f"eval text {self.name} ({self.path}) is not readable: {exc}") from None


def _stdlib(rel: str) -> Text:
    return Text(f"py:{rel}", "code" if rel.endswith(".py") else "prose", stdlib_path(rel))


def _license(name: str) -> Text:
    return Text(f"license:{name}", "prose", LICENSES / name)


EVAL_SET: Tuple[Text, ...] = tuple(
    [_stdlib(p) for p in ("argparse.py", "asyncio/base_events.py", "collections/__init__.py", "dataclasses.py",
                          "email/message.py", "http/client.py", "logging/__init__.py", "pathlib.py",
                          "subprocess.py", "threading.py", "typing.py", "unittest/case.py", "zipfile.py")]
    + [_license(n) for n in ("Apache-2.0", "Artistic", "CC0-1.0", "GFDL-1.3", "GPL-2", "GPL-3", "LGPL-2.1",
                             "MPL-2.0")]
    + [_stdlib("LICENSE.txt")]
)

FIT_SET: Tuple[Text, ...] = tuple(
    [_stdlib(p) for p in ("inspect.py", "tarfile.py", "statistics.py", "heapq.py", "pydoc_data/topics.py")]
    + [_license(n) for n in ("GPL-1", "MPL-1.1")]
)


def load(texts: Sequence[Text], tokenize, min_tokens: int) -> List[Tuple[Text, List[int]]]:
    """``(text, ids)`` for each text, each cut to its first ``min_tokens`` tokens; a text that is
    missing or shorter is an error naming it (an eval set with holes would not compare)."""
    out = []
    for text in texts:
        ids = tokenize(text.read()[: min_tokens * 16])  # no token is longer than 16 characters here
        if len(ids) < min_tokens:
            raise ConfigError(f"eval text {text.name} has {len(ids)} tokens, fewer than {min_tokens}")
        out.append((text, ids[:min_tokens]))
    return out
