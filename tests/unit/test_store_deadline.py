"""Call deadlines (``kvcodec.store.deadline``) on the HTTP store, against a real socket server in
the test that never answers or trickles its answer: the call ends at the caller's deadline, its
connection is closed (the server sees it go), and the next call on that thread gets a fresh one."""
from __future__ import annotations

import socket
import threading
import time

import pytest

from kvcodec.errors import StoreUnavailable
from kvcodec.store import deadline
from kvcodec.store.http import HttpStore

pytestmark = pytest.mark.timeout(60)


class SickServer:
    """Accepts; ``mode`` ``silent`` reads and never answers, ``trickle`` sends a 200 answer one
    byte every 50 ms, ``ok`` answers each request 404 at once. Counts connections accepted and
    those that the client closed."""

    def __init__(self) -> None:
        self.mode, self.closed_by_client, self.accepted = "silent", 0, 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                data = conn.recv(65536)
                while self.mode == "ok" and data:  # keep-alive: one answer per request
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    data = conn.recv(65536)
                if self.mode == "trickle":
                    for b in b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000:
                        conn.sendall(bytes([b]))
                        if self._stop.wait(0.05):
                            return
                while conn.recv(65536):  # until the client closes it
                    pass
                self.closed_by_client += 1
            except OSError:
                self.closed_by_client += 1

    def close(self) -> None:
        self._stop.set()
        self._sock.close()


@pytest.fixture
def sick():
    server = SickServer()
    yield server
    server.close()


@pytest.mark.parametrize("mode", ["silent", "trickle"])
def test_a_call_ends_at_its_deadline_and_its_connection_is_closed(sick, mode):
    sick.mode = mode
    store = HttpStore(f"http://127.0.0.1:{sick.port}/kv", timeout_s=30)  # each read alone would wait 30 s
    try:
        t0 = time.monotonic()
        with deadline.call_deadline(t0 + 0.5), pytest.raises(StoreUnavailable, match="timed out"):
            store.get("a/b")
        assert time.monotonic() - t0 < 1.5
        for _ in range(50):
            if sick.closed_by_client:
                break
            time.sleep(0.05)
        assert sick.closed_by_client == 1  # released: the hung connection is closed, not kept
        sick.mode = "ok"
        assert store.get("a/b") is None  # the next call gets a fresh connection (404: a miss)
    finally:
        store.close()


def test_a_call_past_its_deadline_fails_at_once_and_deadlines_nest(sick):
    sick.mode = "ok"
    store = HttpStore(f"http://127.0.0.1:{sick.port}/kv")
    try:
        with deadline.call_deadline(time.monotonic() - 1), pytest.raises(StoreUnavailable, match="timed out"):
            store.exists("k")
        assert deadline.left() is None
        with deadline.call_deadline(time.monotonic() + 1):
            with deadline.call_deadline(time.monotonic() + 100):
                assert deadline.left() < 1.01  # the earlier deadline wins
            with deadline.call_deadline(None):
                assert deadline.left() < 1.01
            assert store.exists("k") is False
    finally:
        store.close()


def test_without_a_deadline_a_silent_store_waits_for_its_read_timeout(sick):
    """The deadline is what cuts the call above: without one, only ``timeout_s`` does."""
    store = HttpStore(f"http://127.0.0.1:{sick.port}/kv", timeout_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="timed out"):
            store.get("k")
        assert time.monotonic() - t0 >= 0.9
    finally:
        store.close()


def test_a_refused_connection_is_an_error_at_once():
    port = socket.create_server(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    store = HttpStore(f"http://127.0.0.1:{free}/kv", timeout_s=30, connect_timeout_s=30)
    try:
        t0 = time.monotonic()
        with deadline.call_deadline(t0 + 10), pytest.raises(StoreUnavailable, match="unreachable"):
            store.exists("k")
        assert time.monotonic() - t0 < 0.5
    finally:
        store.close()


def test_drop_connections_closes_each_connection_at_its_next_use(sick):
    """The fetcher calls it when the store's breaker opens: a connection of a sick spell is not reused."""
    sick.mode = "ok"
    store = HttpStore(f"http://127.0.0.1:{sick.port}/kv")
    try:
        assert store.exists("k") is False and store.exists("k") is False
        assert sick.accepted == 1  # kept alive
        store.drop_connections()
        assert store.exists("k") is False
        assert sick.accepted == 2
        for _ in range(50):
            if sick.closed_by_client:
                break
            time.sleep(0.02)
        assert sick.closed_by_client == 1
    finally:
        store.close()
