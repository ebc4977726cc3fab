"""perf/kvcodec_tools/perf_analyzer.py below the binary: TTFT from a real profile export, the instability check.

Fixtures in ``data/perf_analyzer/`` were captured from perf_analyzer 2.51 against the kvcodec
ensemble: ``reuse.profile.json`` (a reuse run's export, cut to 4 requests, input ids and stats
shortened), ``reuse.out.txt`` (that run's output) and ``unstable.out.txt`` (a run with
``--stability-percentage 0.01 --max-trials 3``, which exited 2).
"""
import copy
import json
from pathlib import Path

import pytest

from kvcodec_tools.make_inputs import input_data
from kvcodec_tools.perf_analyzer import (
    PerfAnalyzerError,
    Target,
    UnstableMeasurement,
    _input_facts,
    check_output,
    perf_analyzer_args,
    reported_p50_latency_s,
    summarize,
    ttfts_from_profile,
)
from kvcodec_tools.stats import percentile
from kvcodec_tools.texts import cut_to_tokens

DATA = Path(__file__).parent / "data" / "perf_analyzer"


@pytest.fixture
def profile():
    return json.loads((DATA / "reuse.profile.json").read_text())


def test_ttft_is_first_response_minus_request(profile):
    ttfts, reused = ttfts_from_profile(profile)
    assert len(ttfts) == 4
    req = profile["experiments"][0]["requests"][0]
    assert ttfts[0] == pytest.approx((req["response_timestamps"][0] - req["timestamp"]) / 1e9)
    assert ttfts == pytest.approx([2.232455976, 2.251478631, 2.218147114, 2.198971622])
    assert reused == [1280] * 4


def test_summary(profile):
    s = summarize(ttfts_from_profile(profile)[0])
    assert s["requests"] == 4
    assert s["ttft_p50_s"] == pytest.approx((2.218147114 + 2.232455976) / 2, abs=1e-4)
    assert s["ttft_min_s"] <= s["ttft_p50_s"] <= s["ttft_p90_s"] <= s["ttft_max_s"]
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)  # numpy's linear default


def test_no_requests_is_an_error(profile):
    empty = copy.deepcopy(profile)
    empty["experiments"][0]["requests"] = []
    with pytest.raises(PerfAnalyzerError, match="no request"):
        ttfts_from_profile(empty)
    with pytest.raises(PerfAnalyzerError, match="no request"):
        ttfts_from_profile({"experiments": []})


def test_request_without_response_is_an_error(profile):
    broken = copy.deepcopy(profile)
    broken["experiments"][0]["requests"][1]["response_timestamps"] = []
    with pytest.raises(PerfAnalyzerError, match="request 1 .* no response"):
        ttfts_from_profile(broken)


def test_first_response_must_carry_a_token(profile):
    broken = copy.deepcopy(profile)
    req = broken["experiments"][0]["requests"][0]
    req["response_outputs"][0] = req["response_outputs"][-1]  # the empty final response
    with pytest.raises(PerfAnalyzerError, match="carries no token"):
        ttfts_from_profile(broken)


def test_unstable_output_fails_even_with_exit_code_0():
    out = (DATA / "unstable.out.txt").read_text()
    with pytest.raises(UnstableMeasurement, match="Failed to obtain stable measurement"):
        check_output(out, 0)
    with pytest.raises(UnstableMeasurement):
        check_output(out, 2)


def test_stable_output_passes_and_nonzero_exit_fails():
    out = (DATA / "reuse.out.txt").read_text()
    check_output(out, 0)
    with pytest.raises(PerfAnalyzerError, match="code 99"):
        check_output(out, 99)
    assert reported_p50_latency_s(out) == pytest.approx(2.444672)  # to the last response, not TTFT


def test_args_are_grpc_streaming_count_windows():
    args = perf_analyzer_args("127.0.0.1:8001", "in.json", "p.json", request_count=2)
    joined = " ".join(args)
    for part in ("-m kvcodec", "-i grpc", "--streaming", "--async", "--concurrency-range 1",
                 "--measurement-mode count_windows", "--measurement-request-count 2",
                 "--stability-percentage 50", "--max-trials 10", "--input-data in.json",
                 "--profile-export-file p.json"):
        assert part in joined


def test_target_parse():
    assert Target.parse("100mbit,100,10.0.0.2:8001") == Target("100mbit", 100.0, "10.0.0.2:8001")
    assert Target.parse("local,,127.0.0.1:8001").bandwidth_mbps is None
    with pytest.raises(ValueError):
        Target.parse("nope")


def test_input_data_document():
    doc = input_data("def f(x):", 4, reuse=False)
    assert doc == {"data": [{"text_input": ["def f(x):"], "max_tokens": [4], "reuse": [False], "stream": [True],
                             "exclude_input_in_output": [True]}]}
    doc = input_data([1, 2, 3], 4, reuse=False)  # the token-id interface
    assert doc == {"data": [{"input_ids": {"content": [1, 2, 3], "shape": [3]}, "max_tokens": [4],
                             "reuse": [False]}]}


def test_committed_default_inputs_match_their_meta():
    inputs = Path(__file__).resolve().parents[2] / "perf" / "inputs"
    meta = json.loads((inputs / "default.meta.json").read_text())
    reuse = json.loads((inputs / "default.reuse.json").read_text())["data"][0]
    prefill = json.loads((inputs / "default.prefill.json").read_text())["data"][0]
    assert reuse["reuse"] == [True] and prefill["reuse"] == [False]
    assert reuse["text_input"] == prefill["text_input"]
    context = (inputs / "default.context.txt").read_text(encoding="utf-8")
    assert reuse["text_input"] == [context + meta["question"]]
    assert meta["context_tokens"] < meta["prompt_tokens"]
    assert reuse["max_tokens"] == [meta["max_tokens"]]
    assert _input_facts(inputs / "default.reuse.json") == {"prompt_tokens": meta["prompt_tokens"],
                                                           "max_tokens": meta["max_tokens"], "reuse": True}


class _WordTokenizer:
    def encode(self, text):
        return text.split()


def test_cut_to_tokens_keeps_whole_lines():
    text = "a b\nc d e\nf\ng h i j\n"
    assert cut_to_tokens(_WordTokenizer(), text, 4) == "a b\nc d e\n"
    assert cut_to_tokens(_WordTokenizer(), text, 100) == text


def test_an_unstable_measurement_is_taken_again_once_with_relaxed_stability(monkeypatch):
    from kvcodec_tools import perf_analyzer as pa

    calls, unstable_below = [], [pa.RELAXED_STABILITY]

    def fake(url, path, label, bandwidth, tokens, **options):
        calls.append(options.get("stability_percentage", 50))
        if calls[-1] < unstable_below[0]:
            raise pa.UnstableMeasurement("windows apart")
        return {"label": label, "stability": calls[-1]}

    monkeypatch.setattr(pa, "run_perf_analyzer", fake)
    rows = pa.run_targets([pa.Target("local", None, "h:1")], ["a.json"], 300, log=lambda *_: None)
    assert rows == [{"label": "local", "stability": 100}] and calls == [50, 100]
    calls.clear()
    unstable_below[0] = 1000  # unstable whatever the rule
    with pytest.raises(pa.UnstableMeasurement):  # already relaxed: no second try
        pa.run_targets([pa.Target("local", None, "h:1")], ["a.json"], 300, stability_percentage=100,
                       log=lambda *_: None)
    assert calls == [100]
