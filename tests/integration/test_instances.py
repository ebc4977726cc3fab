"""Steps with several instances, under concurrent clients: a real tritonserver on a repository
rendered with ``kvcodec repository --instances kv_fetch=2,kv_decode=2,kv_restore=2`` (llm stays
one instance: a request's chunks meet in it, see ``model_repository/llm/1/model.py``), asked by
8 clients at once over gRPC and HTTP, reuse and prefill mixed; every answer equals the same request
made alone, nothing stays queued, and every instance served: each stub's CPU time under the load
(the scheduler's per-thread account) is well above what it spends idle over as long."""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from kvcodec_client import KVCodecClient
from kvcodec_tools.ports import free_ports
from kvcodec_tools.procstats import stub_pids
from kvcodec_tools.repository import render
from kvcodec_tools.tritonserver import Ports, TritonServer

from .conftest import REPO, ingested_home, text_of
from .test_faults import own_server, pending

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
QUESTION = "\n# What does this module do?\n"
INSTANCES = {"kv_fetch": 2, "kv_decode": 2, "kv_restore": 2}
TOKENS = 6


@pytest.fixture(scope="module")
def scaled(settings, tokenizer, tmp_path_factory):
    home = tmp_path_factory.mktemp("instances-home")
    local, stored = ingested_home(settings, tokenizer, home)
    repository = render(REPO / "model_repository", home / "repository", "cpu", instances=INSTANCES)
    with own_server(local, "instances", repository) as (server, metrics):
        yield server, metrics, {
            "stored": tokenizer.encode(stored + QUESTION),  # 3 stored chunks
            "new": tokenizer.encode(text_of(tokenizer, "heapq.py", 400) + QUESTION),  # nothing stored
        }


IDLE_S = 3.0  # the window that measures what a stub spends idle (a timer wakes it about once a second)
BUSY_OVER_IDLE = 3.0  # an instance that served requests spent this many times its idle CPU, at least
BUSY_MIN_MS = 8.0  # and at least this (one request costs kv_fetch ~10 ms here; an idle stub ~0.1 ms/s)


def _cpu_ms(pid: int) -> float:
    """The CPU time of all the process's threads, in ms: the scheduler's nanosecond account
    (``/proc/PID/task/*/schedstat``), not ``stat``'s 10 ms ticks, which a kv_fetch serving a few
    requests barely moves."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e6


def _cpu_over(stubs: dict, run) -> tuple:
    """({instance: CPU ms of its stub while ``run()`` ran}, seconds it ran)."""
    before, t0 = {name: _cpu_ms(pid) for name, pid in stubs.items()}, time.monotonic()
    run()
    return {name: round(_cpu_ms(pid) - before[name], 2) for name, pid in sorted(stubs.items())}, time.monotonic() - t0


def test_several_instances_of_each_step_answer_concurrent_clients_as_alone(scaled):
    server, metrics, prompts = scaled
    stubs = stub_pids(server.pid)
    assert set(stubs) == {f"{step}_0_{i}" for step, n in INSTANCES.items() for i in range(n)} | {"llm_0_0"}, stubs
    urls = {"grpc": server.grpc_url, "http": server.http_url}
    asks = [(protocol, prompt, reuse) for protocol in urls for prompt, reuse in
            (("stored", True), ("stored", False), ("new", True))]

    def ask(spec):
        protocol, prompt, reuse = spec
        return KVCodecClient(urls[protocol], protocol, timeout_s=300).generate(prompts[prompt], TOKENS, reuse=reuse)

    alone = {spec: ask(spec) for spec in asks}
    for (protocol, prompt, reuse), result in alone.items():
        assert result.reused_tokens == (768 if prompt == "stored" and reuse else 0), (protocol, prompt, reuse)
    idle, idle_s = _cpu_over(stubs, lambda: time.sleep(IDLE_S))  # measured, not assumed: nothing runs
    load = asks * 2  # 12 requests, 8 at a time
    together = []

    def run_load():
        with ThreadPoolExecutor(max_workers=8) as pool:
            together.extend(pool.map(ask, load))

    busy, busy_s = _cpu_over(stubs, run_load)
    for spec, result in zip(load, together, strict=True):
        assert (result.tokens, result.reused_tokens) == (alone[spec].tokens, alone[spec].reused_tokens), spec
    print(f"CPU ms per stub: idle {idle} in {idle_s:.1f} s; under the load {busy} in {busy_s:.1f} s")
    for name in stubs:  # every instance served: a stub left out would spend about its idle rate
        floor = max(BUSY_MIN_MS, BUSY_OVER_IDLE * idle[name] / idle_s * busy_s)
        assert busy[name] > floor, (name, busy[name], floor, busy)
    assert all(v == 0 for v in pending(metrics).values())
    assert set(stub_pids(server.pid)) == set(stubs)  # every instance still there


def test_llm_as_several_instances_does_not_load(settings, tmp_path):
    """Rendering refuses ``llm=2`` (unit-tested); a repository edited by hand to two llm instances
    makes the llm model refuse to load, so the server does not start, and its log says why."""
    from kvcodec_tools.procs import ServiceError

    repository = render(REPO / "model_repository", tmp_path / "repository", "cpu")
    config = repository / "llm" / "config.pbtxt"
    text = config.read_text()
    assert text.count("count: 1") == 1
    config.write_text(text.replace("count: 1", "count: 2"))
    http_port, grpc_port, metrics = free_ports(3)
    server = TritonServer(repository, replace(settings, home=tmp_path), Ports(http_port, grpc_port, metrics),
                          log_path=tmp_path / "server.log")
    try:
        with pytest.raises(ServiceError):
            server.start(timeout_s=300)
    finally:
        server.stop()
    assert "llm runs as one instance, got 2" in (tmp_path / "server.log").read_text(errors="replace")
