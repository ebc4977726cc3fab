"""``kvcodec serve`` runs tritonserver in the foreground and stops it, and everything it started,
on SIGTERM or SIGINT; its watchdog is on by default: a model stub that dies brings a restart."""
from __future__ import annotations

import os
import signal
import time
import urllib.request

import pytest

from kvcodec_tools.tritonserver import children, stubs_of

from .conftest import free_ports, kill_tree, start_serve

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_starts_and_stops_cleanly(settings, tmp_path, signum):
    http, grpc, metrics = free_ports(3)
    proc, line = start_serve(settings, tmp_path, "--http-port", str(http), "--grpc-port", str(grpc),
                             "--metrics-port", str(metrics))
    try:
        assert "kvcodec serve: ready" in line, line
        assert f"127.0.0.1:{http}" in line and f"127.0.0.1:{grpc}" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/kvcodec/ready", timeout=5) as r:
            assert r.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
            assert r.status == 200
        if signum == signal.SIGTERM:  # once: the default watchdog restarts a server whose stub died
            _kill_a_stub_and_see_the_server_restart(proc.pid, http)
        proc.send_signal(signum)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, rest
        assert "kvcodec serve: stopped" in rest
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)  # the server and its model stubs are gone
    finally:
        kill_tree(proc)


def _ready(http: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/kvcodec/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _kill_a_stub_and_see_the_server_restart(serve_pid: int, http: int) -> None:
    (server,) = children(serve_pid)  # kvcodec serve's one child: tritonserver
    (stub,) = [s for s in stubs_of(server) if s.model == "kv_decode"]
    os.kill(stub.pid, signal.SIGKILL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        now = children(serve_pid)
        if now and now != [server] and _ready(http):
            break
        time.sleep(0.5)
    assert children(serve_pid) != [server] and _ready(http), "no restart after the stub died"
    assert [s for s in stubs_of(children(serve_pid)[0]) if s.model == "kv_decode" and not s.zombie]
