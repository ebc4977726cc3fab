"""``kvcodec eval-task`` on the real model: passkey retrieval with prefill's KV and with ``raw``'s
(the engine's own bytes: the very same answers)."""
from __future__ import annotations

import json

import pytest

from .conftest import cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_eval_task_raw_answers_as_prefill(settings, tmp_path):
    out = tmp_path / "task.json"
    printed = json.loads(cli(settings, "eval-task", "--task", "passkey", "--codec", "raw", "--samples", "3",
                             "--context-tokens", "512", "--json", "--out", str(out)).stdout)
    assert printed == json.loads(out.read_text())
    assert printed["samples"] == 3 and printed["codec"] == "raw" and printed["codec_prefix_tokens"] == 512
    assert printed["accuracy_prefill"] >= 2 / 3  # the 135M model finds the pass key at this length
    raw = printed["codecs"]["raw"]
    assert raw["accuracy_codec"] == printed["accuracy_prefill"] and raw["agree_with_prefill"] == 1.0
    assert raw["lossless_in_accuracy"] is True and 0.49 < raw["ratio_vs_fp16"] <= 0.5
    assert all(row["raw"] == row["prefill"] for row in printed["rows"])
