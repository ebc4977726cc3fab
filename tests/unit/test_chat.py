"""The prefix a chat makes (``kvcodec.engines.tokenizer.chat_prefix``): with the embedded model's own
chat template, the stored text is where every chat with those first messages starts, token for
token over its full chunks; a template that rewrites earlier turns is refused."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcodec.engines.gguf import ensure_model
from kvcodec.engines.tokenizer import Tokenizer, chat_prefix
from kvcodec.errors import ConfigError

pytestmark = pytest.mark.timeout(300)

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "models"
DOCUMENT = "def area(r):\n    return 3.14159 * r * r\n" * 40


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(ensure_model(CACHE))


def test_a_chat_with_the_stored_messages_starts_with_their_tokens(tokenizer):
    messages = [{"role": "system", "content": DOCUMENT}]
    prefix = chat_prefix(tokenizer, messages)
    assert DOCUMENT in prefix and prefix != DOCUMENT  # the template's markers around it
    # the prompt the OpenAI frontend makes of a chat request with that system message
    chat = tokenizer.chat_text([*messages, {"role": "user", "content": "What does area(2) return?"}],
                               add_generation_prompt=True)
    stored, asked = tokenizer.encode(prefix), tokenizer.encode(chat)
    assert len(stored) > 256 and asked[:len(stored)] == stored
    other = tokenizer.encode(tokenizer.chat_text([{"role": "user", "content": DOCUMENT}], True))
    assert other[:256] != stored[:256]  # the role is part of the prefix: another chat does not reuse it


def test_bad_messages_are_refused(tokenizer):
    for messages in ([], [{"role": "robot", "content": "x"}], [{"role": "user"}], ["text"]):
        with pytest.raises(ConfigError):
            chat_prefix(tokenizer, messages)


class _Rewriting:
    """A template that marks the last turn: earlier turns render differently once one follows."""

    def chat_text(self, messages, add_generation_prompt):
        return "".join(f"[{'LAST' if i == len(messages) - 1 else m['role']}]{m['content']}"
                       for i, m in enumerate(messages))


def test_a_template_that_rewrites_earlier_turns_makes_no_prefix():
    with pytest.raises(ConfigError, match="no prefix to reuse"):
        chat_prefix(_Rewriting(), [{"role": "system", "content": "doc"}])
