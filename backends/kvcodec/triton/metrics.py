"""The ``llm`` step's Prometheus metrics, through ``pb_utils.MetricFamily`` (Triton's metrics endpoint).

``LlmMetrics()`` (made once, in ``initialize``; every family is kept for the model's life: a deleted
family fails its metrics' updates): ``record(stats)`` at the end of each request (``RequestStats``),
``writeback(engine)`` (the engine's ``writeback_stats()`` as counter increments and a gauge),
``cancelled()``. Calls go through the caller's lock: the stub's shared-memory allocator is not
thread-safe. The families are listed in docs/operations.md, "Metrics".
"""
import triton_python_backend_utils as pb_utils

from ..connector.writeback import CHUNK_COUNTS, COUNTS, Increments
from ..serving.stats import SECONDS_BUCKETS


class LlmMetrics:
    """Prometheus metrics on the server's metrics endpoint: requests by outcome and by why reuse
    stopped, reused tokens, fetched bytes, and histograms of each request's TTFT (server side) and
    of its fetch, decode and restore seconds; the engine's write-back counts by state and the jobs
    pending, brought up to date at the end of each request (docs/operations.md, "Metrics")."""

    def __init__(self):
        counter = pb_utils.MetricFamily.COUNTER
        histogram = pb_utils.MetricFamily.HISTOGRAM
        self.misses = pb_utils.MetricFamily("kvcodec_misses_total", "Requests whose reuse stopped short, by reason",
                                            counter)
        self._by_reason = {}
        self._seconds = {}
        for name, what in (("ttft", "Server time to first token"), ("fetch", "Store read seconds of a request"),
                           ("decode", "Decode seconds of a request"), ("restore", "Restore seconds of a request")):
            family = pb_utils.MetricFamily(f"kvcodec_{name}_seconds", what, histogram)
            self._seconds[name] = (family, family.Metric(labels={}, buckets=list(SECONDS_BUCKETS)))
        self.requests = pb_utils.MetricFamily("kvcodec_requests_total", "Requests answered, by outcome", counter)
        self.tokens = pb_utils.MetricFamily("kvcodec_reused_tokens_total", "Prompt tokens served from stored KV",
                                            counter)
        self.bytes = pb_utils.MetricFamily("kvcodec_fetched_bytes_total", "KV chunk bytes fetched", counter)
        self.rung_bytes = pb_utils.MetricFamily("kvcodec_rung_bytes_total", "Bytes of the chunks reused, by rung",
                                                counter)
        self.rung_chunks = pb_utils.MetricFamily("kvcodec_rung_chunks_total", "Chunks reused, by rung", counter)
        self._by_rung = {}
        self.signers = pb_utils.MetricFamily("kvcodec_reused_chunks_total", "Chunks reused, by the key that "
                                             "verified them (current; previous: a key rotating)", counter)
        self._by_signer = {}
        self.tiers = pb_utils.MetricFamily("kvcodec_tier_chunks_total", "Chunks reused, by the store tier that "
                                           "served them (remote; local: a local tier, KVCODEC_LOCAL_STORE)", counter)
        self._by_tier = {}
        self._by_outcome = {}
        # a MetricFamily must outlive its metrics (a deleted family fails their updates): each is kept
        self.cancels = pb_utils.MetricFamily("kvcodec_cancelled_total",
                                             "Requests whose client went away before the last token", counter)
        self._cancelled = self.cancels.Metric(labels={})
        self._tokens = self.tokens.Metric(labels={})
        self._bytes = self.bytes.Metric(labels={})
        self.saves = pb_utils.MetricFamily("kvcodec_writeback_total", "Write-back jobs after a miss, by state "
                                           "(queued, stored, dropped: queue full, failed: the store refused, skipped: "
                                           "the store kept out by the write-back breaker)", counter)
        self._saves = {state: self.saves.Metric(labels={"state": state}) for state in COUNTS}
        self.pending = pb_utils.MetricFamily("kvcodec_writeback_pending", "Write-back jobs waiting or running",
                                             pb_utils.MetricFamily.GAUGE)
        self._pending = self.pending.Metric(labels={})
        self._save_increments = Increments()
        self.chunks = pb_utils.MetricFamily("kvcodec_writeback_chunks_total",
                                            "Chunk copies (one per rung) written back, by outcome (written: "
                                            "by this server; present: another writer had stored it first)", counter)
        self._chunks = {outcome: self.chunks.Metric(labels={"outcome": outcome}) for outcome in CHUNK_COUNTS}
        self._chunk_increments = Increments(CHUNK_COUNTS)

    def writeback(self, engine):
        stats = engine.writeback_stats()
        if not stats:
            return
        for state, n in self._save_increments.since(stats).items():
            if n:
                self._saves[state].increment(n)
        for outcome, n in self._chunk_increments.since(stats).items():
            if n:
                self._chunks[outcome].increment(n)
        self._pending.set(float(stats.get("pending", 0)))

    def cancelled(self):
        self._cancelled.increment(1)

    def record(self, stats):
        outcome = stats.outcome
        if outcome not in self._by_outcome:
            self._by_outcome[outcome] = self.requests.Metric(labels={"outcome": outcome})
        self._by_outcome[outcome].increment(1)
        self._tokens.increment(int(stats.reused_tokens))
        self._bytes.increment(int(stats.bytes_fetched))
        for chunk in stats.chunks:
            rung = chunk.get("scheme")
            if chunk.get("status") != "ok" or not rung:
                continue
            if rung not in self._by_rung:
                self._by_rung[rung] = (self.rung_bytes.Metric(labels={"rung": rung}),
                                       self.rung_chunks.Metric(labels={"rung": rung}))
            self._by_rung[rung][0].increment(int(chunk.get("bytes") or 0))
            self._by_rung[rung][1].increment(1)
        for family, by, label, counts in ((self.signers, self._by_signer, "key", stats.signers),
                                          (self.tiers, self._by_tier, "tier", stats.tiers)):
            for value, n in counts.items():
                if value not in by:
                    by[value] = family.Metric(labels={label: value})
                by[value].increment(int(n))
        reason = stats.miss_status
        if reason:
            if reason not in self._by_reason:
                self._by_reason[reason] = self.misses.Metric(labels={"reason": reason})
            self._by_reason[reason].increment(1)
        for name, value in (("ttft", stats.server_ttft_s), ("fetch", stats.fetch_s), ("decode", stats.decode_s),
                            ("restore", stats.restore_s)):
            if value is not None:
                self._seconds[name][1].observe(float(value))
