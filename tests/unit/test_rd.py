"""``kvcodec rd``'s bookkeeping (kvcodec_tools.quality.rd): the per-setting summary, the quality gate, the
best passing setting per codec; and the eval set it runs over (kvcodec_tools.quality.evalset)."""
from __future__ import annotations

import pytest

from kvcodec.errors import ConfigError
from kvcodec_tools.quality import evalset
from kvcodec_tools.quality.rd import DEFAULT_SETTINGS, best_passing, headline, match_task, plot, summarise


def _row(text, setting, kl, top1, greedy, fp16=1000, stored=250):
    return {"text": text, "setting": setting, "mean_kl": kl, "top1_agreement": top1, "greedy_match_tokens": greedy,
            "greedy_tokens": 32, "fp16_bytes": fp16, "stored_bytes": stored, "encode_s": 0.5, "decode_s": 0.25}


ROWS = [
    _row("a", "raw", 0.0, 1.0, 32, stored=1000), _row("b", "raw", 0.0, 1.0, 32, stored=1000),
    _row("a", "lossless8", 1e-4, 1.0, 32, stored=500), _row("b", "lossless8", 2e-4, 0.98, 17, stored=500),
    _row("a", "nlevel-zstd:32", 0.008, 0.97, 5, stored=300), _row("b", "nlevel-zstd:32", 0.013, 0.96, 3, stored=300),
    _row("a", "nlevel-zstd:48", 0.004, 0.97, 9, stored=330), _row("b", "nlevel-zstd:48", 0.005, 0.96, 9, stored=340),
    _row("a", "transform-zstd:160", 0.006, 0.96, 8, stored=260), _row("b", "transform-zstd:160", 0.006, 0.93, 8, stored=260),
    _row("a", "transform-zstd:120", 0.003, 0.97, 8, stored=290), _row("b", "transform-zstd:120", 0.003, 0.96, 8, stored=290),
]
SETTINGS = ["raw", "lossless8", "nlevel-zstd:32", "nlevel-zstd:48", "transform-zstd:120", "transform-zstd:160"]


def test_summary_aggregates_over_texts():
    by = {s["setting"]: s for s in summarise(ROWS, SETTINGS)}
    assert list(by) == SETTINGS
    s = by["nlevel-zstd:48"]
    assert (s["codec"], s["quality"], s["texts"]) == ("nlevel-zstd", 48, 2)
    assert s["ratio_vs_fp16"] == round(2000 / 670, 4)  # total bytes over total bytes, not a mean of ratios
    assert s["mean_kl"] == 0.0045 and s["max_kl"] == 0.005 and s["top1_agreement"] == 0.965
    assert s["greedy_min"] == 9 and s["encode_s"] == 1.0 and s["decode_s"] == 0.5


def test_the_gate():
    by = {s["setting"]: s for s in summarise(ROWS, SETTINGS)}
    assert by["raw"]["gate"] is True and by["raw"]["gate_kind"] == "exact"  # 32 of 32 greedy tokens
    assert by["lossless8"]["gate_kind"] == "task"
    assert by["lossless8"]["gate"] is False  # no task result: not shown lossless in accuracy
    assert by["nlevel-zstd:32"]["mean_kl"] == 0.0105 and by["nlevel-zstd:32"]["gate"] is False  # KL over 0.01
    assert by["nlevel-zstd:48"]["gate"] is True
    assert by["transform-zstd:160"]["top1_agreement"] == 0.945
    assert by["transform-zstd:160"]["gate"] is False  # KL passes, top-1 under the 0.95 floor
    assert by["transform-zstd:120"]["gate"] is True


def test_best_passing_is_the_highest_ratio_that_passes_per_codec():
    best = best_passing(summarise(ROWS, SETTINGS))
    assert set(best) == {"raw", "nlevel-zstd", "transform-zstd"}  # no lossless8: it failed
    assert best["transform-zstd"]["setting"] == "transform-zstd:120"
    assert best["nlevel-zstd"]["setting"] == "nlevel-zstd:48"


