"""The ``llm`` step's responses for one request, as its ``Reply`` asks (``serving.request``).

``pieces(events, reply, ids, prompt_text, cancelled)`` turns ``serving.generate``'s events into
``Piece``s, each one response:

- ``reply.stream``: one per token, its id and the text it adds (the last one ``final``);
- otherwise one, ``final``: every token and the whole text, led by the prompt's ids and text
  (``prompt_text()``, asked for only then) unless ``reply.exclude_input``;
- ``num_input_tokens`` (the prompt's) and ``num_output_tokens`` (the tokens this response carries:
  one per streamed token, all of them in a whole answer, as Triton's vLLM backend counts them and
  the OpenAI frontend adds them up for ``usage``) where the reply asks for them, else None;
- ``cancelled()`` is asked after each token that is not the last: True ends the pieces there (the
  client went away; the caller ends the stream, and ``events`` is closed by its owner).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence

from .generate import Event
from .request import Reply
from .stats import RequestStats


@dataclass
class Piece:
    ids: List[int]
    text: str
    final: bool
    stats: Optional[RequestStats] = None
    num_input_tokens: Optional[int] = None
    num_output_tokens: Optional[int] = None


def pieces(events: Iterable[Event], reply: Reply, ids: Sequence[int], prompt_text: Callable[[], str],
           cancelled: Callable[[], bool] = lambda: False):
    n_in = len(ids) if reply.num_input_tokens else None
    tokens: List[int] = []
    texts: List[str] = []
    for event in events:
        tokens.append(event.token)
        if reply.stream:
            yield Piece([event.token], event.text, event.final, event.stats, n_in,
                        1 if reply.num_output_tokens else None)
        else:
            texts.append(event.text)
            if event.final:
                text, out = "".join(texts), list(tokens)
                if not reply.exclude_input:
                    text, out = prompt_text() + text, [int(t) for t in ids] + out
                yield Piece(out, text, True, event.stats, n_in, len(tokens) if reply.num_output_tokens else None)
        if not event.final and cancelled():
            return
