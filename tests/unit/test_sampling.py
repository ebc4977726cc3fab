"""Sampling (``serving.sampling``, ``engines.torch_sampler``, ``serving.stops``): each field's effect on
the picked tokens, seeded draws that repeat, stop words cut out of streamed text, fields an engine
does not honour refused by name; and on the transformers engine (a tiny Llama, real weights' shape):
a seeded request gives the same tokens with and without reuse of its own KV."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvcodec.engines.torch_sampler import TokenPicker
from kvcodec.errors import BadRequest
from kvcodec.serving.sampling import GREEDY, Sampling
from kvcodec.serving.stops import StopText

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
V = 50


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def logits(*top, base: float = 0.0) -> torch.Tensor:
    """``V`` logits at ``base``, with ``top`` as (token, logit) pairs."""
    out = torch.full((V,), base)
    for token, value in top:
        out[token] = value
    return out


def picks(sampling: Sampling, n: int, row=None, prompt=(), end_id: int = 0, bad=()) -> list:
    picker = TokenPicker(sampling, prompt, end_id, bad, "cpu")
    return [picker.pick(row if row is not None else torch.linspace(0, 1, V)) for _ in range(n)]


# -- Sampling ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
                                          ("seed", -1), ("seed", 1 << 64), ("min_tokens", -2), ("end_id", -1),
                                          ("repetition_penalty", 0.0), ("presence_penalty", 2.5),
                                          ("frequency_penalty", -3.0)])
def test_a_value_out_of_range_is_refused_by_name(field, value):
    with pytest.raises(BadRequest, match=field):
        Sampling(**{field: value}).check()


def test_empty_or_too_many_words_are_refused():
    with pytest.raises(BadRequest, match="stop_words"):
        Sampling(stop_words=("",)).check()
    with pytest.raises(BadRequest, match="bad_words"):
        Sampling(bad_words=tuple("w%d" % i for i in range(65))).check()


def test_neutral_values_ask_for_nothing_and_an_engine_refuses_what_it_does_not_honour():
    assert GREEDY.asked() == [] and Sampling(presence_penalty=0.0, frequency_penalty=0.0, top_p=1.0).asked() == []
    Sampling(presence_penalty=0.0, temperature=0.0).refuse(frozenset(), "plain")  # the OpenAI frontend's zeros
    with pytest.raises(BadRequest, match="the plain engine does not honour temperature, bad_words"):
        Sampling(temperature=0.5, bad_words=("x",), seed=1).refuse(frozenset({"seed"}), "plain")
    assert Sampling(top_k=1, temperature=0.9).greedy and not Sampling(temperature=0.9).greedy


# -- the token picker -------------------------------------------------------------------------------
def test_greedy_is_the_argmax_and_temperature_zero_is_greedy_whatever_the_seed():
    row = logits((7, 5.0), (3, 4.9))
    assert picks(GREEDY, 3, row) == [7, 7, 7]
    assert picks(Sampling(temperature=0.0, seed=1, top_p=0.5), 3, row) == [7, 7, 7]


def test_a_seeded_draw_repeats_and_other_seeds_differ():
    row = torch.zeros(V)  # uniform: every token as likely
    one = picks(Sampling(temperature=1.0, seed=11), 40, row)
    assert one == picks(Sampling(temperature=1.0, seed=11), 40, row)
    assert one != picks(Sampling(temperature=1.0, seed=12), 40, row)
    assert len(set(one)) > 10  # a draw, not an argmax
    unseeded = [tuple(picks(Sampling(temperature=1.0), 20, row)) for _ in range(3)]
    assert len(set(unseeded)) == 3  # no seed: a fresh one each request


def test_top_k_and_top_p_keep_only_the_likeliest_tokens():
    row = logits((1, 3.0), (2, 2.9), (3, 2.8), base=-30.0)
    assert set(picks(Sampling(temperature=1.0, top_k=2, seed=3), 200, row)) == {1, 2}
    # top_p 0.5: token 1 alone is ~1/3 of the mass, 1 and 2 together pass 0.5: both kept, 3 never
    assert set(picks(Sampling(temperature=1.0, top_p=0.5, seed=3), 200, row)) == {1, 2}
    assert set(picks(Sampling(temperature=1.0, top_p=0.01, seed=3), 50, row)) == {1}  # the first always stays


def test_high_temperature_flattens_and_low_sharpens():
    row = logits((1, 2.0))
    hot = picks(Sampling(temperature=50.0, seed=5), 300, row)
    cold = picks(Sampling(temperature=0.05, seed=5), 300, row)
    assert cold.count(1) == 300 and hot.count(1) < 30


def test_min_tokens_holds_the_end_token_back():
    row = logits((0, 9.0), (4, 1.0))  # the end token (0) is the likeliest
    assert picks(GREEDY, 1, row) == [0]
    assert picks(Sampling(min_tokens=3), 4, row) == [4, 4, 4, 0]


def test_bad_words_are_never_generated_one_token_or_a_sequence():
    row = logits((5, 9.0), (6, 8.0), (7, 7.0))
    assert picks(Sampling(), 1, row, bad=[[5]]) == [6]
    picker = TokenPicker(GREEDY, (), 0, [[6, 5]], "cpu")  # "6 then 5" is bad: after a 6, 5 is masked
    stepped = [picker.pick(logits((6, 9.5), (5, 9.0))), picker.pick(logits((5, 9.0), (7, 8.0)))]
    assert stepped == [6, 7]


def test_penalties_move_the_pick_away_from_tokens_seen():
    row = logits((5, 2.0), (6, 1.9))
    assert picks(GREEDY, 1, row, prompt=[5]) == [5]
    assert picks(Sampling(repetition_penalty=1.5), 1, row, prompt=[5]) == [6]  # 2.0 / 1.5 < 1.9
    assert picks(Sampling(presence_penalty=0.5), 2, row) == [5, 6]  # 5 once said costs 0.5
    row = logits((5, 2.0), (6, 1.6))
    assert picks(Sampling(frequency_penalty=0.25), 3, row) == [5, 5, 6]  # 2.0 - 0.25 * 2 < 1.6


# -- stop words -------------------------------------------------------------------------------------
def test_stop_text_holds_back_what_may_start_a_stop_word_and_cuts_before_it():
    stops = StopText(["\n\n", "END"])
    sent = [stops.push(piece) for piece in ["Hello", " E", "N", "ding", " wor", "ld\n", "\nmore"]]
    assert sent == ["Hello", " ", "", "ENding", " wor", "ld", ""] and stops.stopped
    assert stops.push("after") == "" and stops.flush() == ""
    plain = StopText(["STOP"])
    assert [plain.push(p) for p in ["a S", "T", "x"]] == ["a ", "", "STx"] and plain.flush() == ""
    tail = StopText(["STOP"])
    assert tail.push("ends ST") == "ends " and tail.flush() == "ST" and not tail.stopped
    assert StopText([]).push("anything") == "anything"


def test_the_earliest_stop_word_wins():
    stops = StopText(["b", "ab"])
    assert stops.push("xxab") == "xx" and stops.stopped


# -- on the transformers engine -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from kvcodec.engines import open_engine
    from kvcodec.engines.gguf import ensure_model
    from kvcodec.settings import Settings
    from tests.other_model import write_model

    tmp = tmp_path_factory.mktemp("sampling")
    folder = write_model(tmp / "tiny-llama", ensure_model(REPO / ".cache" / "models").path)
    settings = Settings.load({"model": str(folder), "model_cache": str(tmp / "cache"), "home": str(tmp / "home"),
                              "threads": "1", "writeback": "off"}, env={})
    eng = open_engine(settings)
    yield eng
    eng.close()


def test_a_seeded_request_gives_the_same_tokens_with_and_without_reuse(engine):
    ids = engine.tokenize("def f(x):\n    return x * 2\n" * 60)[:300]
    kv = next(engine.prefill_chunks(ids, 256))  # the engine's own KV (what the raw rung restores)
    sampled = Sampling(temperature=1.0, top_p=0.95, seed=1234)
    fresh = list(engine.stream(ids, 16, sampling=sampled))
    reused = list(engine.stream(ids, 16, past_kv=kv, sampling=sampled))
    assert fresh == reused == list(engine.stream(ids, 16, sampling=sampled))  # and run to run
    others = {tuple(engine.stream(ids, 16, sampling=Sampling(temperature=1.0, seed=s))) for s in range(4)}
    assert len(others) > 1  # the seed matters: a draw, not greedy
    assert fresh != list(engine.stream(ids, 16))


def test_stop_words_end_the_answer_for_every_engine_through_generate(engine):
    from kvcodec.serving.assemble import Assembled
    from kvcodec.serving.generate import generate

    ids = engine.tokenize("def f(x):\n    return x * 2\n" * 20)
    none = Assembled(None, [], 0)
    whole = "".join(e.text for e in generate(engine, ids, 24, none))
    assert len(whole) > 6
    word = whole[3:6]
    events = list(generate(engine, ids, 24, none, Sampling(stop_words=(word,))))
    assert "".join(e.text for e in events) == whole[:whole.index(word)]
    assert events[-1].final and len(events) < 24
    with pytest.raises(BadRequest, match="min_tokens"):
        next(generate(type("Plain", (), {"name": "plain", "sampling_fields": frozenset()})(), ids, 4, none,
                      Sampling(min_tokens=2)))


def test_the_engine_honours_end_id_and_bad_words(engine):
    ids = engine.tokenize("def f(x):\n    return x * 2\n" * 20)
    greedy = list(engine.stream(ids, 8))
    i = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])  # a token said first at i
    assert list(engine.stream(ids, 8, sampling=Sampling(end_id=greedy[i]))) == greedy[:i + 1]
    said = next(t for t in greedy if engine.tokenizer.decode([t]).strip())  # a word, not blank
    assert said not in list(engine.stream(ids, 8, sampling=Sampling(bad_words=(engine.tokenizer.decode([said]),))))
