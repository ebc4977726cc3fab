"""The ensemble's front door on a real tritonserver: TensorRT-LLM's ensemble interface over Triton's
HTTP ``generate`` / ``generate_stream`` endpoints, as curl or genai-perf send it (JSON text in, text
out): the prompt as ``text_input`` reuses the chunks ``kvcodec ingest --text-file`` stored from the
same text; one whole answer (``stream`` false: the ``generate`` endpoint) or one delta per token
(``stream`` true), the deltas adding up to the whole; a seeded sampled request gives the same text
with and without reuse (raw: the engine's own KV); stop words stop; the token counts come back when
asked; bad values are INVALID_ARG naming the input; and the request Triton's OpenAI frontend makes,
tensor for tensor (its frontend cannot run on this tritonserver: docs/deploy.md)."""
from __future__ import annotations

import json
import queue

import numpy as np
import pytest

from kvcodec_client import KVCodecClient

from .conftest import cli, ingest_text, post, text_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

QUESTION = "\n\n# Question: what does this module do?\n# Answer:"


@pytest.fixture(scope="module")
def document(settings, tokenizer, tmp_path_factory):
    """A document ingested from its text at raw (the transformers engine's own KV, exactly)."""
    text = text_of(tokenizer, "fnmatch.py", 540)
    report = ingest_text(settings, tmp_path_factory.mktemp("front-door"), text, codec="raw")
    assert report["chunks"] == 2, report
    return text


def test_text_in_reuses_the_ingested_document_and_answers_whole(server, tokenizer, document):
    prompt = document + QUESTION
    status, answer = post(server, "generate", {"text_input": prompt, "max_tokens": 8, "codecs": "raw",
                                                "return_num_input_tokens": True, "return_num_output_tokens": True})
    assert status == 200, answer
    assert answer["reused_tokens"] == 512, json.loads(answer["stats"]).get("miss_reason")
    ids = tokenizer.encode(prompt)
    prefill = KVCodecClient(server.grpc_url, "grpc").generate(ids, 8, reuse=False)
    assert answer["text_output"] == prompt + tokenizer.decode(prefill.tokens)  # TensorRT-LLM: the input leads
    assert (answer["num_input_tokens"], answer["num_output_tokens"]) == (len(ids), len(prefill.tokens))
    status, alone = post(server, "generate", {"text_input": prompt, "max_tokens": 8, "exclude_input_in_output": True})
    assert status == 200 and alone["text_output"] == tokenizer.decode(prefill.tokens)


def test_streamed_deltas_add_up_to_the_whole_answer(server, document):
    body = {"text_input": document + QUESTION, "max_tokens": 12, "exclude_input_in_output": True}
    status, whole = post(server, "generate", body)
    assert status == 200
    status, events = post(server, "generate_stream", dict(body, stream=True))
    assert status == 200 and len(events) >= 2, events  # one per token (and the final one)
    assert "".join(e.get("text_output", "") for e in events) == whole["text_output"]


def test_a_seeded_sampled_request_is_the_same_with_and_without_reuse(server, document):
    body = {"text_input": document + QUESTION, "max_tokens": 16, "exclude_input_in_output": True, "codecs": "raw",
            "temperature": 1.0, "top_p": 0.95, "seed": 20261205}
    answers = [post(server, "generate", dict(body, reuse=reuse)) for reuse in (True, False, True)]
    assert [s for s, _ in answers] == [200] * 3
    assert [a["reused_tokens"] for _, a in answers] == [512, 0, 512]
    assert answers[0][1]["text_output"] == answers[1][1]["text_output"] == answers[2][1]["text_output"]
    others = {post(server, "generate", dict(body, seed=s))[1]["text_output"] for s in (1, 2, 3)}
    assert len(others) > 1  # the seed matters: it samples


