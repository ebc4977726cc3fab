"""The model's tokenizer, shared by the engine, ingest and the client (same ids everywhere), and
the text its chat template makes (``chat_prefix``: what ``kvcodec ingest --chat`` stores)."""
from __future__ import annotations

from typing import Callable, List, Mapping, Sequence

from ..errors import ConfigError
from .model_source import ModelFiles

ROLES = ("system", "user", "assistant")


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

    def chat_text(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool) -> str:
        """The text the model's chat template makes of ``messages``: what a chat front end (Triton's
        OpenAI frontend, given this model's tokenizer) sends as the prompt."""
        if not getattr(self._tok, "chat_template", None):
            raise ConfigError("the model has no chat template: a chat prompt cannot be made")
        return self._tok.apply_chat_template([dict(m) for m in messages], tokenize=False,
                                             add_generation_prompt=add_generation_prompt)


def chat_prefix(tokenizer, messages: Sequence[Mapping[str, str]]) -> str:
    """The text every chat that starts with ``messages`` begins with (the template applied to them,
    no generation prompt): stored once, it is reused by each such chat request. Checked: the
    template renders ``messages`` and a next user turn as this text followed by more (a template
    that rewrites earlier turns, e.g. dates or a last-turn-only marker, makes no reusable prefix)."""
    checked = []
    for m in messages:
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ConfigError(f"a chat message is {{\"role\": one of {', '.join(ROLES)}, \"content\": text}}, got {m!r:.80}")
        checked.append({"role": m["role"], "content": m["content"]})
    if not checked:
        raise ConfigError("no chat messages to store")
    prefix = tokenizer.chat_text(checked, add_generation_prompt=False)
    longer = tokenizer.chat_text([*checked, {"role": "user", "content": "?"}], add_generation_prompt=True)
    if not longer.startswith(prefix):
        raise ConfigError("the model's chat template does not render these messages as the start of a longer chat: "
                          "no prefix to reuse")
    return prefix


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
