"""The adaptive fetcher through the real ensemble: a ladder ingested once, the per-request
``codecs`` input, per-chunk choices and the pipeline report in the response stats."""
from __future__ import annotations

import pytest

from kvcodec_client import ClientError, KVCodecClient

from .conftest import ingest_text, text_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

QUESTION = "\n\n# Question: what is this for?\n# Answer:"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def ladder_context(settings, tokenizer, tmp_path_factory):
    text = text_of(tokenizer, "sched.py", 540)
    report = ingest_text(settings, tmp_path_factory.mktemp("ladder"), text, codec="int8-zstd,raw")
    assert report["rungs"]["int8-zstd"]["written"] == 2 and report["rungs"]["raw"]["written"] == 2, report
    assert report["rungs"]["int8-zstd"]["ratio_vs_fp16"] > 1.5
    return tokenizer.encode(text + QUESTION)


@pytest.fixture(scope="module")
def grpc(server):
    return KVCodecClient(server.grpc_url, "grpc")


def test_ingest_records_costs_for_the_fetcher(settings, ladder_context):
    import json

    costs = json.loads((settings.home / "costs.json").read_text())
    assert any(k.startswith("int8-zstd/") for k in costs["rungs"]) and costs["prefill"]["s_per_token"] > 0


def test_adaptive_reuse_reports_its_choices(grpc, ladder_context):
    prefill = grpc.generate(ladder_context, MAX_TOKENS, reuse=False)
    result = grpc.generate(ladder_context, MAX_TOKENS)
    assert result.reused_tokens == 512 and result.tokens == prefill.tokens
    assert sum(result.stats["schemes"].values()) == 2 and set(result.stats["schemes"]) <= {"int8-zstd", "raw"}
    for chunk in result.stats["chunks"]:
        assert chunk["status"] == "ok" and "int8-zstd" in chunk["choice"] and "raw" in chunk["choice"]
    pipe = result.stats["pipeline"]
    assert pipe["bound_s"] > 0 and 0 <= pipe["hidden_fraction"] <= 1
    assert pipe["bound_with_compute_s"] >= pipe["bound_s"]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_request_can_name_its_rung(server, ladder_context, protocol):
    client = KVCodecClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol)
    result = client.generate(ladder_context, 2, codecs="raw")
    assert result.stats["schemes"] == {"raw": 2} and result.stats["chunks"][0]["choice"] == ""


def test_an_unknown_rung_is_invalid_arg(server, ladder_context):
    client = KVCodecClient(server.http_url, "http")
    with pytest.raises(ClientError, match="codec 'h266' is unknown") as err:
        client.generate(ladder_context, 2, codecs="h266")
    assert err.value.status == "400"
