"""``kvcodec eval`` on the real model: the quality harness of the layout work."""
from __future__ import annotations

import json

import pytest

from .conftest import cli, text_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
KEYS = {"ratio_vs_fp16", "top1_agreement", "mean_kl", "greedy_match_tokens", "encode_s", "decode_s"}


@pytest.fixture(scope="module")
def text_file(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "text.txt"
    path.write_text(text_of(tokenizer, "heapq.py", 300))
    return path


def _eval(settings, text_file, codec, *extra):
    out = cli(settings, "eval", "--text-file", str(text_file), "--prefix-tokens", "256",
              "--continuation-tokens", "32", "--codec", codec, "--json", *extra).stdout
    return json.loads(out)


def test_eval_raw_and_lossless8(settings, text_file):
    raw = _eval(settings, text_file, "raw")
    assert set(raw) >= KEYS
    assert 0.49 < raw["ratio_vs_fp16"] <= 0.5  # the engine's float32 bytes (2x fp16) plus a small header
    # the engine's own KV, bit for bit: the very same logits
    assert raw["top1_agreement"] == 1.0 and raw["mean_kl"] == 0.0 and raw["greedy_match_tokens"] == 32
    lossless = _eval(settings, text_file, "lossless8")
    assert lossless["ratio_vs_fp16"] > 1.5
    assert lossless["mean_kl"] > raw["mean_kl"] and lossless["mean_kl"] < 0.01
    assert lossless["top1_agreement"] >= 0.9 and lossless["encode_s"] > 0 and lossless["decode_s"] > 0


def test_eval_quality_setting_trades_size_for_fidelity(settings, text_file):
    fine = _eval(settings, text_file, "video", "--quality", "8")
    coarse = _eval(settings, text_file, "video", "--quality", "30")
    assert coarse["ratio_vs_fp16"] > fine["ratio_vs_fp16"]
    assert coarse["mean_kl"] > fine["mean_kl"]


def test_eval_refuses_a_prefix_that_is_not_whole_chunks(settings, text_file):
    import subprocess

    from .conftest import KVCODEC

    proc = subprocess.run([KVCODEC, "eval", "--model-cache", str(settings.model_cache), "--text-file",
                           str(text_file), "--prefix-tokens", "100", "--codec", "raw"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "prefix_tokens must be a positive multiple of 256, got 100" in proc.stderr


def test_eval_transform_zstd_beats_8_bit_at_small_loss(settings, text_file):
    int8 = _eval(settings, text_file, "int8-zstd")
    pca = _eval(settings, text_file, "transform-zstd")  # the shipped SmolLM2 codec profile
    assert set(pca) >= KEYS
    assert pca["ratio_vs_fp16"] > 1.4 * int8["ratio_vs_fp16"]
    assert pca["mean_kl"] < 0.03 and pca["top1_agreement"] >= 0.85
    finer = _eval(settings, text_file, "transform-zstd", "--quality", "60")
    assert finer["mean_kl"] < pca["mean_kl"] and finer["ratio_vs_fp16"] < pca["ratio_vs_fp16"]


def test_rd_on_one_text_writes_the_summary_and_the_plot(settings, tmp_path):
    from kvcodec.engines import model_card
    from kvcodec.format.ladder import parse_rung

    out, png, task = tmp_path / "rd.json", tmp_path / "rd.png", tmp_path / "task.json"
    # an eval-task result naming the rung by its default spec: rd matches it on the scheme's identity
    int8_id = parse_rung("int8-zstd", model_card(settings)).identity
    task.write_text(json.dumps({"task": "passkey", "samples": 100, "accuracy_prefill": 0.98, "codecs": {"int8-zstd": {
        "codec_id": int8_id, "accuracy_codec": 0.97, "interval95": [0.91, 0.99], "lossless_in_accuracy": True}}}))
    cli(settings, "rd", "--texts", "1", "--workers", "1", "--prefix-tokens", "256", "--continuation-tokens", "16",
        "--settings", "raw,int8-zstd,transform-zstd:160", "--json", str(out), "--plot", str(png),
        "--task-json", str(task))
    doc = json.loads(out.read_text())
    assert doc["task"]["accuracy_prefill"] == 0.98 and doc["task"]["samples"] == 100
    assert [s["setting"] for s in doc["summary"]] == ["raw", "int8-zstd", "transform-zstd:160"]
    by = {s["setting"]: s for s in doc["summary"]}
    assert by["raw"]["gate"] is True and by["raw"]["greedy_min"] == 32 and by["raw"]["mean_kl"] == 0.0
    assert by["transform-zstd:160"]["ratio_vs_fp16"] > by["int8-zstd"]["ratio_vs_fp16"] > by["raw"]["ratio_vs_fp16"]
    assert all(s["decode_mb_s"] > 0 for s in doc["summary"])
    assert by["int8-zstd"]["task_accuracy"] == 0.97 and by["int8-zstd"]["lossless_in_accuracy"] is True
    assert "task_accuracy" not in by["transform-zstd:160"]
    assert doc["headline"]["entropy_coded"]["setting"] in ("int8-zstd", "transform-zstd:160")
    assert doc["headline"]["lossless_in_accuracy"]["setting"] == "int8-zstd" and doc["headline"]["video"] is None
    assert len(doc["rows"]) == 3 and doc["config"]["texts"] == ["py:argparse.py"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
