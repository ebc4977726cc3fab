"""Every store fault becomes a fallback to prefill within the fetch deadline, through a real
tritonserver: the store is a small HTTP server in this test that serves real chunks (ingested by
``kvcodec ingest``) and misbehaves on purpose: it hangs, answers 500, resets the connection or cuts a
body short, on the look-up or mid-stream. Each answer equals prefill's, the reason is in the stats,
the request ends within the deadline, and the server is healthy afterwards."""
from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvcodec_client import KVCodecClient
from perf.ports import free_ports
from perf.tritonserver import Ports, TritonServer

from .conftest import REPO, cli, text_of

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
                while reader.readline() not in (b"\r\n", b""):
                    pass  # headers (no request of ours has a body)
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
    healthy = client.generate(ids, 2, reuse=True)  # the server is fine afterwards
    assert healthy.reused_tokens == 768


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
