"""Every store fault becomes a fallback to prefill within the fetch deadline, through a real
tritonserver: the store is a small HTTP server in this test that serves real chunks (ingested by
``kvcodec ingest``) and misbehaves on purpose: it hangs, answers 500, resets the connection or cuts a
body short, on the look-up or mid-stream. Each answer equals prefill's, the reason is in the stats,
the request ends within the deadline, and the server is healthy afterwards.

Then the server's own faults: a client that disconnects mid-stream (over gRPC and HTTP) leaves
nothing behind; a python stub killed while a request is in it ends that request at once (what
Triton does after is asserted as observed); a prompt longer than the model's context is
INVALID_ARG."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import re
import signal
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvcodec.serving.costs import CostModel
from kvcodec_client import ClientError, KVCodecClient
from kvcodec_tools.ports import free_ports
from kvcodec_tools.procs import alive
from kvcodec_tools.procstats import descendants, read_proc, sample_tree, stub_pids
from kvcodec_tools.tritonserver import MODELS, Ports, TritonServer

from .conftest import REPO, cli, ingested_home, metric_values, text_of

pytestmark = pytest.mark.integration
FETCH_TIMEOUT_S = 3.0
QUESTION = "\n# What does this module do?\n"


class MisbehavingStore:
    """An HTTP/1.1 object server over a folder of ``<key>.kvc`` files (the file:// store's layout)
    whose ``mode`` says how it misbehaves:

    ``ok``; ``hang_get`` (answers HEAD, never answers GET); ``hang_all`` (answers nothing);
    ``error_get`` (GET answers 500); ``reset_get`` (the first GET is served, later ones are reset);
    ``short_get`` (GET sends its full Content-Length but half the body, then closes)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mode = "ok"
        self.gets = 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._open: list = []
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/kv?timeout_s=30"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._open.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            reader = conn.makefile("rb")
            while not self._stop.is_set():
                line = reader.readline()
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                length = 0
                while (header := reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.decode("latin-1").partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                reader.read(length)  # a write-back's PUT body
                if method in ("PUT", "DELETE"):  # a read-only store: the server's write-back is refused
                    conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
                    continue
                if not self._answer(conn, method, path):
                    return

    def _answer(self, conn: socket.socket, method: str, path: str) -> bool:
        """Answer one request; False when the connection is done with."""
        mode = self.mode
        if mode == "hang_all" or (mode == "hang_get" and method == "GET"):
            self._stop.wait(60)
            return False
        file = self.root / path.split("/kv/", 1)[-1]
        if not file.is_file():
            conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return True
        body = file.read_bytes()
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        if method == "HEAD":
            conn.sendall(head)
            return True
        self.gets += 1
        if mode == "error_get":
            conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n")
            return True
        if mode == "reset_get" and self.gets > 1:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # RST
            return False
        if mode == "short_get":
            conn.sendall(head + body[: len(body) // 2])
            conn.close()
            return False
        conn.sendall(head + body)
        return True

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        for conn in self._open:
            with contextlib.suppress(OSError):
                conn.close()


@pytest.fixture(scope="module")
def faulty(settings, tokenizer, tmp_path_factory):
    """The store server, a context ingested into its folder, and a tritonserver reading from it."""
    root = tmp_path_factory.mktemp("faulty-store")
    text = text_of(tokenizer, "calendar.py", 800)
    (root / "context.txt").write_text(text)
    # Same home (and so the same chunk key) as the server; chunks straight into the served folder.
    local = replace(settings, store=f"file://{root / 'kv'}")
    cli(local, "ingest", "--text-file", str(root / "context.txt"), "--codec", "int8-zstd", "--json", "--quiet")
    store = MisbehavingStore(root / "kv")
    server_settings = replace(settings, store=store.url, ladder=("int8-zstd",), fetch_timeout_s=FETCH_TIMEOUT_S,
                              adaptive=False)
    http, grpc, metrics = free_ports(3)
    server = TritonServer(REPO / "model_repository", server_settings, Ports(http, grpc, metrics),
                          log_path=root / "tritonserver.log")
    server.start(timeout_s=300)
    client = KVCodecClient(server.grpc_url, "grpc")
    ids = tokenizer.encode(text + QUESTION)
    prefill = client.generate(ids, 4, reuse=False)
    try:
        yield store, client, ids, prefill, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        server.stop()
        store.close()


@pytest.mark.parametrize("mode, chunks_used, reason", [
    ("ok", 3, ""),
    ("hang_get", 0, "chunk 0: timeout"),
    ("hang_all", 0, "store lookup timed out"),
    ("error_get", 0, "HTTP 500"),
    ("reset_get", 1, "chunk 1: error"),
    ("short_get", 0, "chunk 0: error"),
])
def test_a_store_fault_falls_back_to_prefill_within_the_deadline(faulty, mode, chunks_used, reason):
    store, client, ids, prefill, _ = faulty
    store.mode, store.gets = mode, 0
    t0 = time.monotonic()
    result = client.generate(ids, 4, reuse=True)
    took = time.monotonic() - t0
    store.mode = "ok"
    assert result.tokens == prefill.tokens  # the model's own answer
    assert result.stats["chunks_used"] == chunks_used and result.reused_tokens == 256 * chunks_used
    assert reason in result.stats["miss_reason"], result.stats["miss_reason"]
    # the store's part ends at the deadline; the rest is the prompt's prefill (which took prefill.ttft_s)
    assert took < FETCH_TIMEOUT_S + 3 * prefill.ttft_s + 5, took
    # the server is fine afterwards, and reuse is back within two requests (the store's breaker,
    # opened by the fault, lets it back after one probe)
    assert reused_within_two(client, ids, 2) == 768


def test_metrics_count_the_fallbacks_by_reason_and_time_the_stages(faulty):
    """After the fault tests: the dashboard's view of them, read from the metrics port."""
    import urllib.request

    *_, url = faulty
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("kvcodec_"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values['kvcodec_misses_total{reason="timeout"}'] >= 1  # hang_get
    assert values['kvcodec_misses_total{reason="none"}'] >= 1  # hang_all: the look-up timed out
    assert values['kvcodec_misses_total{reason="error"}'] >= 3  # 500, reset, short body
    assert values['kvcodec_requests_total{outcome="partial"}'] >= 1  # reset after the first chunk
    for name in ("ttft", "fetch", "decode", "restore"):
        assert values[f"kvcodec_{name}_seconds_count"] >= 7, name
        assert f'kvcodec_{name}_seconds_bucket{{le="+Inf"}}' in values
    assert values["kvcodec_fetch_seconds_sum"] > 0



@pytest.mark.timeout(600)
def test_a_real_redis_store_paused_then_stopped_falls_back_to_prefill(settings, tokenizer, tmp_path):
    """A real redis-server as the store, the context ingested into it: paused (SIGSTOP: it accepts
    connections and never answers), the request gives the prefill tokens within prefill's TTFT +
    max(2 s, the predicted prefill of the stored prefix), the next request skips it at once with the
    hung calls released, and reuse comes back within two requests once it runs again; stopped (connection refused), the same answer at once (prefill's TTFT);
    the server stays healthy throughout. TTFT margin for the noisy machine: a quarter of prefill's
    TTFT plus 1 s."""
    from kvcodec_tools.services.redis import RedisServer

    redis = RedisServer(tmp_path / "redis", "127.0.0.1", free_ports(1)[0], "faults-pw").start()
    try:
        local = replace(settings, store=redis.url + "?connect_timeout_s=1&timeout_s=30")
        text = text_of(tokenizer, "calendar.py", 800)
        (tmp_path / "context.txt").write_text(text)
        cli(local, "ingest", "--text-file", str(tmp_path / "context.txt"), "--codec", "int8-zstd", "--json", "--quiet")
        with own_server(replace(local, home=settings.home, ladder=("int8-zstd",), fetch_timeout_s=FETCH_TIMEOUT_S,
                                adaptive=False), "redis-faults") as (server, metrics):
            client = KVCodecClient(server.grpc_url, "grpc", timeout_s=120)
            ids = tokenizer.encode(text + QUESTION)
            prefill = client.generate(ids, 4, reuse=False)
            assert client.generate(ids, 4, reuse=True).reused_tokens == 768
            seen, ttfts = {}, {}
            for fault in ("paused", "stopped"):
                if fault == "paused":
                    os.kill(redis.pid, signal.SIGSTOP)
                else:
                    redis.stop()
                t0 = time.monotonic()
                result = client.generate(ids, 4, reuse=True)
                took = time.monotonic() - t0
                if fault == "paused":
                    # still paused: the next request skips the store at once (its breaker is open), and
                    # the calls hung on the paused server were released (the breaker closed their
                    # connections) instead of waiting out their 30 s socket timeout
                    skipped = client.generate(ids, 4, reuse=True)
                    calls = metric_values(metrics, "kvcodec_store_calls")
                    os.kill(redis.pid, signal.SIGCONT)
                    assert "store skipped" in skipped.stats["miss_reason"], skipped.stats["miss_reason"]
                    assert skipped.tokens == prefill.tokens and sum(calls.values()) == 0, calls
                seen[fault] = (round(took, 2), result.stats["miss_reason"])
                ttfts[fault] = round(result.ttft_s, 2)
                assert result.tokens == prefill.tokens and result.reused_tokens == 0, fault
                assert result.stats["miss_reason"], fault
                assert took < FETCH_TIMEOUT_S + 3 * prefill.ttft_s + 5, (fault, took)
                fault_s = max(2.0, CostModel(settings.home / "costs.json").prefill_s_per_token * 768)
                margin = 0.25 * prefill.ttft_s + 1.0
                assert result.ttft_s <= prefill.ttft_s + (fault_s if fault == "paused" else 0) + margin, \
                    (fault, result.ttft_s, prefill.ttft_s, fault_s)
                if fault == "paused":  # running again: the stored chunks are reused again
                    assert reused_within_two(client, ids) == 768
            print(f"redis faults (seconds to the last token, reason): {seen}; TTFT: {ttfts}, prefill's "
                  f"{prefill.ttft_s:.2f} s")
            assert "timed out" in seen["paused"][1] and "unreachable" in seen["stopped"][1]
            assert client.generate(ids, 2, reuse=False).tokens == prefill.tokens[:2]  # still healthy
    finally:
        redis.stop()


def reused_within_two(client, ids, max_tokens: int = 4) -> int:
    """Tokens reused by the first of the next two requests that reuses all 768, else by the second."""
    first = client.generate(ids, max_tokens, reuse=True)
    return first.reused_tokens if first.reused_tokens == 768 else client.generate(ids, max_tokens,
                                                                                 reuse=True).reused_tokens


# -- the server's own faults ---------------------------------------------------------------------
KILL_DEADLINE_S = 60.0  # a request whose stub is killed must end by then
LONG_TOKENS = 64  # the generation a client walks away from


@pytest.fixture(scope="module")
def own(settings, tokenizer, tmp_path_factory):
    """A home of its own (chunk key, file store, costs) with a context ingested (int8-zstd, 3
    chunks), for the tests below that stop or damage their server: each starts its own."""
    local, text = ingested_home(settings, tokenizer, tmp_path_factory.mktemp("own-home"))
    return local, tokenizer.encode(text + QUESTION)


@contextlib.contextmanager
def own_server(local, name: str, repository: Path = REPO / "model_repository"):
    """A tritonserver of ``local``'s settings on ``repository``, its log at ``<home>/<name>.log``;
    stopped at the end."""
    http_port, grpc_port, metrics = free_ports(3)
    server = TritonServer(repository, local, Ports(http_port, grpc_port, metrics),
                          log_path=local.home / f"{name}.log")
    server.start(timeout_s=300)
    try:
        yield server, f"http://127.0.0.1:{metrics}/metrics"
    finally:
        server.stop()


def pending(url: str) -> dict:
    """Triton's queued (not yet executing) requests per model."""
    values = metric_values(url, "nv_inference_pending_request_count")
    return {re.search(r'model="([^"]+)"', k).group(1): v for k, v in values.items()}


def answered(url: str) -> float:
    """Requests the llm step finished (all outcomes)."""
    return sum(metric_values(url, "kvcodec_requests_total").values())


def cancelled(url: str) -> float:
    """Requests the llm step stopped because their client went away."""
    return sum(metric_values(url, "kvcodec_cancelled_total").values())


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.1)


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def grpc_first_token_then_gone(server, ids, max_tokens: int) -> list:
    """Open a gRPC stream, take the first token, then cancel the call and close the channel."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, array, dtype in (("input_ids", np.asarray(ids, np.int32), "INT32"),
                               ("max_tokens", np.array([max_tokens], np.int32), "INT32"),
                               ("reuse", np.array([True]), "BOOL")):
        tensor = grpcclient.InferInput(name, [1, *array.shape], dtype)  # the batch dimension
        tensor.set_data_from_numpy(array[None])
        inputs.append(tensor)
    answers: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        client.async_stream_infer("kvcodec", inputs, enable_empty_final_response=True)
        while True:
            result, error = answers.get(timeout=120)
            assert error is None, error
            tokens = result.as_numpy("output_ids")
            if tokens is not None and tokens.size:
                return tokens.reshape(-1).tolist()
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def http_first_token_then_gone(server, ids, max_tokens: int) -> list:
    """POST generate_stream, read the first token's event, then close the connection."""
    host, _, port = server.http_url.partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v2/models/kvcodec/generate_stream",
                     body=json.dumps({"input_ids": list(ids), "max_tokens": max_tokens, "reuse": True}),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        response = conn.getresponse()
        assert response.status == 200
        try:
            for raw in response:
                if raw.startswith(b"data:"):
                    tokens = json.loads(raw[5:]).get("output_ids")
                    if tokens not in (None, []):
                        return tokens if isinstance(tokens, list) else [tokens]
        finally:
            response.close()
    finally:
        conn.close()
    raise AssertionError("the stream ended without a token")


@pytest.mark.timeout(600)
def test_a_client_that_disconnects_mid_stream_leaves_nothing_behind(own):
    """After each disconnect the next request is answered exactly as before; every abandoned
    generation ends, stopped early where Triton passes the cancellation on to the llm step
    (``kvcodec_cancelled_total``) or run to its end; nothing stays queued, the server's process
    tree holds no more fds than before, and at shutdown Triton finds no request still in flight."""
    local, ids = own
    with own_server(local, "disconnect") as (server, metrics):
        clients = {p: KVCodecClient(server.grpc_url if p == "grpc" else server.http_url, p) for p in ("grpc", "http")}
        reference = clients["grpc"].generate(ids, 8, reuse=True)
        assert reference.reused_tokens == 768
        before, done = sample_tree(server.pid), answered(metrics) + cancelled(metrics)
        walk_away = {"grpc": grpc_first_token_then_gone, "http": http_first_token_then_gone}
        for protocol in ("grpc", "http", "grpc", "http"):
            t0 = time.monotonic()
            assert walk_away[protocol](server, ids, LONG_TOKENS) == reference.tokens[:1]
            after = clients[protocol].generate(ids, 8, reuse=True)
            assert after.tokens == reference.tokens and after.reused_tokens == 768, protocol
            print(f"{protocol} disconnect after the first token: the next request answered in "
                  f"{time.monotonic() - t0:.1f} s (behind the abandoned generation)")
        wait_for(lambda: answered(metrics) + cancelled(metrics) == done + 8, 60,
                 "the llm step ends every request, abandoned too")
        print(f"abandoned generations stopped early: {cancelled(metrics):g} of 4")
        assert pending(metrics) == {model: 0 for model in MODELS}
        wait_for(lambda: sample_tree(server.pid)["fds"] <= before["fds"], 30, "the closed connections' fds go")
        now = sample_tree(server.pid)
        assert (now["processes"], now["zombies"], now["shm_regions"]) == (6, 0, 4)  # server, 4 stubs, decoder
    log = server.log_path.read_text(errors="replace")
    assert "Found 0 model versions that have in-flight inferences" in log
    assert not re.search(r"has \d+ in-flight inferences", log)


@pytest.mark.timeout(600)
def test_a_killed_stub_ends_its_request_but_triton_does_not_recover(own):
    """SIGKILL to the kv_decode stub while a request is in it (the stub is stopped first, so the
    request is certainly inside it: Triton reports kv_decode busy with requests queued behind).

    Observed with Triton 2.51's python backend, and asserted so that a change shows: the request
    ends at once with "Stub process 'kv_decode_0_0' is not healthy." (no hang, no prefill answer);
    Triton does not restart the stub (it stays a zombie, unreaped) and keeps reporting the model and
    the server ready; every later request fails with the same error; and every failed request stays
    in flight in the ensemble for good: at shutdown Triton waits its whole exit timeout for them."""
    local, ids = own
    with own_server(local, "killed-stub") as (server, metrics):
        client = KVCodecClient(server.grpc_url, "grpc", timeout_s=KILL_DEADLINE_S)
        assert client.generate(ids, 4, reuse=True).reused_tokens == 768
        stubs = stub_pids(server.pid)
        assert set(stubs) == {"kv_fetch_0_0", "kv_decode_0_0", "kv_restore_0_0", "llm_0_0"}, stubs
        victim = stubs["kv_decode_0_0"]
        os.kill(victim, signal.SIGSTOP)
        outcome: dict = {}

        def ask() -> None:
            try:
                outcome["tokens"] = client.generate(ids, 4, reuse=True).tokens
            except ClientError as exc:
                outcome["error"] = exc.message

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        wait_for(lambda: pending(metrics).get("kv_decode", 0) > 0, 60, "the request's chunks wait on kv_decode")
        os.kill(victim, signal.SIGKILL)
        t0 = time.monotonic()
        asking.join(KILL_DEADLINE_S)
        ended_s = time.monotonic() - t0
        assert not asking.is_alive(), f"the request still hangs {KILL_DEADLINE_S:g} s after its stub was killed"

        later = []
        for _ in range(5):  # what the server does next, over ~10 s
            try:
                later.append(client.generate(ids, 4, reuse=True).tokens)
            except ClientError as exc:
                later.append(exc.message)
            time.sleep(2)
        victim_now = read_proc(victim)
        observed = {
            "request_ended_after_kill_s": round(ended_s, 2), "request": outcome,
            "victim_state": victim_now.state if victim_now else "gone",
            "stubs_after": sorted(stub_pids(server.pid)),
            "kv_decode_ready": status(f"http://{server.http_url}/v2/models/kv_decode/ready"),
            "server_ready": status(f"http://{server.http_url}/v2/health/ready"),
            "later_requests": later,
        }
        print(f"killed kv_decode stub: {observed}")
        assert "Stub process 'kv_decode_0_0' is not healthy" in outcome.get("error", ""), outcome
        assert not alive(victim) and observed["victim_state"] == "Z"  # not reaped
        assert observed["stubs_after"] == ["kv_fetch_0_0", "kv_restore_0_0", "llm_0_0"]  # not restarted
        assert observed["kv_decode_ready"] == 200 and observed["server_ready"] == 200  # still says ready
        assert all(isinstance(r, str) and "Stub process 'kv_decode_0_0' is not healthy" in r for r in later), later
    log = server.log_path.read_text(errors="replace")
    stuck = re.search(r"Model 'kvcodec' \(version 1\) has (\d+) in-flight inferences", log)
    print(f"at shutdown: {stuck.group(0) if stuck else 'no request in flight'}")
    assert stuck and int(stuck.group(1)) == 1 + len(later)
    assert "Exit timeout expired" in log


WATCHDOG_DEADLINE_S = 90.0  # from the kill to an answer again


@pytest.mark.timeout(600)
def test_a_watchdog_restarts_the_server_when_a_stub_dies(own):
    """The same SIGKILL to the kv_decode stub, on a server under ``kvcodec_tools.watchdog.Watchdog``: it sees
    the stub a zombie, stops the whole server (its process group goes) and starts it again on the
    same ports; within the deadline a request is answered again, tokens equal to before and the
    stored chunks reused; one restart counted; the new server's tree holds no zombie."""
    from kvcodec_tools.watchdog import Watchdog

    local, ids = own
    with own_server(local, "watchdog") as (server, _metrics):
        client = KVCodecClient(server.grpc_url, "grpc", timeout_s=KILL_DEADLINE_S)
        reference = client.generate(ids, 4, reuse=True)
        assert reference.reused_tokens == 768
        restarted = threading.Event()
        watchdog = Watchdog(server, on_restart=lambda _restart: restarted.set()).start()
        try:
            old_pid, victim = server.pid, stub_pids(server.pid)["kv_decode_0_0"]
            os.kill(victim, signal.SIGKILL)
            t0 = time.monotonic()
            assert restarted.wait(WATCHDOG_DEADLINE_S), f"no restart {WATCHDOG_DEADLINE_S:g} s after the kill"
            again = client.generate(ids, 4, reuse=True)  # the client made before the kill
            answered_s = time.monotonic() - t0
        finally:
            watchdog.stop()
        (restart,) = watchdog.history
        print(f"watchdog: {restart}; answered again {answered_s:.1f} s after the kill")
        assert answered_s < WATCHDOG_DEADLINE_S
        assert again.tokens == reference.tokens and again.reused_tokens == 768
        assert restart.ok and "kv_decode" in restart.reason and "is a zombie" in restart.reason, restart
        assert watchdog.restarts == 1 and not watchdog.gave_up
        assert server.pid != old_pid  # a new server, on the same ports: the same client answered
        with pytest.raises(ProcessLookupError):
            os.killpg(old_pid, 0)  # nothing of the old server's process group is left
        assert not alive(victim)
        now = sample_tree(server.pid)
        assert (now["processes"], now["zombies"]) == (6, 0)  # server, 4 stubs, the decoder's process
        assert set(stub_pids(server.pid)) == {"kv_fetch_0_0", "kv_decode_0_0", "kv_restore_0_0", "llm_0_0"}
    log = server.log_path.read_text(errors="replace")
    assert log.count("Started GRPCInferenceService") == 2  # both runs, the log appended to


@pytest.mark.timeout(600)
def test_a_request_in_flight_when_its_decoder_crashes_gets_the_prefill_answer(own):
    """A native decoder crash: SIGSEGV to the kv_decode stub while a request is inside it (stopped
    first, as above, then let go to die), on a server under the watchdog, asked by a client with a
    fallback (``fallback_s``). Triton ends the request with the stub's error; the client asks again
    without the stored KV until the restarted server answers: the tokens of the model's own
    prefill, within the watchdog's deadline, the failure reported in ``failures`` and
    ``stats["client_fallback"]``. The next request reuses the stored chunks again."""
    from kvcodec_tools.watchdog import Watchdog

    local, ids = own
    with own_server(local, "decoder-crash") as (server, metrics):
        client = KVCodecClient(server.grpc_url, "grpc", timeout_s=KILL_DEADLINE_S, fallback_s=WATCHDOG_DEADLINE_S)
        prefill = client.generate(ids, 4, reuse=False)
        assert client.generate(ids, 4, reuse=True).reused_tokens == 768
        watchdog = Watchdog(server).start()
        try:
            victim = stub_pids(server.pid)["kv_decode_0_0"]
            os.kill(victim, signal.SIGSTOP)
            outcome: dict = {}

            def ask() -> None:
                try:
                    outcome["result"] = client.generate(ids, 4, reuse=True)
                except ClientError as exc:
                    outcome["error"] = str(exc)

            asking = threading.Thread(target=ask, daemon=True)
            asking.start()
            wait_for(lambda: pending(metrics).get("kv_decode", 0) > 0, 60, "the request's chunks wait on kv_decode")
            os.kill(victim, signal.SIGSEGV)  # delivered when it runs again: it dies as a crashing decoder does
            os.kill(victim, signal.SIGCONT)
            t0 = time.monotonic()
            asking.join(WATCHDOG_DEADLINE_S + KILL_DEADLINE_S)
            answered_s = time.monotonic() - t0
        finally:
            watchdog.stop()
        assert not asking.is_alive() and "error" not in outcome, outcome
        result = outcome["result"]
        print(f"decoder crash: answered as prefill {answered_s:.1f} s after the crash, "
              f"{len(result.failures)} failure(s) first: {result.failures[0]!r}; {watchdog.history}")
        assert result.tokens == prefill.tokens and result.reused_tokens == 0
        assert "Stub process 'kv_decode_0_0' is not healthy" in result.failures[0]
        assert result.stats["client_fallback"]["reuse"] is False
        assert result.stats["client_fallback"]["attempts"] == len(result.failures) + 1
        assert answered_s < WATCHDOG_DEADLINE_S
        assert watchdog.restarts == 1 and "kv_decode" in watchdog.history[0].reason
        assert not alive(victim)
        again = client.generate(ids, 4, reuse=True)
        assert again.reused_tokens == 768 and not again.failures


def decoder_worker(server) -> int:
    """The pid of kv_decode's HEVC decoder process (``kvcodec.bitstream.isolated``)."""
    (pid,) = [p.pid for p in map(read_proc, descendants(server.pid))
              if p and p.state != "Z" and "kvcodec.bitstream.isolated" in p.argv]
    return pid


@pytest.mark.timeout(600)
def test_a_decoder_process_that_crashes_or_hangs_is_a_miss_answered_by_the_server_itself(settings, tokenizer,
                                                                                          tmp_path):
    """kv_decode runs PyAV in a process of its own (``decoder_process``, the default). A context at
    ``lossless8`` (HEVC), a server with a 3 s decode deadline, no watchdog, a client without a
    fallback. That process crashing mid-chunk (SIGSEGV, as FFmpeg on hostile bytes would) and
    hanging mid-chunk (SIGSTOP) each give the prefill answer from the server itself, the reason in
    ``stats``, within the deadline plus prefill; a new process takes the next chunk, and the next
    request reuses the stored chunks again; the stubs are the same throughout."""
    local, text = ingested_home(settings, tokenizer, tmp_path, codec="lossless8")
    with own_server(replace(local, decode_timeout_s=3.0), "decoder-process") as (server, _metrics):
        client = KVCodecClient(server.grpc_url, "grpc", timeout_s=120)
        ids = tokenizer.encode(text + QUESTION)
        prefill = client.generate(ids, 4, reuse=False)
        reused = client.generate(ids, 4, reuse=True)
        assert reused.reused_tokens == 768
        stubs, seen = stub_pids(server.pid), {}
        for fault in ("crash", "hang"):
            worker = decoder_worker(server)
            os.kill(worker, signal.SIGSTOP)
            outcome: dict = {}

            def ask(outcome=outcome) -> None:
                outcome["r"] = client.generate(ids, 4, reuse=True)

            asking = threading.Thread(target=ask, daemon=True)
            t0 = time.monotonic()
            asking.start()
            if fault == "crash":
                time.sleep(1.0)  # the first chunk is in the stopped worker by now
                os.kill(worker, signal.SIGSEGV)
                os.kill(worker, signal.SIGCONT)
            asking.join(60)
            took = time.monotonic() - t0
            result = outcome["r"]
            seen[fault] = (round(took, 2), result.stats["miss_reason"])
            assert result.tokens == prefill.tokens and result.reused_tokens == 0, fault
            assert took < 3.0 + 3 * prefill.ttft_s + 5, (fault, took)
            assert decoder_worker(server) != worker and not alive(worker)
            again = client.generate(ids, 4, reuse=True)
            assert again.reused_tokens == 768 and again.tokens == reused.tokens, fault
        print(f"decoder process faults: {seen}")
        assert "died decoding this chunk (killed by signal 11)" in seen["crash"][1]
        assert "did not answer within 3 s" in seen["hang"][1]
        assert stub_pids(server.pid) == stubs  # no stub died, nothing restarted


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_prompt_longer_than_the_context_is_invalid_argument(server, protocol):
    """Prompt plus max_tokens past the model's context (8192): refused at the door, short message."""
    client = KVCodecClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol)
    with pytest.raises(ClientError) as err:
        client.generate([1] * 8190, 8)
    message = err.value.message
    assert message.endswith("prompt (8190 tokens) plus max_tokens (8) is longer than the model's context (8192)")
    assert len(message) < 200 and "Traceback" not in message
    if protocol == "http":
        assert err.value.status == "400"  # INVALID_ARG; gRPC streams carry the message only
    assert client.generate([1, 2, 3], 1).tokens  # and the server goes on
