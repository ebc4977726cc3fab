"""The kvcodec ensemble on a real tritonserver, called over gRPC and HTTP with tritonclient and
Triton's generate_stream endpoint: reuse gives full prefill's tokens, and every fault falls back."""
from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request

import numpy as np
import pytest

from kvcodec.format import container
from kvcodec.format.auth import ChunkAuth, load_auth
from kvcodec_client import ClientError, KVCodecClient

from .conftest import chunk_path, cli, ingest_text, replaced, text_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

QUESTION = "\n\n# Question: what does this module do?\n# Answer:"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def grpc(server):
    return KVCodecClient(server.grpc_url, "grpc")


@pytest.fixture(scope="module")
def http(server):
    return KVCodecClient(server.http_url, "http")


@pytest.fixture(scope="module")
def context_a(settings, tokenizer, tmp_path_factory):
    """A text ingested with lossless8 (2 full chunks), the prompt built on it, and its prefill answer."""
    text = text_of(tokenizer, "textwrap.py", 540)
    report = ingest_text(settings, tmp_path_factory.mktemp("a"), text)
    assert report["chunks"] == 2 and report["written"] == 2, report
    return text, tokenizer.encode(text + QUESTION)


@pytest.fixture(scope="module")
def prefill_a(server, grpc, context_a):
    result = grpc.generate(context_a[1], MAX_TOKENS, reuse=False)
    assert result.reused_tokens == 0 and len(result.tokens) == MAX_TOKENS
    return result


def test_grpc_reuse_gives_prefill_tokens(grpc, context_a, prefill_a):
    result = grpc.generate(context_a[1], MAX_TOKENS, reuse=True)
    assert result.reused_tokens == 512
    assert result.tokens == prefill_a.tokens
    assert result.text == prefill_a.text
    assert result.stats["chunks_used"] == 2 and result.stats["scheme"] == "lossless8"
    assert result.stats["bytes_fetched"] > 0 and result.stats["decode_s"] > 0
    assert result.stats["prompt_tokens"] == len(context_a[1])


def test_http_reuse_gives_prefill_tokens(http, context_a, prefill_a):
    result = http.generate(context_a[1], MAX_TOKENS, reuse=True)
    assert result.reused_tokens == 512
    assert result.tokens == prefill_a.tokens
    no_reuse = http.generate(context_a[1], MAX_TOKENS, reuse=False)
    assert no_reuse.reused_tokens == 0 and no_reuse.tokens == prefill_a.tokens


def test_unseen_prompt_is_full_prefill(grpc, tokenizer):
    ids = tokenizer.encode(text_of(tokenizer, "glob.py", 300) + QUESTION)
    result = grpc.generate(ids, 4, reuse=True)
    assert result.reused_tokens == 0
    assert result.stats["miss_reason"] == "no stored prefix"
    assert result.tokens == grpc.generate(ids, 4, reuse=False).tokens


@pytest.fixture(scope="module")
def context_b(settings, tokenizer, grpc, tmp_path_factory):
    text = text_of(tokenizer, "fnmatch.py", 800)
    report = ingest_text(settings, tmp_path_factory.mktemp("b"), text)
    assert report["chunks"] == 3
    ids = tokenizer.encode(text + QUESTION)
    return ids, grpc.generate(ids, MAX_TOKENS, reuse=False)


def test_corrupt_chunk_is_a_miss_from_there_on(settings, grpc, context_b):
    ids, prefill = context_b
    path = chunk_path(settings, ids, 1)
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0x40
    with replaced(path, bytes(damaged)):
        result = grpc.generate(ids, MAX_TOKENS, reuse=True)
    assert result.reused_tokens == 256
    assert "chunk 1: corrupt" in result.stats["miss_reason"]
    assert result.tokens == prefill.tokens
    healed = grpc.generate(ids, MAX_TOKENS, reuse=True)
    assert healed.reused_tokens == 768 and healed.tokens == prefill.tokens


def test_chunk_under_the_wrong_key_is_never_used(settings, grpc, context_b):
    ids, prefill = context_b
    with replaced(chunk_path(settings, ids, 1), chunk_path(settings, ids, 0).read_bytes()):
        result = grpc.generate(ids, MAX_TOKENS, reuse=True)
    assert result.reused_tokens == 256
    assert "chunk 1: foreign" in result.stats["miss_reason"]
    assert result.tokens == prefill.tokens


def test_kv_poisoning_with_valid_checksums_is_never_used(settings, grpc, context_b):
    """Someone who can write to the store puts a chunk of its own under a prompt's key: the same
    header (model, key, codec), other KV, every checksum valid, signed with a key of its own. The
    server reads it as foreign and answers with its own prefill."""
    ids, prefill = context_b
    path = chunk_path(settings, ids, 1)
    mine = container.parse(path.read_bytes(), load_auth(settings.key_file))
    other = container.parse(chunk_path(settings, ids, 0).read_bytes(), load_auth(settings.key_file))
    forged = container.Container(dict(mine.header), dict(other.sections)).to_bytes(ChunkAuth.random())
    with replaced(path, forged):
        result = grpc.generate(ids, MAX_TOKENS, reuse=True)
    assert result.reused_tokens == 256
    assert "chunk 1: foreign" in result.stats["miss_reason"] and "not signed" in result.stats["miss_reason"]
    assert result.tokens == prefill.tokens


