"""``kvcodec bench ttft`` itself, end to end on a tiny run: one link rate (a real throttled link:
netns + tc as root, else the userspace shaper), one 256-token context (one chunk), one run per
method, two new tokens. It runs the console script as a user would (ingest over loopback nginx,
then link up -> nginx behind it -> tritonserver with that store) and checks the JSON and the plot.
``kvcodec bench concurrency`` likewise, tiny: two client counts, two requests each, one chunk.
"""
import json
import os
import subprocess

import pytest

from .conftest import KVCODEC, REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

KEYS = {"method", "bandwidth_mbps", "context_tokens", "ttft_p50_s", "ttft_p90_s", "bytes_fetched", "tokens_match"}
METHODS = ["prefill", "raw", "int8-zstd", "kvcodec"]
CONTEXT = 256  # the smallest context: one chunk


@pytest.fixture(scope="module")
def bench(tmp_path_factory, settings):
    out = tmp_path_factory.mktemp("bench")
    cmd = [KVCODEC, "bench", "ttft", "--home", str(out / "home"), "--model-cache", str(settings.model_cache),
           "--threads", "1", "--bandwidth-mbps", "1000", "--context-tokens", str(CONTEXT),
           "--methods", ",".join(METHODS), "--ladder", "video,int8-zstd,raw",  # explicit: not the default's job
           "--runs", "1", "--prefill-runs", "1", "--max-tokens", "2", "--delay-ms", "1",
           "--link-mode", "auto", "--json", str(out / "ttft.json"), "--plot", str(out / "ttft.png")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCODEC_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, env=env, cwd=REPO)
    assert proc.returncode == 0, f"kvcodec bench ttft failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return out, json.loads((out / "ttft.json").read_text())


def test_one_row_per_method_with_the_documented_keys(bench):
    _, doc = bench
    rows = doc["rows"]
    assert [r["method"] for r in rows] == METHODS
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        assert r["bandwidth_mbps"] == 1000 and r["context_tokens"] == CONTEXT
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"]
        assert isinstance(r["tokens_match"], bool)
    assert doc["config"]["rungs"] == ["raw", "int8-zstd", "video"]
    assert doc["checks"]["lossless_tokens_match"] is True
    (link,) = doc["links"]
    assert link["bandwidth_mbps"] == 1000 and link["store_url"].startswith("http://")
    expected_kind = "netns" if os.geteuid() == 0 else "userspace"
    assert all(r["link"] == expected_kind for r in rows)


def test_tokens_and_bytes(bench):
    _, doc = bench
    by = {r["method"]: r for r in doc["rows"]}
    # lossless: the same greedy tokens as prefill (the command exits 1 otherwise)
    assert by["prefill"]["tokens_match"] is True and by["raw"]["tokens_match"] is True
    assert by["prefill"]["bytes_fetched"] == 0 and by["prefill"]["reused_tokens"] == 0
    for m in ("raw", "int8-zstd", "kvcodec"):
        assert by[m]["bytes_fetched"] > 0, by[m]
        assert by[m]["reused_tokens"] == CONTEXT, by[m]
    assert by["raw"]["schemes"] == {"raw": 1} and by["int8-zstd"]["schemes"] == {"int8-zstd": 1}
    assert by["raw"]["bytes_fetched"] > by["int8-zstd"]["bytes_fetched"]


def test_plot_written(bench):
    out, _ = bench
    png = out / "ttft.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_concurrency_transformers(tmp_path, settings):
    """``kvcodec bench concurrency`` on a tiny run: clients 1 and 2, two requests each, a 300-token
    context (one chunk reused): every answer equals the same request made alone."""
    cmd = [KVCODEC, "bench", "concurrency", "--engine", "transformers", "--home", str(tmp_path / "home"),
           "--model-cache", str(settings.model_cache), "--threads", "1", "--clients", "1,2", "--requests", "2",
           "--context-tokens", "300", "--contexts", "2", "--max-tokens", "4",
           "--json", str(tmp_path / "concurrency.json"), "--plot", str(tmp_path / "concurrency.png")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCODEC_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, \
        f"kvcodec bench concurrency failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    doc = json.loads((tmp_path / "concurrency.json").read_text())
    rows = {(r["clients"], r["mode"]): r for r in doc["rows"]}
    assert set(rows) == {(c, m) for c in (1, 2) for m in ("all", "reuse", "prefill")}
    assert all(r["engine"] == "transformers" and r["answers_match"] and r["errors"] == 0 for r in rows.values())
    assert rows[1, "all"]["requests"] == 2 and rows[2, "all"]["requests"] == 4
    assert rows[1, "all"]["speedup_vs_1"] == 1.0 and rows[2, "all"]["requests_per_s"] > 0
    assert rows[2, "reuse"]["reused_tokens_min"] == 256
    assert doc["engines"]["transformers"]["baseline"]["all"]["requests_per_s"] == rows[1, "all"]["requests_per_s"]
    assert (tmp_path / "concurrency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
