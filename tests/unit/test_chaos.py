"""The pure parts of ``kvcodec soak --chaos`` (``kvcodec_tools.chaos_plan``, ``chaos.resource_growth``,
``chaos.summarize``): the fault schedule, the prompt mix, answers against references, the TTFT
bound, reuse coming back, and resource flatness. The run itself, with real servers, a real store and
real faults, is tests/integration/test_chaos.py."""
from __future__ import annotations

from collections import Counter

import pytest

from kvcodec_tools.chaos import ChaosConfig
from kvcodec_tools.chaos_faults import FaultRecord
from kvcodec_tools.chaos_plan import (
    KINDS,
    SETTLE_S,
    STORE_KINDS,
    TARGET,
    Answer,
    check,
    expected,
    mix,
    reuse_back,
    reuse_not_back,
    schedule,
    ttft_bounds,
)
from kvcodec_tools.chaos_verdict import resource_growth, summarize


def test_the_schedule_is_seeded_covers_every_kind_and_keeps_each_target_to_one_fault():
    kinds = STORE_KINDS["nginx"]
    plan = schedule(kinds, 1800, seed=3, mean_gap_s=20)
    assert plan == schedule(kinds, 1800, seed=3, mean_gap_s=20) != schedule(kinds, 1800, seed=4, mean_gap_s=20)
    assert set(f.kind for f in plan) == set(kinds)
    assert all(15 <= f.at_s and f.at_s + f.hold_s < 1800 - 20 for f in plan)
    assert [f.at_s for f in plan] == sorted(f.at_s for f in plan)
    by_target = {}
    for f in plan:
        by_target.setdefault(f.target, []).append(f)
    for target, faults in by_target.items():  # one at a time on a target, rested in between
        for a, b in zip(faults, faults[1:], strict=False):
            assert b.at_s >= a.at_s + a.hold_s + SETTLE_S[target] - 0.11, (target, a, b)
    # faults on different targets do overlap
    overlaps = sum(1 for a in plan for b in plan if a.target != b.target and a.at_s < b.at_s < a.at_s + a.hold_s)
    assert overlaps > 0
    # stub kills stay within the watchdog's storm guard: at most 5 restarts in any 300 s
    kills = [f.at_s for f in plan if f.kind == "stub-kill"]
    assert all(sum(1 for t in kills if s <= t < s + 300) <= 4 for s in kills)


def test_schedule_refuses_unknown_kinds_and_bad_gaps():
    with pytest.raises(ValueError, match="unknown fault kind"):
        schedule(["store-kill", "meteor"], 100, 0, 10)
    with pytest.raises(ValueError, match="mean_gap_s"):
        schedule(["store-kill"], 100, 0, 0)
    assert schedule(["store-kill"], 30, 0, 5) == []  # no room before the end margin


def test_every_store_allows_kinds_that_exist_and_targets_are_known():
    assert set(TARGET) == set(KINDS)
    for kinds in STORE_KINDS.values():
        assert set(kinds) <= set(KINDS)
    assert "failover" in STORE_KINDS["redis-cluster"] and "trickle" not in STORE_KINDS["redis-cluster"]
    assert "disk-full" in STORE_KINDS["nginx"] and "disk-full" not in STORE_KINDS["s3"]


def test_the_mix_interleaves_every_kind_reuse_and_prefill_twice():
    cycle = mix({"reuse": 2, "decoded": 2, "partial": 2, "writeback": 2, "miss": 2, "prefill": 2})
    counts = Counter(kind for kind, _ in cycle)
    assert counts["reuse"] == counts["prefill"] == 4 and counts["miss"] == counts["decoded"] == 2
    assert {(k, i) for k, i in cycle} >= {(k, i) for k in counts for i in (0, 1)}
    assert cycle[:3] == [("reuse", 0), ("reuse", 1), ("decoded", 0)]


REFS = {("reuse0", -1): [1, 2], ("decoded0", 0): [1, 2], ("decoded0", 256): [1, 3], ("decoded0", 512): [4, 4]}


