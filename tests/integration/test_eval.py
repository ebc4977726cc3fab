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
    assert 0.99 < raw["ratio_vs_fp16"] <= 1.0  # fp16 bytes plus a small header
    assert raw["top1_agreement"] == 1.0 and raw["mean_kl"] < 1e-4 and raw["greedy_match_tokens"] == 32
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
