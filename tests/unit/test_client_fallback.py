"""``KVCodecClient``'s fallback: a server failure is answered by asking again as prefill, within
``fallback_s``; a refusal never is. Against a small in-test HTTP server that fails on purpose (the
real server's failures are in tests/integration/test_faults.py)."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvcodec_client.client import ClientError, KVCodecClient

ANSWER = {"output_ids": [7, 8], "text_output": "ok", "reused_tokens": 0,
          "stats": json.dumps({"reason": "reuse off", "final": True})}
# the first token's event of an answer whose stream is then cut (its stats are not the final ones)
CUT = {"output_ids": [7], "text_output": "o", "reused_tokens": 0, "stats": json.dumps({"final": False})}


class Script:
    """What the server does at each request: an HTTP status, ``"event"`` (an error event after a
    200), or ``"ok"``; the last entry repeats. Records each request's ``reuse``."""

    def __init__(self, *steps) -> None:
        self.steps = list(steps)
        self.reuse = []


def serve(script: Script):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            script.reuse.append(body["reuse"])
            step = script.steps[min(len(script.reuse), len(script.steps)) - 1]
            if step == "stub400":  # what Triton's HTTP endpoint answers when a step's stub died mid-request
                step = 400
                payload = json.dumps({"error": "in ensemble 'kvcodec', Stub process 'kv_restore_0_0' is not "
                                               "healthy."}).encode()
            elif isinstance(step, int):
                payload = json.dumps({"error": f"status {step}"}).encode()
            if isinstance(step, int):
                self.send_response(step)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            event = {"error": "Stub process 'kv_decode_0_0' is not healthy."} if step == "event" else \
                CUT if step == "cut" else ANSWER
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.fixture
def server():
    made = []

    def start(*steps):
        script = Script(*steps)
        httpd = serve(script)
        made.append(httpd)
        return f"127.0.0.1:{httpd.server_address[1]}", script

    yield start
    for httpd in made:
        httpd.shutdown()
        httpd.server_close()


def test_a_failure_mid_stream_and_a_5xx_are_answered_as_prefill(server):
    url, script = server("event", 503, "ok")
    result = KVCodecClient(url, "http", timeout_s=10, fallback_s=30).generate([1, 2, 3], 2, reuse=True)
    assert result.tokens == [7, 8] and result.text == "ok"
    assert script.reuse == [True, False, False]  # asked again without the stored KV
    assert len(result.failures) == 2 and "is not healthy" in result.failures[0] and "503" in result.failures[1]
    assert result.stats["client_fallback"] == {"reason": result.failures[0], "attempts": 3, "reuse": False}
    assert result.to_json()["failures"] == result.failures


def test_without_fallback_the_failure_is_raised(server):
    url, script = server("event", "ok")
    with pytest.raises(ClientError) as err:
        KVCodecClient(url, "http", timeout_s=10).generate([1, 2, 3], 2)
    assert err.value.retryable and "is not healthy" in err.value.message and script.reuse == [True]


def test_a_refusal_is_never_asked_again(server):
    url, script = server(400, "ok")
    with pytest.raises(ClientError) as err:
        KVCodecClient(url, "http", timeout_s=10, fallback_s=30).generate([1], 2)
    assert err.value.status == "400" and not err.value.retryable and script.reuse == [True]


def test_a_400_that_says_a_stub_died_is_a_server_failure(server):
    """Triton's HTTP endpoint answers 400 when a python stub died under the request (seen in
    ``kvcodec soak --chaos``): the message says it is the server's failure, so it is asked again."""
    url, script = server("stub400", "ok")
    result = KVCodecClient(url, "http", timeout_s=10, fallback_s=30).generate([1, 2, 3], 2, reuse=True)
    assert result.tokens == [7, 8] and script.reuse == [True, False]
    assert "is not healthy" in result.failures[0] and "400" in result.failures[0]


def test_an_answer_cut_before_its_last_token_is_a_server_failure(server):
    """A server stopped mid-answer (SIGTERM: the watchdog restarting it) ends its HTTP streams
    cleanly; the answer so far is not the answer (seen in ``kvcodec soak --chaos``: 2 of 8 tokens).
    The last token's event carries the final stats: without them the stream was cut."""
    url, script = server("cut", "ok")
    with pytest.raises(ClientError, match="ended after 1 token") as err:
        KVCodecClient(url, "http", timeout_s=10).generate([1, 2, 3], 2)
    assert err.value.retryable
    url, script = server("cut", "ok")
    result = KVCodecClient(url, "http", timeout_s=10, fallback_s=30).generate([1, 2, 3], 2, reuse=True)
    assert result.tokens == [7, 8] and script.reuse == [True, False] and "ended after 1 token" in result.failures[0]


def test_the_fallback_ends_at_its_deadline(server):
    url, script = server(500)
    t0 = time.monotonic()
    with pytest.raises(ClientError, match=r"failed \d time\(s\) within 2 s; last: status 500"):
        KVCodecClient(url, "http", timeout_s=10, fallback_s=2).generate([1], 2)
    assert time.monotonic() - t0 < 2.5 and len(script.reuse) >= 2


def test_a_refused_connection_is_a_server_failure():
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    err = pytest.raises(ClientError, KVCodecClient(closed, "http", timeout_s=5).generate, [1], 2).value
    assert err.status == "connection" and err.retryable


@pytest.mark.parametrize("status, retryable", [("StatusCode.INTERNAL", True), ("StatusCode.UNAVAILABLE", True),
                                                ("StatusCode.INVALID_ARGUMENT", False), ("400", False),
                                                ("502", True), ("stream", True), ("", False)])
def test_which_statuses_are_failures_of_the_server(status, retryable):
    assert ClientError("x", status).retryable is retryable
    with pytest.raises(ValueError, match="fallback_s"):
        KVCodecClient("h:1", "http", fallback_s=-1)
