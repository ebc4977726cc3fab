"""``kvcodec eval-task`` (kvcodec_tools.quality.task): seeded samples with the needle where they say, scoring,
the Wilson interval, the lossless-in-accuracy rule, the chunk memo's counts, and the command's
arguments and JSON on a stand-in engine (bytes as tokens, KV a function of the tokens so far)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvcodec.engines import ModelCard
from kvcodec.errors import BadRequest, ConfigError
from kvcodec_tools import cli
from kvcodec_tools.quality.task import (
    ChunkMemo,
    PasskeyTask,
    TaskConfig,
    get_task,
    lossless_in_accuracy,
    run_task,
    wilson,
)

from .conftest import register_engine

torch.set_num_threads(1)

CARD = ModelCard(name="standin", model_id="standin@1", layers=2, kv_heads=1, head_dim=8, vocab_size=256,
                 max_context=4096, kv_dtype="float32")


def tokenize(text):
    return list(text.encode())


class StandInEngine:
    """Bytes are tokens; token j's KV is a function of the tokens up to j. It answers the pass key
    it reads in the prompt, but only on its own KV (within ``tolerance``): on other KV, 00000."""

    card = CARD
    model_id = CARD.model_id
    tolerance = 0.0

    @classmethod
    def model_card(cls, settings):
        return CARD

    @classmethod
    def from_settings(cls, settings):
        return cls()

    def __init__(self):
        self.prefills = 0

    tokenize = staticmethod(tokenize)

    @staticmethod
    def detokenize(ids):
        return bytes(ids).decode(errors="replace")

    @staticmethod
    def kv(ids):
        s = np.cumsum(np.asarray(ids, dtype=np.float64) * (np.arange(len(ids)) % 7 + 1)) % 9973
        grid = np.arange(1, CARD.layers * 2 * CARD.head_dim + 1, dtype=np.float64).reshape(CARD.layers, 2, 1, 1, -1)
        return np.sin(s[None, None, None, :, None] * grid * 1e-3).astype(np.float32)

    def prefill_chunks(self, ids, chunk_tokens):
        self.prefills += 1
        kv = self.kv(ids)
        for start in range(0, len(ids) - chunk_tokens + 1, chunk_tokens):
            yield kv[:, :, :, start:start + chunk_tokens]

    def stream(self, ids, max_tokens, past_kv=None):
        own = past_kv is None or float(np.max(np.abs(past_kv - self.kv(ids[:past_kv.shape[3]])))) <= self.tolerance
        text = self.detokenize(ids)
        key = text.split("The pass key is ", 1)[1][:5] if own else "00000"
        yield from tokenize(f" {key}.")[:max_tokens]


@pytest.fixture
def standin(monkeypatch):
    return register_engine(monkeypatch, "standin", StandInEngine)


def test_samples_are_seeded_and_the_needle_is_where_they_say():
    task = get_task("passkey")
    a = task.sample(tokenize, 1024, 0, 3)
    assert a == task.sample(tokenize, 1024, 0, 3)  # reproducible from (task, seed, index)
    assert a != task.sample(tokenize, 1024, 1, 3) and a != task.sample(tokenize, 1024, 0, 4)
    seen = set()
    for i in range(20):
        s = task.sample(tokenize, 1024, 0, i)
        assert len(s.context) == 1024 and len(s.answer) == 5 and s.answer.isdigit()
        assert s.context[s.needle_at:s.needle_at + len(s.needle)] == s.needle
        assert bytes(s.needle).decode() == f" The pass key is {s.answer}. Remember it. {s.answer} is the pass key."
        assert bytes(s.context).decode().count(s.answer) == 2  # once in the needle, twice there, nowhere else
        assert 0.0 <= s.depth <= 1.0 and s.prompt == s.context + s.question
        head = tokenize(PasskeyTask.head)
        assert s.context[:len(head)] == head
        assert s.context[:s.needle_at] == (head + tokenize(PasskeyTask.filler) * 40)[:s.needle_at]  # filler before
        seen.add(s.needle_at)
    assert len(seen) > 5  # the depth varies


def test_too_little_context_and_unknown_tasks_are_refused():
    with pytest.raises(BadRequest, match="no room for filler"):
        get_task("passkey").sample(tokenize, 200, 0, 0)
    with pytest.raises(ConfigError, match="task 'nope' is unknown"):
        get_task("nope")


@pytest.mark.parametrize("text,right", [
    (" 12345.", True), ("The pass key is 12345", True), (" 12345 is it, not 99999", True),
    (" 1234", False), (" 123456.", False), (" 99999. 12345", False), (" the pass key is", False), ("", False),
])
def test_score_is_the_first_number(text, right):
    assert PasskeyTask.score(text, "12345") is right


def test_wilson_interval():
    lo, hi = wilson(50, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    lo, hi = wilson(100, 100)
    assert lo == pytest.approx(0.9630, abs=1e-4) and hi == 1.0
    assert wilson(0, 10)[0] == 0.0 and wilson(0, 0) == (0.0, 1.0)
    lo, hi = wilson(9, 10)
    assert lo < 0.9 < hi


def test_lossless_in_accuracy_is_inside_prefills_interval():
    interval = wilson(90, 100)  # about 0.826 .. 0.945
    assert lossless_in_accuracy(0.90, interval) and lossless_in_accuracy(0.83, interval)
    assert not lossless_in_accuracy(0.80, interval)
    assert not lossless_in_accuracy(0.96, interval)  # outside either way
    assert lossless_in_accuracy(1.0, wilson(100, 100)) and not lossless_in_accuracy(0.95, wilson(100, 100))


def _shared_prefixes(samples, prefix, c):
    """(encodes, hits) a memo must see: one encode per distinct (chunk index, tokens up to its end)."""
    keys = [(j, tuple(s.context[:(j + 1) * c])) for s in samples for j in range(prefix // c)]
    return len(set(keys)), len(keys) - len(set(keys))


def test_run_task_memoizes_chunks_and_raw_is_prefill():
    engine = StandInEngine()
    config = TaskConfig(codecs=["raw", "int8-zstd"], samples=6, context_tokens=1024)
    result = run_task(engine, config, log=lambda m: None)
    assert engine.prefills == 6  # once per sample, for every rung
    samples = [get_task("passkey").sample(tokenize, 1024, 0, i) for i in range(6)]
    encodes, hits = _shared_prefixes(samples, 1024, 256)
    assert hits > 0
    for spec in ("raw", "int8-zstd"):
        r = result["codecs"][spec]
        assert (r["encodes"], r["memo_hits"]) == (encodes, hits)
        assert r["encodes_saved_share"] == round(hits / (encodes + hits), 4)
    assert result["memo"] == {"chunks": 2 * (encodes + hits), "encodes": 2 * encodes, "hits": 2 * hits,
                              "encodes_saved_share": round(hits / (encodes + hits), 4)}
    assert result["accuracy_prefill"] == 1.0 and result["prefill_interval95"][1] == 1.0
    raw = result["codecs"]["raw"]
    assert raw["accuracy_codec"] == 1.0 and raw["agree_with_prefill"] == 1.0 and raw["lossless_in_accuracy"]
    assert 0.45 < raw["ratio_vs_fp16"] < 0.5  # float32, the engine's own bytes (and a header, large on tiny KV)
    lossy = result["codecs"]["int8-zstd"]  # not the engine's bytes: the stand-in answers 00000
    assert lossy["accuracy_codec"] == 0.0 and lossy["lossless_in_accuracy"] is False
    assert lossy["ratio_vs_fp16"] > 1.5
    # the top-level keys are the first rung's
    assert (result["codec"], result["accuracy_codec"], result["lossless_in_accuracy"]) == ("raw", 1.0, True)
    assert [row["prefill"] for row in result["rows"]] == [True] * 6
    assert result["rows"][0]["int8-zstd_text"] == " 00000."


def test_memo_drops_the_least_recently_used():
    from kvcodec.format.auth import ChunkAuth
    from kvcodec.format.ladder import parse_rung

    memo = ChunkMemo(CARD.model_id, ChunkAuth.random(), max_entries=2)
    scheme = parse_rung("raw", CARD)
    kvs = [StandInEngine.kv(list(range(i, i + 256))) for i in range(3)]
    for kv in (kvs[0], kvs[1], kvs[0], kvs[2], kvs[1], kvs[0]):
        restored, nbytes = memo.roundtrip(scheme, kv, 0, 0)
        assert np.array_equal(restored, kv) and nbytes > kv.nbytes
    # 0 1 (0 hit) 2 (drops 1) 1 (encoded again, drops 0) 0 (encoded again)
    assert (memo.encodes[scheme.identity], memo.hits[scheme.identity]) == (5, 1)
    memo.close()


def test_run_task_refuses_bad_configs():
    with pytest.raises(BadRequest, match="at least one chunk"):
        run_task(StandInEngine(), TaskConfig(codecs=["raw"], samples=1, context_tokens=200), log=lambda m: None)
    with pytest.raises(ConfigError, match="named twice"):
        run_task(StandInEngine(), TaskConfig(codecs=["raw", "raw"], samples=1, context_tokens=512), log=lambda m: None)


def test_the_command_prints_one_json_object_and_writes_it(standin, tmp_path, capsys):
    out = tmp_path / "res" / "task.json"
    rc = cli.main(["eval-task", "--engine", standin, "--home", str(tmp_path), "--task", "passkey",
                   "--codec", "raw,int8-zstd", "--samples", "3", "--context-tokens", "700", "--json",
                   "--out", str(out)])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert {"accuracy_prefill", "accuracy_codec", "ratio_vs_fp16", "samples", "prefill_interval95",
            "lossless_in_accuracy", "task", "codec", "codec_id", "context_tokens", "seconds", "codecs",
            "memo"} <= set(printed)
    assert printed["samples"] == 3 and printed["context_tokens"] == 700 and printed["codec_prefix_tokens"] == 512
    assert list(printed["codecs"]) == ["raw", "int8-zstd"] and printed["codec"] == "raw"
    assert printed["accuracy_codec"] == printed["accuracy_prefill"] == 1.0


def test_the_command_prints_a_summary_without_json(standin, tmp_path, capsys):
    assert cli.main(["eval-task", "--engine", standin, "--home", str(tmp_path), "--codec", "raw", "--samples", "2",
                     "--context-tokens", "512"]) == 0
    text = capsys.readouterr().out
    assert "prefill 1.000" in text and "raw: 1.000" in text and "lossless in accuracy" in text
