"""The ensemble's door (``kvcodec.triton.interface``) and the llm step's answers (``serving.answer``)
below Triton: the request exactly as Triton's OpenAI frontend makes it for a model that is not vLLM
(``_create_trtllm_inference_request`` in ``python/openai/openai_frontend/engine/utils/triton.py``:
every input ``[[value]]``, a batch of one; stop words ``[[w, ...]]``), read on a stand-in for
``triton_python_backend_utils``; the real server takes the same tensors in
``tests/integration/test_front_door.py``."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from kvcodec.errors import BadRequest
from kvcodec.serving.answer import pieces
from kvcodec.serving.generate import Event
from kvcodec.serving.request import Reply

from .fake_triton import load_step

PROMPT = "Once upon a time"


def _tokenize(text: str):
    return [ord(c) % 97 for c in text]


def openai_request(prompt: str = PROMPT, stream: bool = False, max_tokens: int = 16, **options) -> dict:
    """The tensors the OpenAI frontend sends (``options``: temperature, top_p, frequency_penalty,
    presence_penalty, seed, stop), by name, as the stand-in's inputs."""
    values = {"text_input": np.array([[prompt.encode()]], dtype=object), "stream": np.bool_([[stream]]),
              "max_tokens": np.int32([[max_tokens]]), "return_num_input_tokens": np.bool_([[True]]),
              "return_num_output_tokens": np.bool_([[True]])}
    for name in ("top_p", "frequency_penalty", "presence_penalty", "temperature"):
        if name in options:
            values[name] = np.float32([[options[name]]])
    if "seed" in options:
        values["seed"] = np.uint64([[options["seed"]]])
    if "stop" in options:
        values["stop_words"] = np.array([[w.encode() for w in options["stop"]]], dtype=object)
    return {name: types.SimpleNamespace(name=name, as_numpy=lambda v=v: v, is_cpu=lambda: True)
            for name, v in values.items()}


@pytest.fixture
def door(monkeypatch):
    load_step(monkeypatch, "kv_fetch")  # installs the stand-in; kvcodec.triton is imported against it
    monkeypatch.delitem(sys.modules, "kvcodec.triton.interface", raising=False)
    from kvcodec.triton import interface

    yield interface
    for name in ("kvcodec.triton", "kvcodec.triton.interface"):
        sys.modules.pop(name, None)


def test_the_openai_frontends_request_is_read_whole(door):
    request = openai_request(temperature=0.7, top_p=0.9, frequency_penalty=0.0, presence_penalty=0.0, seed=7,
                             stop=["\n\n", "The end"])
    req = door.read_request(request, _tokenize)
    assert req.ids.tolist() == _tokenize(PROMPT) and req.max_tokens == 16 and req.reuse
    reply = req.reply
    assert (reply.stream, reply.exclude_input, reply.num_input_tokens, reply.num_output_tokens) == (
        False, False, True, True)
    s = reply.sampling
    assert (s.temperature, s.top_p, s.seed, s.stop_words) == (pytest.approx(0.7), pytest.approx(0.9), 7,
                                                              ("\n\n", "The end"))
    assert set(s.asked()) >= {"temperature", "top_p", "seed", "stop_words"}
    assert not {"frequency_penalty", "presence_penalty"} & set(s.asked())  # 0: neutral, nothing asked


def test_the_servers_setting_leaves_the_prompt_out_unless_the_request_says(door):
    assert door.read_request(openai_request(), _tokenize, exclude_input=True).reply.exclude_input
    request = openai_request()
    request["exclude_input_in_output"] = types.SimpleNamespace(as_numpy=lambda: np.bool_([[False]]),
                                                               is_cpu=lambda: True)
    assert not door.read_request(request, _tokenize, exclude_input=True).reply.exclude_input


def test_a_batch_of_two_prompts_is_refused_naming_the_input(door):
    request = openai_request()
    request["text_input"] = types.SimpleNamespace(as_numpy=lambda: np.array([[b"a"], [b"b"]], dtype=object),
                                                  is_cpu=lambda: True)
    with pytest.raises(BadRequest, match="'text_input' must hold one sequence"):
        door.read_request(request, _tokenize)


