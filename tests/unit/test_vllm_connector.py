"""The vLLM connector's scheduler answers from a request's load session (vLLM's own classes, in its
venv: ``make test-vllm``): an asynchronous load of what the session can still deliver while chunks
are coming, "ask again later" in the deferred mode, a synchronous load once settled, nothing when
the first chunk failed."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is tested in its own venv: make test-vllm")

from kvcodec.connector import LoadSession, SchedulerCore  # noqa: E402
from kvcodec.connector.handoff import Offer  # noqa: E402
from kvcodec.connector.standalone import OwnOffers  # noqa: E402
from kvcodec.engines import vllm_connector as vc  # noqa: E402

pytestmark = pytest.mark.vllm
C, BS = 256, 128


def scheduler_half() -> "vc.KVCodecConnector":
    """The connector's scheduler side without a vLLM config: the state its scheduler calls use."""
    half = object.__new__(vc.KVCodecConnector)
    half.core, half._attached, half.standalone = SchedulerCore(BS, C), [], None
    return half


def ask(half, session, defer=False, prompt=600):
    rid = f"r{id(session)}"
    vc.HANDOFF.post(rid, Offer(session=session, chunk_tokens=C, defer=defer))
    try:
        return half.get_num_new_matched_tokens(SimpleNamespace(request_id=rid + "-abcdefgh",
                                                               prompt_token_ids=list(range(prompt))), 0)
    finally:
        vc.HANDOFF.pop(rid)


def test_the_answer_follows_the_session():
    half = scheduler_half()
    chunk = np.zeros((1, 2, 1, C, 8), np.float16)
    coming = LoadSession(C, 2)
    coming.put(0, chunk)
    assert ask(half, coming) == (512, True)  # asynchronous: blocks now, chunks as they come
    assert ask(half, coming, defer=True) == (None, False)  # ask again at the next step
    coming.put(1, chunk)
    assert ask(half, coming, defer=True) == (512, False)  # settled: one synchronous load
    failed = LoadSession(C, 2)
    failed.fail(0, "corrupt")
    assert ask(half, failed) == (0, False) and ask(half, failed, defer=True) == (0, False)
    short = LoadSession(C, 2)
    short.fail(1, "missing")
    assert ask(half, short) == (256, True)  # only what can still come is promised


# -- standalone (vllm serve): the connector's own offers ---------------------------------------------
class _Reads:
    """A read path whose plan the test releases."""

    def __init__(self, session):
        import threading

        self.started, self.session = [], session
        self.reading = SimpleNamespace(ready=threading.Event(), session=session)
        self.fetcher = SimpleNamespace(calls=SimpleNamespace(snapshot=lambda: {  # StoreCalls.snapshot()
            "breaker": "closed", "opened": 0, "threads": 1, "running": 0, "queued": 0, "abandoned": 0}))

    def start(self, ids, salt=""):  # ReadPath.start(ids, salt)
        self.started.append(list(ids))
        return self.reading


def standalone_half(session, sink=None):
    half = scheduler_half()
    alone = OwnOffers(_Reads(session), sink, vc.HANDOFF, C, vc.vllm_metrics.ConnectorMetrics())
    half.standalone = alone
    return half, alone


def test_standalone_asks_again_until_the_plan_is_known_then_loads_as_chunks_arrive():
    session = LoadSession(C, 2)
    half, alone = standalone_half(session)
    request = SimpleNamespace(request_id="cmpl-1-0", prompt_token_ids=list(range(600)))
    assert half.get_num_new_matched_tokens(request, 0) == (None, False)  # planning: ask again
    assert half.get_num_new_matched_tokens(request, 0) == (None, False)
    assert alone.reads.started == [list(range(600))]  # one read per request
    alone.reads.reading.ready.set()
    assert half.get_num_new_matched_tokens(request, 0) == (512, True)  # chunks still coming: asynchronous
    half.request_finished(request, [])
    assert vc.HANDOFF.get("cmpl-1-0") is None  # its own offer goes with the request


def test_standalone_reads_nothing_for_a_prefix_vllm_already_holds():
    half, alone = standalone_half(LoadSession(C, 2))
    request = SimpleNamespace(request_id="cmpl-2-0", prompt_token_ids=list(range(600)))
    assert half.get_num_new_matched_tokens(request, 512) == (0, False)  # the local tier holds both chunks
    assert alone.reads.started == [] and alone.counters["local_tokens"] == 512
    stats = half.get_kv_connector_stats()  # what vLLM carries to its /metrics
    assert stats.data["counts"] == {"kvcodec_local_tokens_total": 512} and half.get_kv_connector_stats() is None
    half.request_finished(request, [])


def test_standalone_with_nothing_stored_computes():
    half, alone = standalone_half(None)
    alone.reads.reading.ready.set()
    request = SimpleNamespace(request_id="cmpl-3-0", prompt_token_ids=list(range(600)))
    assert half.get_num_new_matched_tokens(request, 0) == (0, False)
    half.request_finished(request, [])