def test_stop_words_stop(server, document):
    body = {"text_input": document + QUESTION, "max_tokens": 16, "exclude_input_in_output": True}
    whole = post(server, "generate", body)[1]["text_output"]
    word = whole.strip()[:3]
    status, cut = post(server, "generate", dict(body, stop_words=[word]))
    assert status == 200 and cut["text_output"] == whole[:whole.index(word)]
    status, events = post(server, "generate_stream", dict(body, stream=True, stop_words=[word]))
    assert "".join(e.get("text_output", "") for e in events) == whole[:whole.index(word)]


@pytest.mark.parametrize("body, names", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"input_ids": [1, 2, 3]}, "text_input or input_ids"),
    ({"stop_words": [""], "max_tokens": 4}, None),  # an empty word is no word: accepted
])
def test_bad_values_are_invalid_argument_naming_the_input(server, body, names):
    status, answer = post(server, "generate", {"text_input": "def f(x):", "max_tokens": 4, **body})
    if names is None:
        assert status == 200, answer
    else:
        assert status == 400 and names in answer.get("error", ""), (status, answer)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_kvcodec_generate_sends_text_and_sampling(settings, server, tokenizer, document, protocol):
    url = server.grpc_url if protocol == "grpc" else server.http_url
    prompt = document + QUESTION

    def run(*flags):
        return json.loads(cli(settings, "generate", "--prompt", prompt, "--max-tokens", "12", "--protocol", protocol,
                              "--url", url, "--json", *flags).stdout)

    text, ids = run(), run("--ids")
    assert text["tokens"] == ids["tokens"] and text["reused_tokens"] == ids["reused_tokens"] == 512
    assert text["prompt_tokens"] == ids["prompt_tokens"] == len(tokenizer.encode(prompt))
    sampled = run("--temperature", "1.0", "--top-p", "0.95", "--seed", "11")
    assert sampled["text"] == run("--temperature", "1.0", "--top-p", "0.95", "--seed", "11", "--no-reuse")["text"]
    word = text["text"].strip()[:3]
    assert run("--stop", word)["text"] == text["text"][:text["text"].index(word)]


