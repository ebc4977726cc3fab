"""``kvcodec bench concurrency``'s pure parts: the request plan, the rows of a level (requests/s,
percentiles, answers_match), speedups against clients=1, merging another engine's rows into an
existing JSON, and the plot of two engines. No server."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcodec.settings import Settings
from kvcodec_tools.cli import _settings, build_parser
from kvcodec_tools.concurrency import (
    ConcurrencyConfig,
    Sample,
    add_speedups,
    concurrency_config,
    merge,
    plan,
    plot,
    read_json,
    summarize,
)
from kvcodec_tools.tritonserver import Ports, TritonServer

REPO = Path(__file__).resolve().parents[2]


def sample(mode, ttft, total=1.0, match=True, error="", client=0, prompt=0):
    return Sample(client, prompt, mode, ttft_s=ttft, total_s=total, reused_tokens=512 if mode == "reuse" else 0,
                  match=match, error=error)


def level(engine, clients, wall_s, reuse_ttft=0.1, prefill_ttft=0.5):
    samples = [sample("reuse", reuse_ttft, 1.0), sample("prefill", prefill_ttft, 2.0)] * clients
    return summarize(engine, clients, samples, wall_s)


def test_plan_alternates_modes_and_spreads_prompts():
    assert plan(0, 4, 3) == [(0, "reuse"), (1, "prefill"), (2, "reuse"), (0, "prefill")]
    # the next client starts one step on: half the clients prefill while the other half reuse
    assert plan(1, 2, 3) == [(1, "prefill"), (2, "reuse")]


def test_config_always_has_the_one_client_baseline():
    assert ConcurrencyConfig([8, 4]).clients == [1, 4, 8]
    with pytest.raises(ValueError, match="clients"):
        ConcurrencyConfig([0, 2])


def test_rows_per_mode_with_rates_and_percentiles():
    samples = [sample("reuse", t, total=t + 1) for t in (0.1, 0.2, 0.3, 0.4)] + \
              [sample("prefill", t, total=t + 1) for t in (1.0, 2.0)]
    rows = {r["mode"]: r for r in summarize("vllm", 4, samples, wall_s=2.0)}
    assert set(rows) == {"all", "reuse", "prefill"}
    assert rows["all"]["requests"] == 6 and rows["all"]["requests_per_s"] == 3.0
    assert rows["reuse"]["requests_per_s"] == 2.0 and rows["prefill"]["requests_per_s"] == 1.0
    assert rows["reuse"]["ttft_p50_s"] == pytest.approx(0.25)
    assert rows["reuse"]["ttft_p90_s"] == pytest.approx(0.37)
    assert rows["prefill"]["total_p50_s"] == pytest.approx(2.5)
    assert rows["reuse"]["reused_tokens_min"] == 512
    assert all(r["answers_match"] and r["mismatches"] == 0 and r["errors"] == 0 for r in rows.values())
    assert all(r["engine"] == "vllm" and r["clients"] == 4 for r in rows.values())


def test_a_different_or_failed_answer_does_not_match():
    samples = [sample("reuse", 0.1), sample("reuse", 0.2, match=False),
               sample("prefill", 0.5, match=False, error="boom")]
    rows = {r["mode"]: r for r in summarize("transformers", 2, samples, wall_s=1.0)}
    assert rows["all"]["answers_match"] is False and rows["all"]["mismatches"] == 2
    assert rows["reuse"]["answers_match"] is False
    # a failed request counts as a request, not as throughput, and has no TTFT
    assert rows["prefill"]["errors"] == 1 and rows["prefill"]["requests_per_s"] == 0.0
    assert rows["prefill"]["ttft_p50_s"] is None


def test_speedup_against_the_same_engine_and_mode_at_one_client():
    rows = add_speedups(level("a", 1, wall_s=4.0) + level("a", 4, wall_s=8.0) + level("b", 4, wall_s=1.0))
    by = {(r["engine"], r["clients"], r["mode"]): r for r in rows}
    assert by["a", 1, "all"]["speedup_vs_1"] == 1.0
    assert by["a", 4, "all"]["speedup_vs_1"] == 2.0  # 8 requests in 8 s against 2 in 4 s
    assert by["a", 4, "reuse"]["speedup_vs_1"] == 2.0
    assert by["b", 4, "all"]["speedup_vs_1"] is None  # no baseline of its own


def test_merge_replaces_only_this_engines_rows(tmp_path):
    path = tmp_path / "concurrency.json"
    first = merge(None, "transformers", add_speedups(level("transformers", 1, 4.0) + level("transformers", 4, 8.0)),
                  {"created": "t1"})
    path.write_text(json.dumps(first))
    rows = add_speedups(level("vllm", 1, 4.0) + level("vllm", 4, 2.0))
    doc = merge(read_json(path), "vllm", rows, {"created": "t2"})
    assert {r["engine"] for r in doc["rows"]} == {"transformers", "vllm"}
    assert len(doc["rows"]) == 12 and set(doc["engines"]) == {"transformers", "vllm"}
    assert doc["engines"]["transformers"] == {"created": "t1"}
    assert doc["cpu_count"] >= 1 and doc["created"]
    # running vLLM again replaces its rows (and keeps transformers')
    again = merge(doc, "vllm", add_speedups(level("vllm", 1, 2.0)), {"created": "t3"})
    assert sorted((r["engine"], r["clients"]) for r in again["rows"] if r["mode"] == "all") == \
        [("transformers", 1), ("transformers", 4), ("vllm", 1)]
    assert again["engines"]["vllm"] == {"created": "t3"}


def test_read_json_ignores_a_missing_or_foreign_file(tmp_path):
    assert read_json(tmp_path / "none.json") is None
    (tmp_path / "bad.json").write_text("{not json")
    assert read_json(tmp_path / "bad.json") is None
    (tmp_path / "other.json").write_text(json.dumps({"results": []}))
    assert read_json(tmp_path / "other.json") is None


def test_plot_of_two_engines_writes_a_png(tmp_path):
    rows = []
    for engine, walls in (("transformers", (4.0, 16.0, 32.0)), ("vllm", (4.0, 6.0, 9.0))):
        rows += add_speedups([r for c, w in zip((1, 4, 8), walls, strict=True) for r in level(engine, c, w)])
    png = tmp_path / "out" / "concurrency.png"
    plot(rows, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_runs_the_benchmark_its_flags_describe(tmp_path):
    """What ``kvcodec bench concurrency`` hands to ``run_concurrency``: the config its flags build
    (its defaults are the library's; the one-client baseline always added) and the settings whose
    engine and threads the server it starts is given."""
    parse = build_parser().parse_args
    assert concurrency_config(parse(["bench", "concurrency"])) == ConcurrencyConfig([1, 4, 8])
    config = concurrency_config(parse(["bench", "concurrency", "--clients", "2", "--requests", "2",
                                       "--context-tokens", "300", "--threads", "1"]))
    assert (config.clients, config.requests, config.context_tokens, config.threads) == ([1, 2], 2, 300, 1)
    with pytest.raises(SystemExit, match="^kvcodec bench concurrency: clients must be counts >= 1, got \\[0\\]$"):
        concurrency_config(parse(["bench", "concurrency", "--clients", "0"]))
    args = parse(["bench", "concurrency", "--engine", "vllm", "--home", str(tmp_path), "--threads", "1"])
    env = TritonServer(REPO / "model_repository", _settings(args), Ports()).environment()
    assert Settings.load(env=env).engine == "vllm" and Settings.load(env=env).threads == 1  # what llm loads