def test_outputs_carry_the_batch_dimension(door):
    from kvcodec import triton as edge

    assert edge.text_tensor("text_output", "hi").value.shape == (1, 1)
    assert edge.tensor("output_ids", np.arange(3, dtype=np.int32)).value.shape == (1, 3)


def _events(tokens):
    return [Event(t, f"<{t}>", i == len(tokens) - 1) for i, t in enumerate(tokens)]


def test_streamed_responses_count_their_own_tokens_and_add_up():
    reply = Reply(stream=True, exclude_input=False, num_input_tokens=True, num_output_tokens=True)
    out = list(pieces(_events([5, 6, 7]), reply, [1, 2], lambda: "PROMPT"))
    assert [p.num_output_tokens for p in out] == [1, 1, 1]  # the frontend sums them for usage
    assert {p.num_input_tokens for p in out} == {2}
    assert "".join(p.text for p in out) == "<5><6><7>"  # deltas never repeat the prompt


def test_a_whole_answer_is_led_by_the_prompt_unless_excluded():
    reply = Reply(stream=False, exclude_input=False, num_input_tokens=True, num_output_tokens=True)
    [whole] = pieces(_events([5, 6]), reply, [1, 2], lambda: "PROMPT")
    assert (whole.ids, whole.text, whole.num_output_tokens, whole.final) == ([1, 2, 5, 6], "PROMPT<5><6>", 2, True)
    [alone] = pieces(_events([5, 6]), Reply(stream=False, exclude_input=True), [1, 2], lambda: "PROMPT")
    assert (alone.ids, alone.text, alone.num_output_tokens) == ([5, 6], "<5><6>", None)


# -- the door refuses what the engine would, before anything is fetched ------------------------------
def _card(kv_dtype: str):
    from kvcodec.engines import ModelCard

    return ModelCard("m", "m@x", layers=1, kv_heads=1, head_dim=8, vocab_size=200, max_context=512,
                     kv_dtype=kv_dtype)


@pytest.mark.parametrize("engine, kv_dtype, seeded", [
    ("transformers", "float32", True), ("vllm", "float16", True), ("vllm", "float32", False), ("trtllm", "float16", True),
])
def test_each_engine_says_what_it_honours_without_loading(engine, kv_dtype, seeded):
    from kvcodec.engines import sampling_fields
    from kvcodec.serving.sampling import ALL
    from kvcodec.settings import Settings

    fields = sampling_fields(Settings.load({"engine": engine}, env={}), _card(kv_dtype))
    assert ("seed" in fields) == seeded and "stop_words" in fields and fields <= ALL


class _NoFetch:
    """Fails the test if the door fetches."""

    def fetch(self, *args):
        raise AssertionError("fetched for a request the engine refuses")


def test_kv_fetch_refuses_a_seed_the_cpu_vllm_engine_cannot_take_without_fetching(monkeypatch):
    from kvcodec.engines import sampling_fields
    from kvcodec.settings import Settings

    fake = load_step(monkeypatch, "kv_fetch")
    fake.model.__spec__.loader.exec_module(fake.model)
    step = fake.model.TritonPythonModel.__new__(fake.model.TritonPythonModel)  # initialize's fields, by hand
    step.settings = Settings.load({"engine": "vllm"}, env={})
    step.card, step.tokenizer, step.fetcher = _card("float32"), types.SimpleNamespace(encode=_tokenize), _NoFetch()
    step.honoured = sampling_fields(step.settings, step.card)
    step.metrics = types.SimpleNamespace(record=lambda snapshot: None)
    step.fetcher.calls = types.SimpleNamespace(snapshot=lambda: {})
    sent = []
    request = openai_request(seed=3, temperature=0.5)
    request_obj = types.SimpleNamespace(get=request.get, get_response_sender=lambda: types.SimpleNamespace(
        send=lambda response=None, flags=0: sent.append((response, flags))))
    fake.get_input_tensor_by_name = lambda r, name: r.get(name)
    step.execute([request_obj])
    [(response, flags)] = sent
    assert flags == fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert "the vllm engine does not honour seed" in response.error.message
    sys.modules.pop("kvcodec.triton", None)
