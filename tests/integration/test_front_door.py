"""The ensemble's front door on a real tritonserver: TensorRT-LLM's ensemble interface over Triton's
HTTP ``generate`` / ``generate_stream`` endpoints, as curl or genai-perf send it (JSON text in, text
out): the prompt as ``text_input`` reuses the chunks ``kvcodec ingest --text-file`` stored from the
same text; one whole answer (``stream`` false: the ``generate`` endpoint) or one delta per token
(``stream`` true), the deltas adding up to the whole; a seeded sampled request gives the same text
with and without reuse (raw: the engine's own KV); stop words stop; the token counts come back when
asked; bad values are INVALID_ARG naming the input."""
from __future__ import annotations

import json

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
