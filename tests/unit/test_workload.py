"""The peers' workloads (``kvcodec bench workload``): LMCache's long-document QA and multi-round QA
prompts, repeat modes, hit:miss mixing, arrival schedule, the row's figures and file, and the
runner against a small fake OpenAI / Triton generate_stream server on loopback (streamed answers,
in-flight bound, reference requests salted or with reuse off, a wrong answer counted)."""
from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvcodec_tools.workload import (
    QUESTION,
    LongDocConfig,
    MultiRoundConfig,
    Record,
    arrival_schedule,
    conversation_prompt,
    documents,
    make_row,
    merge_rows,
    miss_positions,
    plot,
    query_round,
    repeat_prompts,
    system_prompt,
    ttft_gain,
    user_gaps,
)
from kvcodec_tools.workload_run import EnsembleTarget, OpenAITarget, check_loopback, run_long_doc_qa, run_multi_round


class Words:
    """A tokenizer whose tokens are words."""

    def encode(self, text):
        return text.split()


def test_documents_are_distinct_long_enough_and_none_a_prefix_of_another():
    docs = documents(Words(), 14, 300)  # more documents than sources: they wrap and stay distinct
    assert len(set(docs)) == 14
    for i, d in enumerate(docs):
        assert d.startswith(f"Document {i}.\n") and d.endswith(QUESTION)
        assert 300 <= len(d.split()) < 400
        assert not any(o != d and o.startswith(d[:-len(QUESTION)]) for o in docs)
    assert len(documents(Words(), 1, 5000)[0].split()) >= 5000  # longer than one module: the next follows


def test_repeat_modes_are_lmcaches():
    rng = random.Random(0)
    assert repeat_prompts([1, 2, 3], 2, "tile", rng) == [1, 2, 3, 1, 2, 3]
    assert repeat_prompts([1, 2, 3], 2, "interleave", rng) == [1, 1, 2, 2, 3, 3]
    shuffled = repeat_prompts(list(range(10)), 3, "random", random.Random(7))
    assert sorted(shuffled) == sorted(list(range(10)) * 3) and shuffled != list(range(10)) * 3
    assert shuffled == repeat_prompts(list(range(10)), 3, "random", random.Random(7))  # the seed decides
    with pytest.raises(ValueError, match="repeat_mode"):
        repeat_prompts([1], 2, "zigzag", rng)


def test_hit_miss_marks_every_request_past_h_in_each_group_of_h_plus_m():
    assert miss_positions(8, "3:1") == [False, False, False, True] * 2
    assert miss_positions(6, "2:2") == [False, False, True, True, False, False]
    assert miss_positions(3, "0:1") == [True] * 3
    assert miss_positions(3, None) == [False] * 3
    for bad in ("3", "a:b", "0:0", "-1:2"):
        with pytest.raises(ValueError, match="hit_miss"):
            miss_positions(4, bad)


def test_query_round_repeats_and_mixes_in_misses_that_share_no_prefix():
    prompts = ["doc zero", "doc one", "doc two"]
    config = LongDocConfig(documents=3, document_tokens=10, repeat_count=2, repeat_mode="tile", hit_miss="1:1")
    queries = query_round(prompts, config)
    assert [q.doc for q in queries] == [0, 1, 2, 0, 1, 2]
    assert [q.miss for q in queries] == [False, True] * 3
    for q in queries:
        if q.miss:
            number, _, rest = q.prompt.partition(" ")
            assert rest == prompts[q.doc] and int(number) == int(number)  # a number before it: no shared prefix
        else:
            assert q.prompt == prompts[q.doc]
    assert query_round(prompts, config) == queries  # seeded: the same round every run


def test_configs_refuse_bad_knobs():
    with pytest.raises(ValueError, match="inflight"):
        LongDocConfig(inflight=0)
    with pytest.raises(ValueError, match="repeat_mode"):
        LongDocConfig(repeat_mode="x")
    with pytest.raises(ValueError, match="requests"):
        LongDocConfig(documents=5000, repeat_count=2)
    with pytest.raises(ValueError, match="qps"):
        MultiRoundConfig(qps=0)