def openai_inputs(prompt: str, stream: bool, max_tokens: int, **options) -> dict:
    """The tensors Triton's OpenAI frontend sends a model that is not vLLM, exactly
    (``_create_trtllm_inference_request``, python/openai/openai_frontend/engine/utils/triton.py):
    each ``[[value]]`` (a batch of one), ``stop_words`` ``[[w, ...]]``; temperature, top_p and both
    penalties always (the OpenAI schema's defaults fill them), seed and stop when set; and the two
    ``return_num_*_tokens`` flags its usage needs."""
    inputs = {"text_input": np.array([[prompt.encode()]], dtype=object), "stream": np.bool_([[stream]]),
              "max_tokens": np.int32([[max_tokens]]), "return_num_input_tokens": np.bool_([[True]]),
              "return_num_output_tokens": np.bool_([[True]])}
    for name, default in (("top_p", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                          ("temperature", 1.0)):
        inputs[name] = np.float32([[options.get(name, default)]])
    if "seed" in options:
        inputs["seed"] = np.uint64([[options["seed"]]])
    if "stop" in options:
        inputs["stop_words"] = np.array([[w.encode() for w in options["stop"]]], dtype=object)
    return inputs


def grpc_responses(server, inputs: dict) -> list:
    """Every response of one request of raw tensors over gRPC: (outputs by name, final)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    answers: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("kvcodec", tensors, enable_empty_final_response=True)
        out = []
        while True:
            result, error = answers.get(timeout=300)
            if error is not None:
                raise RuntimeError(error.message())
            response = result.get_response()
            outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
            final = response.parameters["triton_final_response"].bool_param
            if outputs or final:
                out.append((outputs, final))
            if final:
                return out
    finally:
        client.stop_stream()
        client.close()


def _one_string(outputs: dict, name: str) -> str:
    value = outputs[name]
    assert value.shape == (1, 1), (name, value.shape)  # the frontend reads exactly one string
    return value[0, 0].decode("utf-8")


def test_the_openai_frontends_exact_request(server, tokenizer, document):
    prompt = document + QUESTION
    ids = tokenizer.encode(prompt)
    greedy = KVCodecClient(server.grpc_url, "grpc").generate(ids, 8, reuse=False)
    # a completion, not streamed: one response, final (the frontend checks the flags), the whole text
    [(outputs, final)] = grpc_responses(server, openai_inputs(prompt, False, 8, temperature=0.0))
    assert final and outputs["reused_tokens"].shape == (1, 1) and outputs["reused_tokens"][0, 0] == 512
    assert _one_string(outputs, "text_output") == prompt + tokenizer.decode(greedy.tokens)  # no echo: the setting
    assert (outputs["num_input_tokens"][0, 0], outputs["num_output_tokens"][0, 0]) == (len(ids), len(greedy.tokens))
    # streamed: deltas adding up to the answer; output tokens counted per response (the frontend sums them)
    streamed = grpc_responses(server, openai_inputs(prompt, True, 8, temperature=0.0))
    texts = [_one_string(o, "text_output") for o, _ in streamed if "text_output" in o]
    assert "".join(texts) == tokenizer.decode(greedy.tokens)
    assert sum(int(o["num_output_tokens"][0, 0]) for o, _ in streamed if "num_output_tokens" in o) == len(greedy.tokens)
    assert streamed[-1][1] and not any(final for _, final in streamed[:-1])
    # its defaults sample (temperature 1, top_p 1); a seed and a stop word as it sends them
    seeded = [grpc_responses(server, openai_inputs(prompt, False, 12, seed=5)) for _ in range(2)]
    assert _one_string(seeded[0][0][0], "text_output") == _one_string(seeded[1][0][0], "text_output")
    answer = _one_string(seeded[0][0][0], "text_output")[len(prompt):]
    word = answer.strip()[:2]
    [(stopped, _)] = grpc_responses(server, openai_inputs(prompt, False, 12, seed=5, stop=[word, "never"]))
    assert _one_string(stopped, "text_output") == prompt + answer[:answer.index(word)]


def test_a_batch_of_two_prompts_is_refused(server):
    """One sequence a request: Triton itself refuses a batch of two (max_batch_size 1)."""
    inputs = {name: np.concatenate([a, a]) for name, a in openai_inputs("a", False, 4).items()}
    with pytest.raises(RuntimeError) as refused:
        grpc_responses(server, inputs)
    assert "batch-size must be <= 1" in str(refused.value)


def test_a_chat_reuses_the_system_prompt_ingested_with_chat(settings, server, tokenizer, tmp_path):
    """``kvcodec ingest --chat`` stores the chat template's text of a system message; the prompt the
    OpenAI frontend makes of a chat with it (the same template, then a user turn) reuses it."""
    document = text_of(tokenizer, "shlex.py", 560)
    path = tmp_path / "system.txt"
    path.write_text(document)
    report = json.loads(cli(settings, "ingest", "--text-file", str(path), "--chat", "--codec", "raw", "--json",
                            "--quiet").stdout)
    assert report["chunks"] == 2, report
    chat = tokenizer.chat_text([{"role": "system", "content": document},
                                {"role": "user", "content": "What does split() do?"}], add_generation_prompt=True)
    inputs = dict(openai_inputs(chat, False, 8, temperature=0.0), exclude_input_in_output=np.bool_([[True]]))
    [(outputs, _)] = grpc_responses(server, inputs)
    assert outputs["reused_tokens"][0, 0] == 512  # without --chat the stored text would not start the chat's
    prefill = KVCodecClient(server.grpc_url, "grpc").generate(tokenizer.encode(chat), 8, reuse=False)
    assert _one_string(outputs, "text_output") == tokenizer.decode(prefill.tokens)