def test_raw_reuse_is_the_engines_own_kv_and_gives_prefill_tokens(settings, tokenizer, grpc, tmp_path):
    """raw stores the transformers engine's float32 KV as it is: it travels as kv32, and reuse gives
    exactly the tokens of the engine's own full prefill."""
    text = text_of(tokenizer, "shlex.py", 540)
    ingest_text(settings, tmp_path, text, codec="raw")
    ids = tokenizer.encode(text + QUESTION)
    header = container.parse(chunk_path(settings, ids, 0, "raw").read_bytes(), load_auth(settings.key_file)).header
    assert header["layout"] == "native" and header["layout_params"] == {"dtype": "float32"}
    prefill = grpc.generate(ids, 2 * MAX_TOKENS, reuse=False)
    result = grpc.generate(ids, 2 * MAX_TOKENS, reuse=True)
    assert result.stats["scheme"] == "raw" and result.reused_tokens == 512 and result.stats["chunks_used"] == 2
    assert result.stats["bytes_fetched"] > 512 * 30 * 2 * 3 * 64 * 4  # float32 KV plus the headers
    assert result.tokens == prefill.tokens and result.text == prefill.text


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_empty_prompt_is_invalid_argument(server, protocol):
    client = KVCodecClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol)
    with pytest.raises(ClientError) as err:
        client.generate([], 4)
    assert err.value.message.endswith("input_ids is empty: the prompt needs at least one token")
    if protocol == "http":
        assert err.value.status == "400"  # INVALID_ARG; gRPC streams carry the message only


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_token_ids_past_the_vocabulary_are_invalid_argument(server, protocol):
    """Not an internal error: the request names a token the model does not have."""
    client = KVCodecClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol)
    with pytest.raises(ClientError) as err:
        client.generate([1, 2, 49152], 4)
    assert err.value.message.endswith("input_ids holds token id 49152, the vocabulary has 49152")
    if protocol == "http":
        assert err.value.status == "400"
    assert client.generate([1, 2, 49151], 1).tokens  # the last id of the vocabulary is fine


def test_bad_max_tokens_is_invalid_argument(grpc):
    with pytest.raises(ClientError) as err:
        grpc.generate([1, 2, 3], 0)
    assert err.value.message.endswith("max_tokens must be in 1..4096, got 0")


def _stream_error(server, tensors):
    """The error the ensemble answers to one gRPC streaming request of raw tensors."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, array, dtype in tensors:  # as given: the batch dimension is the caller's
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    answers: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put(error))
    client.async_stream_infer("kvcodec", inputs)
    error = answers.get(timeout=60)
    client.stop_stream()
    client.close()
    return error


def test_wrong_dtype_is_refused(server):
    error = _stream_error(server, [("input_ids", np.array([[1, 2, 3]], np.float32), "FP32"),
                                   ("max_tokens", np.array([[4]], np.int32), "INT32"),
                                   ("reuse", np.array([[True]]), "BOOL")])
    assert error is not None and "FP32" in error.message(), error


def test_wrong_shape_is_refused(server):
    error = _stream_error(server, [("input_ids", np.array([[[1, 2], [3, 4]]], np.int32), "INT32"),
                                   ("max_tokens", np.array([[4]], np.int32), "INT32"),
                                   ("reuse", np.array([[True]]), "BOOL")])
    assert error is not None and "shape" in error.message(), error
    error = _stream_error(server, [("input_ids", np.array([[1, 2]], np.int32), "INT32"),
                                   ("max_tokens", np.array([[4, 5]], np.int32), "INT32"),
                                   ("reuse", np.array([[True]]), "BOOL")])
    assert error is not None and "shape" in error.message(), error
    error = _stream_error(server, [("input_ids", np.array([1, 2], np.int32), "INT32"),  # no batch dimension
                                   ("max_tokens", np.array([4], np.int32), "INT32")])
    assert error is not None and "batch size does not match" in error.message(), error


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cli_generate_json(settings, server, context_a, prefill_a, tokenizer, tmp_path, protocol):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(tokenizer.decode(context_a[1]))
    url = server.grpc_url if protocol == "grpc" else server.http_url
    out = cli(settings, "generate", "--text-file", str(prompt), "--max-tokens", str(MAX_TOKENS),
              "--protocol", protocol, "--url", url, "--json").stdout
    result = json.loads(out)
    assert set(result) >= {"tokens", "text", "ttft_s", "reused_tokens"}
    assert result["tokens"] == prefill_a.tokens and result["reused_tokens"] == 512 and result["ttft_s"] > 0
    no_reuse = json.loads(cli(settings, "generate", "--text-file", str(prompt), "--max-tokens", "2",
                              "--protocol", protocol, "--url", url, "--json", "--no-reuse").stdout)
    assert no_reuse["reused_tokens"] == 0 and no_reuse["tokens"] == prefill_a.tokens[:2]


def _kvcodec_metrics(server) -> dict:
    """``{'name{labels}': value}`` of the kvcodec_* samples on the server's metrics endpoint."""
    with urllib.request.urlopen(f"http://{server.host}:{server.ports.metrics}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
            if line.startswith("kvcodec_")}


def test_metrics_count_each_request_by_outcome(server, grpc, context_a, prefill_a):
    """One reuse and one prefill request move the counters by exactly what they did (the module's
    requests run one at a time, so nothing else moves them meanwhile)."""
    before = _kvcodec_metrics(server)
    reuse = grpc.generate(context_a[1], 2, reuse=True)
    grpc.generate(context_a[1], 2, reuse=False)
    after = _kvcodec_metrics(server)

    def grew(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert reuse.reused_tokens == 512
    assert grew('kvcodec_requests_total{outcome="reuse"}') == 1
    assert grew('kvcodec_requests_total{outcome="prefill"}') == 1
    assert grew("kvcodec_reused_tokens_total") == 512
    assert grew("kvcodec_fetched_bytes_total") == reuse.stats["bytes_fetched"] > 0