def test_arrival_schedule_is_lmcaches_user_session_manager():
    config = MultiRoundConfig(users=3, rounds=3, system_tokens=0, answer_tokens=4, qps=1.0)
    per_user, joining = user_gaps(config)
    assert (per_user, joining) == (3.0, 2.0)  # users / qps; per_user * (rounds - 1) / users
    schedule = arrival_schedule(config)
    assert len(schedule) == 9 and schedule == sorted(schedule)
    assert {(u, k): t for t, u, k in schedule} == {(u, k): 2.0 * u + 3.0 * (k - 1) for u in range(3)
                                                    for k in (1, 2, 3)}
    later = arrival_schedule(config, first_turn=2)  # after a restart: turns 2.. from the phase's start
    assert {(u, k): t for t, u, k in later} == {(u, k): 2.0 * u + 3.0 * (k - 2) for u in range(3) for k in (2, 3)}
    with pytest.raises(ValueError):
        arrival_schedule(config, first_turn=4)


def test_each_turn_extends_the_previous_turns_prompt():
    system = system_prompt(Words(), 200)
    assert len(system.split()) >= 200
    turn1 = conversation_prompt(system, "For user 0\n", [])
    turn2 = conversation_prompt(system, "For user 0\n", [" a story."])
    turn3 = conversation_prompt(system, "For user 0\n", [" a story.", " another."])
    assert turn1.startswith(system) and turn2.startswith(turn1) and turn3.startswith(turn2 + " another.")
    assert "question #3" in turn3 and turn3.endswith("Assistant:")


def _rec(round_, ttft, start=0.0, end=1.0, equal=True, turn=None):
    return Record(round=round_, start_s=start, ttft_s=ttft, end_s=end, equal=equal, turn=turn, doc=0)


def test_row_fields_and_ttft_gain():
    records = [_rec("warmup", 3.0, 0, 4), _rec("warmup", 5.0, 0, 6), _rec("query", 1.0, 7, 8),
               _rec("query", 1.0, 7.5, 9.5)]
    row = make_row("long-doc-qa", "kvcodec-vllm-serve", None, False, records, {"documents": 2})
    for field in ("workload", "method", "bandwidth_mbps", "restart_between_rounds", "warmup_ttft_mean_s",
                  "query_ttft_mean_s", "ttft_gain", "query_round_s", "answers_equal", "requests"):
        assert field in row
    assert (row["warmup_ttft_mean_s"], row["query_ttft_mean_s"], row["ttft_gain"]) == (4.0, 1.0, 4.0)
    assert (row["warmup_round_s"], row["query_round_s"]) == (6.0, 2.5)
    assert row["answers_equal"] is True and row["mismatches"] == 0 and len(row["requests"]) == 4
    records[2].equal = False
    assert make_row("long-doc-qa", "m", None, False, records, {})["answers_equal"] is False
    records[2].equal = None  # not checked: not counted as equal
    assert make_row("long-doc-qa", "m", None, False, records, {})["answers_equal"] is False
    assert ttft_gain(None, 1.0) is None and ttft_gain(2.0, 0.0) is None
    turns = [_rec("warmup", 2.0, turn=1), _rec("query", 1.0, turn=2), _rec("query", 0.5, turn=3),
             _rec("query", 1.5, turn=3)]
    chat = make_row("multi-round", "vllm", None, True, turns, {})
    assert chat["ttft_by_turn"] == {"1": 2.0, "2": 1.0, "3": 1.0} and chat["ttft_gain"] == 2.0
    assert chat["routing"] == "none" and "local_hit_rate" not in chat  # one server, no tiers counted
    routed = make_row("long-doc-qa", "kvcodec", None, True, records, {}, routing="prefix",
                      tiers={"local": 6, "remote": 2})
    assert routed["routing"] == "prefix" and routed["local_hit_rate"] == 0.75 and routed["tier_chunks"]["local"] == 6