def test_an_answer_is_checked_against_the_reference_with_the_same_reuse():
    assert expected(REFS, "reuse0", 512) == [1, 2]  # a lossless rung: prefill's answer at any reuse
    assert expected(REFS, "decoded0", 256) == [1, 3] and expected(REFS, "decoded0", 768) is None
    ok = Answer(0, "decoded", "decoded0", 0, 1, 0.5, 256, [1, 3])
    assert check(ok, REFS) == "ok"
    assert check(Answer(0, "decoded", "decoded0", 0, 1, 0.5, 512, [1, 3]), REFS) == "wrong"
    # prefill's answer is right at any reuse (a raw copy written back after a miss gives it)
    assert check(Answer(0, "decoded", "decoded0", 0, 1, 0.5, 512, [1, 2]), REFS) == "ok"
    assert check(Answer(0, "reuse", "reuse0", 0, 1, 0.5, 512, [1, 2]), REFS) == "ok"
    assert check(Answer(0, "reuse", "reuse0", 0, 1, 0.5, 0, [2, 2]), REFS) == "wrong"
    assert check(Answer(0, "reuse", "reuse0", 0, 1, error="ClientError: gone"), REFS) == "lost"
    assert check(Answer(0, "decoded", "decoded0", 0, 1, 0.5, 768, [9]), REFS) == "unchecked"


def answer(kind, start, ttft, prompt=None, reused=0, **kw):
    return Answer(0, kind, prompt or f"{kind}0", start, start + ttft + 1, ttft, reused, [1], **kw)


def test_the_ttft_bound_is_prefill_under_the_same_load_plus_the_prompts_prefill():
    answers = [answer("prefill", 0, 2.0), answer("prefill", 10, 4.0), answer("prefill", 200, 10.0),
               answer("reuse", 5, 1.0), answer("reuse", 205, 1.0), answer("decoded", 6, 30.0),
               answer("partial", 8, 9.0)]
    bounds = ttft_bounds(answers, {"reuse0": 1.5, "partial0": 3.0}, window_s=60)
    assert set(bounds) == {3, 4, 5, 6}  # the control is not bounded
    assert bounds[3] == pytest.approx(3.0 + 2.0)  # median(2, 4) + max(2 s, 1.5 s)
    assert bounds[4] == pytest.approx(10.0 + 2.0)  # only the control near it
    assert bounds[6] == pytest.approx(3.0 + 3.0)
    assert [i for i, b in bounds.items() if answers[i].ttft_s > b] == [5, 6]
    assert ttft_bounds([answer("reuse", 0, 1.0)], {}) == {}  # no control, no bound


def test_reuse_back_is_the_first_whole_reuse_after_the_heal():
    answers = [answer("reuse", 10, 1.0, reused=512), answer("reuse", 21, 1.0, reused=0),
               answer("partial", 22, 1.0, reused=256), answer("reuse", 25, 1.0, reused=256),
               answer("reuse", 30, 1.0, reused=512)]
    full = {"reuse0": 512}
    assert reuse_back(answers, 20.0, full) == pytest.approx(32.0 - 20.0)  # ends at 30 + 1 + 1
    assert reuse_back(answers, 31.0, full) is None
    assert reuse_back(answers, None, full) is None


def test_a_fault_healed_after_the_last_reuse_request_is_not_counted_as_reuse_not_back():
    answers = [answer("reuse", 10, 1.0, reused=0), answer("prefill", 40, 1.0)]
    faults = [{"healed_s": 5.0, "reuse_back_s": None},  # a reuse request came after, reused nothing
              {"healed_s": 30.0, "reuse_back_s": None},  # only a prefill after it: not observed
              {"healed_s": 2.0, "reuse_back_s": 1.0}, {"healed_s": None, "reuse_back_s": None}]
    assert reuse_not_back(answers, faults) == (1, 1)


