"""The connector's metrics in ``vllm serve``: the families the Triton server exports (the ``llm``
step's and ``kv_fetch``'s, docs/operations.md "Metrics"), on vLLM's own ``/metrics``.

vLLM's API server and its engine core are two processes; the connector lives in the engine core,
the ``/metrics`` endpoint in the API server. The way across is vLLM's connector stats: each step the
scheduler asks the connector for what happened since it last asked
(``KVConnectorBase_V1.get_kv_connector_stats``), sends it with the step's stats, and the API
server's Prometheus logger hands it to the connector class's ``build_prom_metrics`` object. So:

- ``ConnectorMetrics`` (engine core) counts each finished read (``record(stats)``: requests by
  outcome, misses by reason, reused tokens, fetched bytes, fetch/decode/restore seconds) and the
  tokens vLLM's prefix cache held when the connector was asked (``local(n)``), and reads the
  write-back sink's counts and the store's breaker live (``attach``); ``interval()`` is the
  payload: ``{"counts": {"NAME|LABEL": increment}, "gauges": {...}, "observations": {NAME: [s]}}``;
- ``aggregate(a, b)`` and ``summary(data)`` are the payload's ``KVConnectorStats`` operations;
- ``PromFamilies`` (API server) makes ``FAMILIES`` with the metric classes and labels vLLM gives
  (``model_name``, ``engine``, then the family's own label) and applies each payload.

vLLM sends stats only when it logs them (not under ``--disable-log-stats``).
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional

from ..connector.writeback import CHUNK_COUNTS, COUNTS
from ..serving.stats import SECONDS_BUCKETS
from ..store.breaker import STATES

# name: (kind, help, the family's own label or None)
FAMILIES = {
    "kvcodec_requests_total": ("counter", "Connector reads finished, by outcome", "outcome"),
    "kvcodec_misses_total": ("counter", "Reads that stopped short, by reason", "reason"),
    "kvcodec_reused_tokens_total": ("counter", "Prompt tokens served from stored KV", None),
    "kvcodec_local_tokens_total": ("counter", "Prompt tokens vLLM's prefix cache held when the connector was "
                                   "asked (no fetch)", None),
    "kvcodec_fetched_bytes_total": ("counter", "KV chunk bytes fetched", None),
    "kvcodec_rung_bytes_total": ("counter", "Bytes of the chunks reused, by rung", "rung"),
    "kvcodec_rung_chunks_total": ("counter", "Chunks reused, by rung", "rung"),
    "kvcodec_reused_chunks_total": ("counter", "Chunks reused, by the key that verified them (current; "
                                    "previous: a key rotating)", "key"),
    "kvcodec_tier_chunks_total": ("counter", "Chunks reused, by the store tier that served them (remote; "
                                  "local: a local tier, KVCODEC_LOCAL_STORE)", "tier"),
    "kvcodec_fetch_seconds": ("histogram", "Store read seconds of a request", None),
    "kvcodec_decode_seconds": ("histogram", "Decode seconds of a request", None),
    "kvcodec_restore_seconds": ("histogram", "Restore seconds of a request", None),
    "kvcodec_writeback_total": ("counter", "Write-back jobs after a miss, by state", "state"),
    "kvcodec_writeback_pending": ("gauge", "Write-back jobs waiting or running", None),
    "kvcodec_writeback_chunks_total": ("counter", "Chunk copies written back, by outcome", "outcome"),
    "kvcodec_store_breaker_state": ("gauge", "The store's circuit breaker: 0 closed, 1 half-open, 2 open", None),
    "kvcodec_store_breaker_opens_total": ("counter", "Times the store's breaker opened", None),
    "kvcodec_store_calls": ("gauge", "Store calls of the connector's pool, by state", "state"),
}


def _key(name: str, label: str = "") -> str:
    return f"{name}|{label}" if label else name


class ConnectorMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = {}  # cumulative, by key
        self._sent: Dict[str, int] = {}  # what the last interval() had reached
        self._sent_gauges: Dict[str, float] = {}  # the gauges the last interval() carried
        self._observations: Dict[str, List[float]] = {}
        self._writeback: Optional[Callable[[], dict]] = None
        self._store: Optional[Callable[[], dict]] = None

    def attach(self, writeback: Optional[Callable[[], dict]] = None,
               store: Optional[Callable[[], dict]] = None) -> None:
        """Live sources read at each interval: the write-back sink's ``stats()`` and the store calls'
        ``snapshot()`` (breaker state, opens, calls by state)."""
        self._writeback, self._store = writeback, store

    def _add(self, key: str, n: int) -> None:
        self._counts[key] = self._counts.get(key, 0) + int(n)

    def local(self, tokens: int) -> None:
        with self._lock:
            self._add("kvcodec_local_tokens_total", tokens)

    def record(self, stats) -> None:
        """One finished read (``serving.stats.RequestStats``)."""
        with self._lock:
            self._add(_key("kvcodec_requests_total", stats.outcome), 1)
            if stats.miss_status:
                self._add(_key("kvcodec_misses_total", stats.miss_status), 1)
            self._add("kvcodec_reused_tokens_total", stats.reused_tokens)
            self._add("kvcodec_fetched_bytes_total", stats.bytes_fetched)
            for signer, n in stats.signers.items():
                self._add(_key("kvcodec_reused_chunks_total", signer), n)
            for tier, n in stats.tiers.items():
                self._add(_key("kvcodec_tier_chunks_total", tier), n)
            for chunk in stats.chunks:
                if chunk.get("status") == "ok" and chunk.get("scheme"):
                    self._add(_key("kvcodec_rung_bytes_total", chunk["scheme"]), int(chunk.get("bytes") or 0))
                    self._add(_key("kvcodec_rung_chunks_total", chunk["scheme"]), 1)
            for name, value in (("fetch", stats.fetch_s), ("decode", stats.decode_s), ("restore", stats.restore_s)):
                if value is not None:
                    self._observations.setdefault(f"kvcodec_{name}_seconds", []).append(float(value))

    def totals(self) -> Dict[str, int]:
        """Every count so far, the live sources' included (cumulative, by key)."""
        with self._lock:
            out = dict(self._counts)
        if self._writeback is not None:
            stats = self._writeback()
            out.update({_key("kvcodec_writeback_total", k): int(stats.get(k, 0)) for k in COUNTS})
            out.update({_key("kvcodec_writeback_chunks_total", k): int(stats.get(k, 0)) for k in CHUNK_COUNTS})
        if self._store is not None:
            out["kvcodec_store_breaker_opens_total"] = int(self._store()["opened"])
        return out

    def gauges(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        if self._writeback is not None:
            out["kvcodec_writeback_pending"] = float(self._writeback().get("pending", 0))
        if self._store is not None:
            snap = self._store()
            out["kvcodec_store_breaker_state"] = float(STATES[snap["breaker"]])
            out.update({_key("kvcodec_store_calls", k): float(snap[k]) for k in ("running", "queued", "abandoned")})
        return out

    def interval(self) -> dict:
        """What happened since the last call: count increments, the gauges now, the seconds observed."""
        totals = self.totals()
        with self._lock:
            counts = {}
            for key, n in totals.items():
                last = self._sent.get(key, 0)
                grown = n - last if n >= last else n  # a source that started again counts from its new value
                if grown:
                    counts[key] = grown
                self._sent[key] = n
            observations, self._observations = self._observations, {}
        gauges = self.gauges()
        with self._lock:
            # a gauge that moved is news even with nothing counted (write-back's pending falling to 0
            # after the last request): the interval is then not empty, and vLLM carries it
            moved, self._sent_gauges = gauges != self._sent_gauges, gauges
        return {"counts": counts, "gauges": gauges, "observations": observations, "gauges_moved": moved}


def is_empty(data: dict) -> bool:
    return not data.get("counts") and not data.get("observations") and not data.get("gauges_moved")


def aggregate(a: dict, b: dict) -> dict:
    """Two intervals as one (``b`` the later): increments summed, ``b``'s gauges, observations joined."""
    counts = dict(a.get("counts", {}))
    for key, n in b.get("counts", {}).items():
        counts[key] = counts.get(key, 0) + n
    observations = {k: list(v) for k, v in a.get("observations", {}).items()}
    for key, values in b.get("observations", {}).items():
        observations.setdefault(key, []).extend(values)
    return {"counts": counts, "gauges": {**a.get("gauges", {}), **b.get("gauges", {})}, "observations": observations,
            "gauges_moved": bool(a.get("gauges_moved") or b.get("gauges_moved"))}


def summary(data: dict) -> Dict[str, float]:
    """The interval in a few figures (vLLM's "KV Transfer metrics" log line)."""
    counts = data.get("counts", {})
    reads = sum(n for k, n in counts.items() if k.startswith("kvcodec_requests_total|"))
    return {"reads": reads, "reused_tokens": counts.get("kvcodec_reused_tokens_total", 0),
            "local_tokens": counts.get("kvcodec_local_tokens_total", 0),
            "fetched_mb": round(counts.get("kvcodec_fetched_bytes_total", 0) / 1e6, 3),
            "misses": sum(n for k, n in counts.items() if k.startswith("kvcodec_misses_total|"))}


class PromFamilies:
    """``FAMILIES`` made with vLLM's metric classes (``metric_types``: prometheus_client's Counter,
    Gauge, Histogram or vLLM's stand-ins) and labels; ``observe(data, engine_idx)`` applies one payload."""

    def __init__(self, metric_types: dict, labelnames: List[str], per_engine_labelvalues: Dict[int, list]) -> None:
        by_kind = {getattr(cls, "__name__", "").lower(): made for cls, made in metric_types.items()}
        self.per_engine = per_engine_labelvalues
        self.metrics = {}
        for name, (kind, what, label) in FAMILIES.items():
            labels = list(labelnames) + ([label] if label else [])
            if kind == "histogram":
                metric = by_kind["histogram"](name=name, documentation=what, labelnames=labels,
                                              buckets=list(SECONDS_BUCKETS))
            elif kind == "gauge":
                metric = by_kind["gauge"](name=name, documentation=what, labelnames=labels,
                                          multiprocess_mode="mostrecent")
            else:
                metric = by_kind["counter"](name=name, documentation=what, labelnames=labels)
            self.metrics[name] = metric

    def _labelled(self, key: str, engine_idx: int):
        name, _, label = key.partition("|")
        values = [str(v) for v in self.per_engine.get(engine_idx, [])] + ([label] if label else [])
        metric = self.metrics.get(name)
        return metric.labels(*values) if metric is not None else None

    def observe(self, data: dict, engine_idx: int = 0) -> None:
        for key, n in data.get("counts", {}).items():
            metric = self._labelled(key, engine_idx)
            if metric is not None and n > 0:
                metric.inc(n)
        for key, value in data.get("gauges", {}).items():
            metric = self._labelled(key, engine_idx)
            if metric is not None:
                metric.set(value)
        for key, values in data.get("observations", {}).items():
            metric = self._labelled(key, engine_idx)
            for value in values if metric is not None else ():
                metric.observe(value)