def test_json_rows_replace_their_own_and_keep_the_others(tmp_path):
    path = tmp_path / "workloads.json"
    a = make_row("long-doc-qa", "vllm", None, False, [_rec("warmup", 2.0), _rec("query", 1.0)], {})
    b = make_row("long-doc-qa", "vllm", None, True, [_rec("warmup", 2.0), _rec("query", 2.0)], {})
    c = make_row("multi-round", "vllm", None, False, [_rec("warmup", 2.0, turn=1), _rec("query", 1.0, turn=2)], {})
    merge_rows(path, [a, b, c])
    a2 = dict(a, query_ttft_mean_s=0.5)
    rows = merge_rows(path, [a2])
    assert [r["query_ttft_mean_s"] for r in rows] == [0.5, 2.0, 1.0]
    routed = dict(b, routing="round-robin")  # the same run behind a router: a row of its own
    rows = merge_rows(path, [routed])
    assert [r.get("routing") for r in rows] == ["none", "none", "none", "round-robin"]
    assert json.loads(path.read_text())["rows"] == rows
    plot(rows, tmp_path / "workloads.png", log=lambda m: None)
    assert (tmp_path / "workloads.png").read_bytes()[:4] == b"\x89PNG"


# ---- the runner against a fake server ---------------------------------------------------------------

class FakeServer:
    """Streams a deterministic answer per prompt (OpenAI completions or Triton generate_stream, one
    event per character); ``wrong`` answers differently when a prompt comes again unsalted with reuse
    on (as a broken cache would); counts requests in flight."""

    def __init__(self, wrong: bool = False) -> None:
        self.wrong, self.seen, self.bodies, self.inflight, self.max_inflight = wrong, set(), [], 0, 0
        self.routes = []  # (the X-KVCodec-Prefix header, the prompt) of each request
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.bodies.append(body)
                    server.routes.append((self.headers.get("X-KVCodec-Prefix"), body.get("prompt", body.get("text_input"))))
                    server.inflight += 1
                    server.max_inflight = max(server.max_inflight, server.inflight)
                prompt = body.get("prompt", body.get("text_input"))
                reused = body.get("reuse", True) and not body.get("cache_salt", "").startswith("reference")
                with server.lock:
                    again = prompt in server.seen and reused
                    server.seen.add(prompt)
                answer = f"<{len(prompt) % 97}>" + ("!" if server.wrong and again else "")
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for ch in answer:
                    event = ({"choices": [{"text": ch}]} if "prompt" in body
                             else {"text_output": ch, "reused_tokens": 5 if again else 0})
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    threading.Event().wait(0.01)
                if "prompt" in body:
                    usage = {"usage": {"prompt_tokens_details": {"cached_tokens": 5 if again else 0}}, "choices": []}
                    self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
                with server.lock:
                    server.inflight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_long_doc_qa_runs_rounds_checks_answers_with_a_fresh_salt_and_bounds_in_flight():
    config = LongDocConfig(documents=3, document_tokens=50, output_tokens=4, repeat_count=2, repeat_mode="interleave",
                           hit_miss="2:1", inflight=2)
    with FakeServer() as server:
        records, times = run_long_doc_qa(OpenAITarget(server.url, cache_salt="tenant-a"), Words(), config,
                                         progress=False)
    assert [r.round for r in records] == ["warmup"] * 3 + ["query"] * 6
    assert [r.doc for r in records if r.round == "query"] == [0, 0, 1, 1, 2, 2]
    assert all(r.equal for r in records) and server.max_inflight == 2
    measured = [b for b in server.bodies if not b.get("cache_salt", "").startswith("reference")]
    refs = [b for b in server.bodies if b.get("cache_salt", "").startswith("reference")]
    assert all(b["cache_salt"] == "tenant-a" and b["stream"] and b["temperature"] == 0.0 for b in measured)
    assert len(refs) == 5 and len({b["cache_salt"] for b in refs}) == 5  # 3 documents + 2 misses, each a new salt
    assert times["query_round_s"] > 0 and all(0 < r.ttft_s <= r.end_s - r.start_s for r in records)
    assert [r.cached_tokens for r in records if r.round == "query" and not r.miss] == [5, 5, 5, 5]


