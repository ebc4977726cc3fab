"""perf_analyzer (the real 2.51 binary, from ``.venv-pa/``) against the session's real tritonserver.

A tiny run: a ~300-token context ingested into the session's store, 2 new tokens, count windows
of 2 requests. The perf_analyzer venv is set up here if missing (``perf/perf_analyzer_env.sh``,
two wheels with --no-deps and Debian's libb64-0d, ~10 s), as CI starts from a fresh machine.
"""
import json

import pytest

from kvcodec_tools.make_inputs import make_inputs
from kvcodec_tools.perf_analyzer import Target, ensure_perf_analyzer, perf_analyzer_version, run_targets, write_results

from .conftest import ingest_text, text_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def perf_analyzer():
    binary, env = ensure_perf_analyzer()
    return perf_analyzer_version(binary, env)


def test_perf_analyzer_ttft_reuse_and_prefill(server, settings, tokenizer, perf_analyzer, tmp_path):
    from kvcodec_client.client import KVCodecClient

    assert perf_analyzer.startswith("2.51")
    context = text_of(tokenizer, "textwrap.py", 300)
    report = ingest_text(settings, tmp_path, context)
    assert report["chunks"] >= 1
    meta = make_inputs(tokenizer, context, "tiny", tmp_path / "inputs", max_tokens=2, source="textwrap.py")
    files = meta["files"]

    [prompt] = json.loads(open(files["reuse"]).read())["data"][0]["text_input"]  # text, as the server takes it
    check = KVCodecClient(server.grpc_url, "grpc").generate(prompt, 1, reuse=True)
    assert check.reused_tokens >= settings.chunk_tokens  # this prompt takes the reused path
    assert check.prompt_tokens == meta["prompt_tokens"]

    # perf_analyzer's own stability rule (3 windows within 50%) can miss on a shared machine:
    # run_targets then measures again with windows within 100% of each other
    rows = run_targets([Target("local", None, server.grpc_url)], [files["reuse"], files["prefill"]],
                       meta["context_tokens"], request_count=2, work_dir=tmp_path / "pa", max_trials=20)
    doc = write_results(rows, tmp_path / "perf_analyzer.json", perf_analyzer)
    written = json.loads((tmp_path / "perf_analyzer.json").read_text())
    assert written == doc and written["perf_analyzer_version"] == perf_analyzer
    reuse, prefill = written["rows"]
    for row in (reuse, prefill):
        assert row["label"] == "local" and row["bandwidth_mbps"] is None
        assert row["context_tokens"] == meta["context_tokens"] and row["prompt_tokens"] == meta["prompt_tokens"]
        assert row["requests"] >= 2 * 3  # at least 3 windows of 2 requests
        assert 0 < row["ttft_min_s"] <= row["ttft_p50_s"] <= row["ttft_p90_s"]
        assert "--streaming" in row["perf_analyzer_args"]
    assert reuse["reuse"] is True and reuse["reused_tokens"] == check.reused_tokens
    assert prefill["reuse"] is False and prefill["reused_tokens"] == 0


def test_make_perf_script_across_a_throttled_link(settings, tokenizer, perf_analyzer, tmp_path):
    """perf/kvcodec_tools/run_perf.py as `make perf` (``kvcodec bench perf``) runs it, on a tiny context
    and one link rate: perf_analyzer and genai-perf on the same server, reuse and prefill; the plot."""
    import subprocess
    import sys

    from .conftest import REPO

    source = tmp_path / "tiny.py"
    source.write_text(text_of(tokenizer, "textwrap.py", 300))
    out = tmp_path / "perf_analyzer.json"
    proc = subprocess.run([sys.executable, str(REPO / "perf" / "kvcodec_tools" / "run_perf.py"), "--home", str(tmp_path / "home"),
                           "--model-cache", str(settings.model_cache), "--text-file", str(source),
                           "--max-tokens", "2", "--request-count", "2", "--bandwidth-mbps", "1000", "--max-trials", "30",
                           "--genai-perf", "--output", str(out)], capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["perf_analyzer_version"] == perf_analyzer
    reuse, prefill = doc["rows"]
    for row in (reuse, prefill):
        assert row["label"] == "1000Mbps" and row["bandwidth_mbps"] == 1000
        assert row["link"] in ("netns", "userspace")
        assert 0 < row["ttft_p50_s"] <= row["ttft_p90_s"] and row["requests"] >= 2 * 3
    assert reuse["reuse"] is True and reuse["reused_tokens"] >= settings.chunk_tokens
    assert prefill["reuse"] is False and prefill["reused_tokens"] == 0
    for row, asked in ((reuse, "reuse:true"), (prefill, "reuse:false")):  # genai-perf beside perf_analyzer
        g = row["genai_perf"]
        assert g["time_to_first_token"]["p50"] > 0 and g["inter_token_latency"]["p50"] > 0
        assert g["output_token_throughput"]["avg"] > 0 and g["request_throughput"]["avg"] > 0
        assert "tensorrtllm" in g["command"] and asked in g["command"] and "prompts.jsonl" in g["command"]
        assert abs(g["input_sequence_length"]["avg"] - row["prompt_tokens"]) <= 2  # the same prompt
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "1000Mbps" in proc.stdout and "link" in proc.stdout


def test_make_perf_script_refuses_bad_rates(tmp_path):
    import subprocess
    import sys

    from .conftest import REPO

    proc = subprocess.run([sys.executable, str(REPO / "perf" / "kvcodec_tools" / "run_perf.py"), "--bandwidth-mbps", "0,fast",
                           "--home", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Mbit/s" in proc.stderr
