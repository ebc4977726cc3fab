"""The connector's metrics in ``vllm serve`` (``kvcodec.engines.vllm_metrics``) below vLLM: what a
read, a local hit, the sink and the breaker put in each interval's payload, two intervals as one,
and the payload applied to Prometheus families (prometheus_client's own classes when installed);
the real ``/metrics`` of a real server is read in tests/integration/test_vllm_serve.py."""
from __future__ import annotations

import pytest

from kvcodec.engines.vllm_metrics import FAMILIES, ConnectorMetrics, PromFamilies, aggregate, is_empty, summary
from kvcodec.serving.stats import RequestStats


def _metrics(sink: dict, breaker: str = "closed", opened: int = 0) -> ConnectorMetrics:
    m = ConnectorMetrics()
    m.attach(writeback=lambda: sink,
             store=lambda: {"breaker": breaker, "opened": opened, "running": 1, "queued": 0, "abandoned": 0})
    return m


def test_intervals_carry_what_happened_since_the_last():
    sink = {"queued": 3, "stored": 2, "dropped": 1, "failed": 0, "pending": 1, "written": 4, "present": 0}
    m = _metrics(sink)
    m.record(RequestStats(reused_tokens=512, bytes_fetched=1000, fetch_s=0.2, decode_s=0.03, restore_s=0.002,
                          chunks=[{"status": "ok", "scheme": "kvtc-w", "bytes": 600},
                                  {"status": "ok", "scheme": "raw", "bytes": 400}]))
    m.record(RequestStats(reused_tokens=256, bytes_fetched=500, fetch_s=0.1, miss_reason="chunk 1: foreign",
                          chunks=[{"status": "ok"}, {"status": "foreign"}]))
    m.local(768)
    first = m.interval()
    c = first["counts"]
    assert c["kvcodec_requests_total|reuse"] == 1 and c["kvcodec_requests_total|partial"] == 1
    assert c["kvcodec_misses_total|foreign"] == 1
    assert (c["kvcodec_reused_tokens_total"], c["kvcodec_local_tokens_total"]) == (768, 768)
    assert c["kvcodec_fetched_bytes_total"] == 1500 and c["kvcodec_writeback_total|dropped"] == 1
    assert (c["kvcodec_rung_bytes_total|kvtc-w"], c["kvcodec_rung_chunks_total|raw"]) == (600, 1)
    assert first["observations"]["kvcodec_fetch_seconds"] == [0.2, 0.1]
    assert first["gauges"]["kvcodec_writeback_pending"] == 1 and first["gauges"]["kvcodec_store_breaker_state"] == 0
    assert is_empty(m.interval())  # nothing new: no increments, no observations
    sink.update(pending=0)  # write-back caught up after the last request: only a gauge moved
    moved = m.interval()
    assert not is_empty(moved) and moved["gauges"]["kvcodec_writeback_pending"] == 0
    assert is_empty(m.interval())
    sink.update(stored=5)
    m.record(RequestStats(miss_reason="nothing stored"))
    third = m.interval()
    assert third["counts"] == {"kvcodec_writeback_total|stored": 3, "kvcodec_requests_total|prefill": 1,
                               "kvcodec_misses_total|none": 1}
    both = aggregate(first, third)
    assert both["counts"]["kvcodec_writeback_total|stored"] == 5
    assert summary(both)["reads"] == 3 and summary(both)["misses"] == 2


def test_breaker_opening_is_a_gauge_and_a_count():
    m = _metrics({}, breaker="open", opened=2)
    data = m.interval()
    assert data["gauges"]["kvcodec_store_breaker_state"] == 2
    assert data["counts"]["kvcodec_store_breaker_opens_total"] == 2


@pytest.mark.vllm  # prometheus_client: in the vLLM venv
def test_payload_applied_to_prometheus_families():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()

    def bound(cls):  # as vLLM's classes, but on a registry of the test's own
        return lambda **kw: cls(registry=registry, **{k: v for k, v in kw.items() if k != "multiprocess_mode"})

    types = {c: bound(c) for c in (prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram)}
    families = PromFamilies(types, ["model_name", "engine"], {0: ["m", "0"]})
    m = _metrics({"queued": 1, "stored": 1, "pending": 0, "written": 2})
    m.record(RequestStats(reused_tokens=256, bytes_fetched=9, fetch_s=0.05))
    families.observe(m.interval(), 0)
    get = registry.get_sample_value
    assert get("kvcodec_reused_tokens_total", {"model_name": "m", "engine": "0"}) == 256
    assert get("kvcodec_requests_total", {"model_name": "m", "engine": "0", "outcome": "reuse"}) == 1
    assert get("kvcodec_fetch_seconds_count", {"model_name": "m", "engine": "0"}) == 1
    assert get("kvcodec_store_breaker_state", {"model_name": "m", "engine": "0"}) == 0
    assert len(FAMILIES) == len({n.removesuffix("_total") for n in FAMILIES})