def test_a_wrong_answer_is_counted_and_the_ensemble_reference_turns_reuse_off():
    config = LongDocConfig(documents=2, document_tokens=30, output_tokens=4, repeat_count=1, repeat_mode="tile")
    with FakeServer(wrong=True) as server:
        records, _ = run_long_doc_qa(EnsembleTarget(server.url), Words(), config, progress=False)
    row = make_row("long-doc-qa", "kvcodec-ensemble", 100.0, False, records, {})
    assert row["answers_equal"] is False and row["mismatches"] == 2  # the query round's two, cached wrongly
    refs = [b for b in server.bodies if b.get("reuse") is False]
    assert len(refs) == 2 and all(b["exclude_input_in_output"] and b["stream"] for b in server.bodies)


def test_multi_round_sends_growing_conversations_and_restarts_between_turn_one_and_the_rest():
    config = MultiRoundConfig(users=2, rounds=3, system_tokens=40, user_info_tokens=10, answer_tokens=4, qps=40.0)
    restarts = []
    with FakeServer() as server:
        target = OpenAITarget(server.url)

        def restart():
            restarts.append(len(server.bodies))
            return target

        records, times = run_multi_round(target, Words(), config, restart=restart, progress=False)
    assert len(restarts) == 1 and [(r.turn, r.user) for r in records] == [(k, u) for k in (1, 2, 3) for u in (0, 1)]
    assert [r.round for r in records] == ["warmup"] * 2 + ["query"] * 4 and all(r.equal for r in records)
    by_user = {u: [r.prompt for r in records if r.user == u] for u in (0, 1)}
    for u, prompts in by_user.items():
        assert prompts[1].startswith(prompts[0]) and prompts[2].startswith(prompts[1])
        assert f"For user {u}," in prompts[0]
    assert by_user[0][0].split("For user")[0] == by_user[1][0].split("For user")[0]  # the shared system prompt
    row = make_row("multi-round", "vllm", None, True, records, {}, **times)
    assert set(row["ttft_by_turn"]) == {"1", "2", "3"} and row["answers_equal"]


def test_only_loopback_servers():
    assert check_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match="loopback"):
        OpenAITarget("http://10.0.0.5:8000")


def test_peers_methods_run_the_workload_through_their_servers_and_restart_after_settling():
    """``workload_peers``: a method's servers (a stand-in with ``streamed``, as ``VllmServe`` and the
    ensemble's have) answer the rounds; the restart settles the store before it closes the first
    server and opens a second; references come from the reference server, not the method's."""
    import contextlib

    from kvcodec_tools.workload_peers import MethodServers

    events, seen = [], []

    class Server:
        def __init__(self, n):
            self.n = n

        def streamed(self, prompt, max_tokens, **extra):
            seen.append((self.n, prompt[:12]))
            return {"ttft_s": 0.01, "text": f"<{len(prompt) % 97}>", "cached_tokens": 0, "elapsed_s": 0.02}

        def metrics_text(self):  # each server's own counts: queued 4, stored 3 + n, dropped 1 - n
            return "\n".join(f'kvcodec_writeback_total{{engine="0",state="{k}"}} {v}.0'
                              for k, v in (("queued", 4), ("stored", 3 + self.n), ("dropped", 1 - self.n)))

    @contextlib.contextmanager
    def open_server(n):
        events.append(f"open {n}")
        yield Server(n)
        events.append(f"close {n}")

    servers = MethodServers(open_server, lambda: events.append("settle"), lambda p, m: f"<{len(p) % 97}>")
    config = LongDocConfig(documents=2, document_tokens=30, output_tokens=4, repeat_count=1, repeat_mode="tile")
    try:
        records, _ = run_long_doc_qa(servers.start(), Words(), config, restart=servers.start, progress=False)
    finally:
        servers.close()
    assert events == ["open 0", "settle", "close 0", "open 1", "close 1"] and servers.starts == 2
    assert servers.writeback == {"queued": 8, "stored": 7, "dropped": 1}  # summed over both servers
    assert all(r.equal for r in records) and len(records) == 4
    assert {n for n, p in seen if p.startswith("Document")} == {0, 1}  # warm-up on the first, queries on the second


