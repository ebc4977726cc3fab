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
from kvcodec.engines import vllm_connector as vc  # noqa: E402

pytestmark = pytest.mark.vllm
C, BS = 256, 128


def scheduler_half() -> "vc.KVCodecConnector":
    """The connector's scheduler side without a vLLM config: the state its scheduler calls use."""
    half = object.__new__(vc.KVCodecConnector)
    half.core, half._attached = SchedulerCore(BS, C), []
    return half


def ask(half, session, defer=False, prompt=600):
    rid = f"r{id(session)}"
    vc.HANDOFF.post(rid, vc.Offer(session=session, chunk_tokens=C, defer=defer))
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
