"""``kvcodec serve`` runs tritonserver in the foreground and stops it, and everything it started,
on SIGTERM or SIGINT."""
from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

import pytest

from .conftest import KVCODEC, free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_starts_and_stops_cleanly(settings, tmp_path, signum):
    http, grpc, metrics = free_ports(3)
    proc = subprocess.Popen(
        [KVCODEC, "serve", "--home", str(tmp_path), "--model-cache", str(settings.model_cache),
         "--store", f"file://{tmp_path}/store", "--threads", "1",
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        line = ""
        deadline = time.monotonic() + 300
        while "ready" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "kvcodec serve: ready" in line, line
        assert f"127.0.0.1:{http}" in line and f"127.0.0.1:{grpc}" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/models/kvcodec/ready", timeout=5) as r:
            assert r.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as r:
            assert r.status == 200
        proc.send_signal(signum)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, rest
        assert "kvcodec serve: stopped" in rest
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)  # the server and its model stubs are gone
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
