"""``kvcodec soak``, short: 4 clients (2 gRPC, 2 HTTP) for 45 s against a real tritonserver with the
transformers engine, reading an nginx store; every answer equals the same request made alone, and
the server's process tree holds no more processes or file descriptors at the end than after its
warm-up. (The full run, 8 clients for 5 minutes per engine, is ``make soak``.)"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from .conftest import KVCODEC, REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def soak(tmp_path_factory, settings):
    out = tmp_path_factory.mktemp("soak")
    cmd = [KVCODEC, "soak", "--engine", "transformers", "--home", str(out / "home"),
           "--model-cache", str(settings.model_cache), "--threads", "1", "--clients", "4", "--duration-s", "45",
           "--protocols", "grpc,http", "--contexts", "2", "--context-tokens", "300", "--sample-s", "3",
           "--warmup-s", "9", "--window-s", "15", "--json", str(out / "reliability.json"),
           "--plot", str(out / "reliability.png")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCODEC_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=REPO)
    assert (out / "reliability.json").is_file(), \
        f"kvcodec soak wrote nothing ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, json.loads((out / "reliability.json").read_text()), out


def test_every_answer_matches_and_nothing_fails(soak):
    proc, doc, _ = soak
    assert doc["errors"] == 0 and doc["wrong_answers"] == 0, doc["error_messages"]
    assert doc["reference_failures"] == []
    assert doc["requests"] >= 8 and doc["requests_per_s"] > 0
    assert doc["by_protocol"]["grpc"] > 0 and doc["by_protocol"]["http"] > 0
    assert set(doc["ttft"]) == {"grpc", "http"}
    modes = {mode for per in doc["ttft"].values() for mode in per}
    assert modes == {"prefill", "raw", "int8-zstd"}  # reuse on and off, both rungs read from the store
    # the exit code follows the verdict: 0 only with no error and a flat footprint
    assert proc.returncode == (0 if doc["flat"] else 1), proc.stdout[-2000:]


def test_no_process_or_fd_growth(soak):
    _, doc, _ = soak
    grown = doc["growth"]
    assert grown["processes"] == 0 and grown["fds"] <= 0, grown
    assert all(s["processes"] == 6 and s["zombies"] == 0 for s in doc["samples"])  # tritonserver, 4 stubs, decoder
    assert all(s["shm_regions"] == 4 and s["shm_bytes"] > 0 for s in doc["samples"])
    assert len(doc["samples"]) >= 12 and doc["samples"][-1]["t_s"] >= 42
    print(f"soak: {doc['requests']} requests, growth {grown}, flat {doc['flat']} {doc['not_flat']}")


def test_plot_written(soak):
    *_, out = soak
    assert (out / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