def test_a_peers_ensemble_is_sent_to_through_http_generate_stream():
    """``workload_peers.ServerTarget``: a server with ``http_url`` (``EnsembleServer``) gets the
    workload's requests on Triton's HTTP ``generate_stream``, not its gRPC ``streamed``."""
    from kvcodec_tools.workload_peers import ServerTarget

    class Ensemble:
        def __init__(self, url):
            self.http_url = url

        def streamed(self, prompt, max_tokens, **extra):
            raise AssertionError("the gRPC stream was used")

    with FakeServer() as server:
        target = ServerTarget(Ensemble(server.url), lambda p, m: "unused")
        first, again = target.send("a prompt", 4), target.send("a prompt", 4)
    assert first.text == again.text == "<8>" and (first.cached_tokens, again.cached_tokens) == (0, 5)
    assert [b["text_input"] for b in server.bodies] == ["a prompt"] * 2 and all(b["stream"] for b in server.bodies)


def test_the_issues_targets_are_measured_from_the_rows_and_none_without_them(tmp_path):
    from kvcodec_tools.workload import targets

    def row(method, rate, query, workload="long-doc-qa", **extra):
        return {"workload": workload, "method": method, "bandwidth_mbps": rate, "restart_between_rounds": True,
                "routing": "none", "query_ttft_mean_s": query, **extra}

    rows = [row("kvcodec-vllm-serve", 100.0, 1.0), row("lmcache", 100.0, 2.0), row("lmcache-fp8", 100.0, 1.0),
            row("kvcodec-vllm-serve", 10000.0, 0.5), row("lmcache", 10000.0, 0.6), row("lmcache-fp8", 10000.0, 0.4),
            row("kvcodec-vllm-serve", 100.0, 0.3, "multi-round", ttft_by_turn={"1": 2.0, "2": 0.3, "3": 0.33}),
            row("kvcodec-vllm-serve", None, 0.3, "multi-round", ttft_by_turn={"1": 2.0, "2": 0.3, "3": 0.9}),
            dict(row("kvcodec-vllm-serve", None, 0.7), routing="prefix", local_hit_rate=1.0),
            dict(row("kvcodec-vllm-serve", None, 0.7), routing="round-robin", local_hit_rate=0.5)]
    t = targets(rows)
    assert t["long_doc_qa_vs_lmcache_100m"] == {"value": 0.5, "target": "<= 0.7", "met": True}
    assert t["long_doc_qa_vs_lmcache_fp8_100m"]["value"] == 1.0 and t["long_doc_qa_vs_lmcache_fp8_100m"]["met"] is False
    assert t["long_doc_qa_vs_best_lmcache_10g"]["value"] == 1.25 and not t["long_doc_qa_vs_best_lmcache_10g"]["met"]
    assert t["multi_round_last_turn_over_turn_2"] == {"value": 1.1, "target": "<= 1.2", "met": True}
    growing = row("kvcodec-ensemble", 100.0, 0.5, "multi-round", ttft_by_turn={"1": 1.0, "2": 0.4, "3": 0.6})
    assert targets(rows[:6] + [growing] + rows[6:])["multi_round_last_turn_over_turn_2"]["value"] == 1.5  # the worst row
    # (the row without a link, 3.0, is not a side-by-side row)
    assert t["routing_prefix_over_round_robin_local_hits"] == {"value": 2.0, "target": "> 1", "met": True}
    empty = targets([])
    assert all(v == {"value": None, "target": v["target"], "met": None} for v in empty.values())
    merge_rows(tmp_path / "w.json", rows[:2])
    assert json.loads((tmp_path / "w.json").read_text())["targets"]["long_doc_qa_vs_lmcache_100m"]["met"] is True
