"""Several servers, one store: two tritonservers (vLLM engine, each its own home, ports and cost
model) on one shared store (SeaweedFS S3, a 3-node Redis Cluster) behind the nginx ``Balancer``
(round-robin over their HTTP and gRPC ports).

Ingest through one (A's miss writes the prompt's chunks back), reuse through the other; both
write back the same new prefix at once (each chunk stored once: S3's conditional create / Redis SET
NX refuse the second copy, and it is whole); answers equal prefill's, through the balancer over gRPC and HTTP; the balancer spreads
requests over both servers. Runs in ``.venv-vllm`` (``make test-vllm``).
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is tested in its own venv: make test-vllm")

from kvcodec.engines import model_card  # noqa: E402
from kvcodec.format import container  # noqa: E402
from kvcodec.format.auth import load_auth  # noqa: E402
from kvcodec.format.codecs import get_scheme  # noqa: E402
from kvcodec.format.keys import chunk_keys  # noqa: E402
from kvcodec.settings import Settings  # noqa: E402
from kvcodec.store import open_store  # noqa: E402
from kvcodec_client import KVCodecClient  # noqa: E402
from kvcodec_tools.ports import free_port_run, free_ports  # noqa: E402
from kvcodec_tools.services.balancer import Balancer  # noqa: E402
from kvcodec_tools.services.redis import RedisCluster  # noqa: E402
from kvcodec_tools.services.seaweedfs import SeaweedS3  # noqa: E402
from kvcodec_tools.tritonserver import Ports, TritonServer  # noqa: E402

from .conftest import REPO, metric_values, text_of  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(1200)]

QUESTION = "\n\n# Question: what does this module do?\n# Answer:"
MAX_TOKENS = 8
PASSWORD = "scale-out-pw-0123456789"
MAX_HEADS = 24  # prompt heads tried before both servers must have been reached


@pytest.fixture(scope="module", params=["s3", "redis-cluster"])
def deployment(request, tmp_path_factory):
    """(store url, env, [server A, server B], balancer, [settings A, settings B])."""
    root = tmp_path_factory.mktemp(f"scale-{request.param}")
    if request.param == "s3":
        service = SeaweedS3(root / "s3", "127.0.0.1", "scale-key", "scale-secret-0123456789", bucket="scale")
        service.start(timeout_s=60)
        env = service.environ()
    else:
        service = RedisCluster(root / "redis", "127.0.0.1", free_port_run(3, offsets=(0, 10000)), PASSWORD, nodes=3)
        service.start(timeout_s=30)
        env = {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the servers inherit it; open_store here reads it
    key_file = root / "chunk.key"
    load_auth(key_file, env={})  # made once, shared: a chunk A signs is B's own
    settings, servers = [], []
    for name in ("a", "b"):
        s = Settings.load({"home": str(root / name), "model_cache": str(REPO / ".cache" / "models"), "threads": "1",
                           "ladder": "raw", "engine": "vllm", "writeback": "raw", "store": service.url,
                           "key_file": str(key_file),
                           # every reuse fetches: on a busy CPU the cost model may rightly recompute a chunk;
                           # and crosses the store (vLLM's own prefix cache off)
                           "adaptive": "0", "prefix_cache": "0"}, env={})
        settings.append(s)
        servers.append(TritonServer(REPO / "model_repository", s, Ports(*free_ports(3))))
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda srv: srv.start(timeout_s=600), servers))
        http, grpc = free_ports(2)
        balancer = Balancer(root / "balancer", "127.0.0.1", http, grpc,
                            [(srv.ports.http, srv.ports.grpc) for srv in servers]).start()
        try:
            yield service.url, servers, balancer, settings
        finally:
            balancer.stop()
    finally:
        for srv in servers:
            srv.stop()
        service.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def keys_of(settings, ids) -> list:
    card = model_card(settings)
    return chunk_keys(ids, card.model_id, get_scheme("raw").for_card(card).identity, settings.chunk_tokens)


def wait_stored(store, keys, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(store.exists(k) for k in keys):  # the write-back thread stores them
        assert time.monotonic() < deadline, "write-back did not store the chunks in time"
        time.sleep(0.2)


def successes(server) -> float:
    values = metric_values(f"http://127.0.0.1:{server.ports.metrics}/metrics", "nv_inference_request_success")
    return sum(values.values())


def test_ingest_through_one_reuse_through_the_other(deployment, tokenizer):
    url, (a, b), _, (sa, _sb) = deployment
    ids = tokenizer.encode(text_of(tokenizer, "shlex.py", 540) + QUESTION)
    first = KVCodecClient(a.grpc_url, "grpc").generate(ids, MAX_TOKENS, reuse=True)
    assert first.reused_tokens == 0 and first.stats["engine"]["saved_chunks"] == 2
    with open_store(url) as store:
        wait_stored(store, keys_of(sa, ids))
    second = KVCodecClient(b.grpc_url, "grpc").generate(ids, MAX_TOKENS, reuse=True)
    assert second.reused_tokens == 512 and second.stats["scheme"] == "raw"
    prefill = KVCodecClient(b.grpc_url, "grpc").generate(ids, MAX_TOKENS, reuse=False)
    assert second.tokens == prefill.tokens == first.tokens


def chunk_outcomes(servers, tokenizer) -> dict:
    """``kvcodec_writeback_chunks_total`` summed over ``servers`` by outcome (written, present), after
    a request shorter than a chunk to each (metrics are brought up to date as a request ends)."""
    short = tokenizer.encode("# a line")
    out = {"written": 0.0, "present": 0.0}
    for srv in servers:
        KVCodecClient(srv.grpc_url, "grpc").generate(short, 1, reuse=False)
        values = metric_values(f"http://127.0.0.1:{srv.ports.metrics}/metrics", "kvcodec_writeback_chunks_total")
        for name, value in values.items():
            for outcome in out:
                if f'outcome="{outcome}"' in name:
                    out[outcome] += value
    return out


def test_both_write_back_the_same_prefix_at_once(deployment, tokenizer):
    """Both servers miss on one prompt at once and write its chunks back: every chunk is stored
    once across the two (the store's create refuses, or the look before encoding finds, the other's
    copy: ``written`` adds up to the chunk count, not twice it), whole and verifying."""
    url, (a, b), balancer, (sa, sb) = deployment
    ids = tokenizer.encode(text_of(tokenizer, "textwrap.py", 540) + QUESTION)
    keys = keys_of(sa, ids)
    before = chunk_outcomes((a, b), tokenizer)
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda srv: KVCodecClient(srv.grpc_url, "grpc").generate(ids, MAX_TOKENS, reuse=True),
                                (a, b)))
    assert [r.reused_tokens for r in answers] == [0, 0]
    assert [r.stats["engine"]["saved_chunks"] for r in answers] == [len(keys)] * 2
    assert answers[0].tokens == answers[1].tokens
    auth = load_auth(sa.key_file, env={})
    with open_store(url) as store:
        wait_stored(store, keys)
        deadline = time.monotonic() + 60
        while True:  # until both servers' write-back has handled every chunk
            now = chunk_outcomes((a, b), tokenizer)
            done = {k: now[k] - before[k] for k in now}
            if done["written"] + done["present"] >= 2 * len(keys) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert done == {"written": len(keys), "present": len(keys)}, done
        for key in keys:  # each chunk whole: parses, verifies with the shared key
            parsed = container.parse(store.get(key), auth)
            assert parsed.header, key
    for protocol, address in (("grpc", balancer.grpc_url), ("http", balancer.http_url)):
        client = KVCodecClient(address, protocol)
        reused = client.generate(ids, MAX_TOKENS, reuse=True)
        prefill = client.generate(ids, MAX_TOKENS, reuse=False)
        assert reused.reused_tokens == 512, (protocol, reused.stats.get("miss_reason"), reused.stats)
        assert reused.tokens == prefill.tokens == answers[0].tokens, protocol


def test_the_balancer_spreads_requests_and_each_server_keeps_its_cost_model(deployment, tokenizer):
    _, servers, balancer, settings = deployment
    ids = tokenizer.encode(text_of(tokenizer, "fnmatch.py", 300) + QUESTION)
    before = [successes(s) for s in servers]
    costs = [Path(s.home) / "costs.json" for s in settings]
    for protocol, address in (("grpc", balancer.grpc_url), ("http", balancer.http_url)):
        client = KVCodecClient(address, protocol)
        answers = [client.generate(ids, MAX_TOKENS, reuse=True) for _ in range(4)]
        assert all(r.tokens == answers[0].tokens for r in answers), protocol
    after = [successes(s) for s in servers]
    assert all(x > y for x, y in zip(after, before, strict=True)), (before, after)
    assert all(p.is_file() for p in costs), costs
    assert costs[0].resolve() != costs[1].resolve()
    assert all(p.stat().st_size > 0 for p in costs)


def test_a_prefix_router_sends_one_prompt_head_to_one_server_over_grpc_and_http(deployment, tokenizer, tmp_path):
    """nginx's consistent hash of ``X-KVCodec-Prefix`` (``Balancer(routing="prefix")``), which
    ``KVCodecClient.generate(route=...)`` sets (gRPC: as metadata): every request with one head lands
    on one server; heads spread over both (without the header, the round-robin balancer above
    spreads one prompt's requests over both). The ring is built from the servers' addresses (random
    ports here), so how many heads it takes to reach both varies: heads are tried until both are
    reached, up to ``MAX_HEADS`` (never reaching one of two servers on a balanced ring: 2^-23)."""
    _, servers, _, _ = deployment
    http, grpc = free_ports(2)
    body = tokenizer.encode(text_of(tokenizer, "fnmatch.py", 120))
    question, landed = tokenizer.encode(QUESTION), {}
    with Balancer(tmp_path / "router", "127.0.0.1", http, grpc, [(s.ports.http, s.ports.grpc) for s in servers],
                  routing="prefix") as router:
        for protocol, address in (("grpc", router.grpc_url), ("http", router.http_url)):
            client = KVCodecClient(address, protocol)
            for i in range(MAX_HEADS):
                head = tokenizer.encode(f"# group {i}\n") + body
                before = [successes(s) for s in servers]
                for _ in range(3):
                    client.generate(head + question, 1, reuse=False, route=head)
                grew = [x > y for x, y in zip((successes(s) for s in servers), before, strict=True)]
                assert sum(grew) == 1, (protocol, i, grew)  # all three on one server
                landed[(protocol, i)] = grew.index(True)
                if i >= 2 and {landed[(protocol, k)] for k in range(i + 1)} == {0, 1}:
                    break
    for protocol in ("grpc", "http"):
        assert {v for (p, _), v in landed.items() if p == protocol} == {0, 1}, landed  # heads spread over both