def _task_entry(codec_id, correct, lossless):
    return {"codec_id": codec_id, "accuracy_codec": correct / 100, "interval95": [0.9, 0.99],
            "lossless_in_accuracy": lossless}


def test_task_gate_for_lossless8_and_task_figures_for_every_measured_rung():
    task = {"codecs": {"lossless8": _task_entry("id-l8", 97, True), "transform-zstd": _task_entry("id-t160", 91, False),
                       "other": _task_entry("id-unused", 50, False)}}
    matched = match_task(task, {"lossless8": "id-l8", "transform-zstd:160": "id-t160", "raw": "id-raw"})
    assert set(matched) == {"lossless8", "transform-zstd:160"}  # matched on identity, not on the spec
    by = {s["setting"]: s for s in summarise(ROWS, SETTINGS, matched)}
    assert by["lossless8"]["greedy_min"] == 17 and by["lossless8"]["gate"] is True  # the task decides
    assert by["lossless8"]["task_accuracy"] == 0.97 and by["lossless8"]["task_interval95"] == [0.9, 0.99]
    t = by["transform-zstd:160"]
    assert t["lossless_in_accuracy"] is False and t["gate_kind"] == "kl_top1" and t["gate"] is False
    assert "task_accuracy" not in by["raw"]
    assert summarise(ROWS, SETTINGS, {"lossless8": _task_entry("id-l8", 80, False)})[1]["gate"] is False


def test_headline_compares_the_best_passing_video_with_the_best_entropy_coded():
    rows = ROWS + [_row("a", "video:13", 0.007, 0.96, 8, stored=180), _row("b", "video:13", 0.008, 0.96, 8, stored=180),
                   _row("a", "video:15", 0.02, 0.9, 8, stored=150), _row("b", "video:15", 0.02, 0.9, 8, stored=150)]
    settings = SETTINGS + ["video:13", "video:15"]
    task = {"transform-zstd:120": _task_entry("x", 96, True), "nlevel-zstd:48": _task_entry("y", 97, True)}
    h = headline(summarise(rows, settings, task), video=["video:13", "video:15", "lossless8"])
    assert h["video"]["setting"] == "video:13"  # video:15 fails the gate
    assert h["entropy_coded"]["setting"] == "transform-zstd:120"  # raw is not a compression rung
    assert h["video_vs_entropy"] == round((2000 / 360) / (2000 / 580), 3)
    assert h["lossless_in_accuracy"]["setting"] == "transform-zstd:120" and h["lossless_in_accuracy"]["task_accuracy"] == 0.96
    assert headline(summarise(ROWS[:2], ["raw"]), video=[])["video_vs_entropy"] is None


def test_plot_is_a_png(tmp_path):
    path = tmp_path / "rd.png"
    plot(summarise(ROWS, SETTINGS), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_settings_cover_every_codec_of_the_issue():
    codecs = {s.split(":")[0] for s in DEFAULT_SETTINGS}
    assert {"raw", "lossless8", "int8-zstd", "nlevel-zstd", "transform-zstd", "cachegen", "video"} <= codecs


def test_eval_set_is_real_text_kept_apart_from_the_fit_set():
    assert len(evalset.EVAL_SET) >= 20
    kinds = [t.kind for t in evalset.EVAL_SET]
    assert kinds.count("code") >= 10 and kinds.count("prose") >= 8
    assert not {t.path for t in evalset.EVAL_SET} & {t.path for t in evalset.FIT_SET}
    for t in evalset.EVAL_SET + evalset.FIT_SET:
        assert t.path.is_file(), t


def test_load_cuts_and_refuses_short_texts():
    tokenize = lambda s: list(s.encode())  # noqa: E731  (one token per byte)
    (text, ids), = evalset.load(evalset.EVAL_SET[:1], tokenize, 100)
    assert len(ids) == 100
    with pytest.raises(ConfigError, match="fewer than"):
        evalset.load(evalset.EVAL_SET[:1], lambda s: [1, 2, 3], 100)
