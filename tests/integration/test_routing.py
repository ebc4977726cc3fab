"""Prefix-aware routing across replicas (issue 43): a real nginx (``services.balancer.Balancer``) in
front of two OpenAI-style servers, driven by the long-document QA runner. The servers are stand-ins
(``tests.unit.test_workload.FakeServer``: they stream a deterministic answer and record each
request's ``X-KVCodec-Prefix`` header); the router is the feature. With ``routing="prefix"`` (nginx's
consistent hash of the header) every request of a document, warm-up and repeats, reaches one
replica, and the documents spread over both; round-robin splits a document's requests; the same
documents map to the same replicas after the router restarts (a hash, not a table). The real
replicas' local-tier hit rates under each policy are the bench's (``kvcodec bench workload
--replicas 2 --routing prefix|round-robin``, perf/results/workloads.json)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from kvcodec_client import route_key
from kvcodec_tools.ports import free_ports
from kvcodec_tools.services.balancer import Balancer
from kvcodec_tools.workload import LongDocConfig
from kvcodec_tools.workload_run import ROUTE_CHARS, OpenAITarget, run_long_doc_qa
from tests.unit.test_workload import FakeServer, Words

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CONFIG = LongDocConfig(documents=8, document_tokens=300, output_tokens=4, repeat_count=3, repeat_mode="random",
                       inflight=2)


def _run(tmp_path: Path, routing: str, servers, name: str = ""):
    """{document's route key: the replicas (0, 1) its measured requests reached} and the records."""
    for server in servers:
        server.routes.clear()
    backends = [(int(s.url.rsplit(":", 1)[1]),) * 2 for s in servers]
    http, grpc = free_ports(2)
    with Balancer(tmp_path / (routing + name), "127.0.0.1", http, grpc, backends, routing=routing,
                  grpc=False) as router:
        records, _ = run_long_doc_qa(OpenAITarget(f"http://{router.http_url}"), Words(), CONFIG, progress=False)
    reached = defaultdict(set)
    for replica, server in enumerate(servers):
        for header, prompt in server.routes:
            if header is not None and prompt != "Hello there, this is a warm-up request.":
                assert header == route_key(prompt[:ROUTE_CHARS])
                reached[header].add(replica)
    return reached, records


def test_prefix_routing_keeps_each_document_on_one_replica_and_round_robin_does_not(tmp_path):
    with FakeServer() as a, FakeServer() as b:
        prefix, records = _run(tmp_path, "prefix", (a, b))
        assert len(prefix) == CONFIG.documents and all(r.equal for r in records)
        assert all(len(replicas) == 1 for replicas in prefix.values()), dict(prefix)
        assert {next(iter(r)) for r in prefix.values()} == {0, 1}  # the documents spread over both replicas
        again, _ = _run(tmp_path, "prefix", (a, b), "-again")  # a new router: the same document, the same replica
        assert again == prefix
        spread, _ = _run(tmp_path, "round-robin", (a, b))
    assert sum(len(replicas) == 2 for replicas in spread.values()) >= CONFIG.documents // 2, dict(spread)