def sample(t, server, rss, fds=90, sockets=30, threads=200, processes=6, ready=True):
    return {"t_s": t, "server": server, "rss_bytes": rss, "fds": fds, "sockets": sockets, "threads": threads,
            "processes": processes, "ready": ready}


def test_resources_are_flat_unless_they_grow_past_the_limits_restarts_left_out():
    flat = [sample(t, 0, 1000 << 20) for t in range(0, 200, 5)]
    # a restart mid-way: not ready, fewer processes, little RSS; left out
    flat += [sample(t, 1, 1000 << 20) for t in range(0, 200, 5) if not 90 <= t < 110]
    flat += [sample(t, 1, 100 << 20, processes=2, ready=t > 100) for t in range(90, 110, 5)]
    out = resource_growth(flat, 2, warmup_s=20, window_s=40)
    assert out[0]["flat"] and out[1]["flat"], out
    assert out[1]["usual_processes"] == 6 and out[1]["samples_whole"] < out[0]["samples_whole"]
    leaking = [sample(t, 0, (1000 + 2 * t) << 20, fds=90 + t // 2) for t in range(0, 200, 5)]
    out = resource_growth(leaking, 1, warmup_s=20, window_s=40)[0]
    assert not out["flat"] and any(w.startswith("RSS rose") for w in out["not_flat"]) \
        and any(w.startswith("fds rose") for w in out["not_flat"])
    # a server restarted mid-run warms up again to the level it had reached before: not a leak,
    # though its last window is well above its first (the restart's dip fell in the first window)
    rewarm = [sample(t, 0, (700 if 20 <= t < 60 else 1000) << 20) for t in range(0, 200, 5)]
    out = resource_growth(rewarm, 1, warmup_s=20, window_s=40)[0]
    assert out["flat"] and out["above_high_water"]["rss_bytes"] == 0, out
    assert out["growth"]["rss_bytes"] == 300 << 20  # what a last-minus-first rule would call a leak
    assert not resource_growth(flat[:3], 1, 20, 40)[0]["flat"]  # too short for both windows


def test_summarize_counts_what_the_issue_asks_for():
    config = ChaosConfig(servers=1, clients=2, duration_s=200, faults=("store-kill",), warmup_s=20, window_s=40)
    answers = [answer("prefill", 1, 2.0, verdict="ok"), answer("reuse", 2, 9.0, reused=512, verdict="ok"),
               answer("reuse", 3, 1.0, verdict="lost", error="gone"), answer("partial", 4, 1.0, verdict="wrong")]
    doc = {"answers": answers, "alone": {"reuse0": 1.0}, "faults": [FaultRecord("store-kill", 5, 12, 7.0, "", 3.0)],
           "samples": [sample(t, 0, 1 << 30) for t in range(0, 200, 5)], "wall_s": 201.0, "corrupt": 0, "stored": 9,
           "verify_errors": [], "restarts": [0], "churn_errors": 2, "reference_failures": [], "prompt_tokens": {},
           "full": {"reuse0": 512}}
    out = summarize(doc, config)
    for key in ("duration_s", "servers", "clients", "requests", "wrong_answers", "lost_requests",
                "corrupt_chunks_stored", "over_bound", "faults"):
        assert key in out
    assert (out["requests"], out["wrong_answers"], out["lost_requests"], out["over_bound"]) == (4, 1, 1, 1)
    assert out["faults"] == [{"kind": "store-kill", "at_s": 5, "healed_s": 12, "hold_s": 7.0, "detail": "",
                              "reuse_back_s": 3.0}]
    assert out["resources"]["flat"] and out["faults_unhealed"] == 0


def test_the_config_refuses_what_a_store_cannot_do():
    with pytest.raises(ValueError, match="not with store s3"):
        ChaosConfig(store="s3", faults=("disk-full",))
    with pytest.raises(ValueError, match="chaos-store"):
        ChaosConfig(store="tape")
    assert "failover" in ChaosConfig(store="redis-cluster").faults
