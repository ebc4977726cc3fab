"""``RequestStats``: what one request did, in one typed record.

It is built once in the ``llm`` step from the request's ``ChunkInfo``s (``from_chunks``), completed
by ``serving.generate`` as tokens come, sent to the client as JSON (``to_dict``: the ``stats``
output of the first and last responses) and read by the metrics and the cost model. A field that
is not known yet (``None``) is left out of the JSON.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional

from .chunkinfo import ChunkInfo

# the buckets of every per-request seconds histogram (Triton's metrics and vllm serve's)
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

@dataclass
class Pipeline:
    """How the fetch, decode and restore stages overlapped (``overlap``)."""

    transfer_s: float = 0.0  # wall time during which some chunk was on the wire
    decode_s: float = 0.0  # decode seconds, all chunks
    restore_s: float = 0.0  # restore seconds, all chunks
    hidden_s: float = 0.0  # decode + restore seconds that ran while a transfer was going on
    hidden_fraction: float = 0.0  # hidden_s / (decode_s + restore_s)
    bound_s: float = 0.0  # the slowest stage's total: the pipeline's bound without compute
    slowest_stage: str = ""  # fetch | decode | restore
    bound_with_compute_s: Optional[float] = None  # bound_s + the first-token compute


@dataclass
class RequestStats:
    reused_tokens: int = 0  # prompt tokens served from stored KV
    chunks_planned: int = 0  # chunks the fetcher planned to fetch
    chunks_used: int = 0  # chunks that arrived, decoded and restored
    scheme: str = ""  # the first chunk's codec
    schemes: Dict[str, int] = field(default_factory=dict)  # chunks used, by codec
    signers: Dict[str, int] = field(default_factory=dict)  # chunks used, by the key that verified them
    # (current | previous: a key rotating, ``format.auth``)
    tiers: Dict[str, int] = field(default_factory=dict)  # chunks used, by the store tier that served
    # them (remote | local: a local tier in front of the store, ``store.tiered``)
    miss_reason: str = ""  # why reuse stopped short ('' when every planned chunk was used)
    bytes_fetched: int = 0  # chunk bytes read from the store
    fetch_s: float = 0.0  # seconds in store reads, all chunks
    decode_s: float = 0.0  # seconds decoding, all chunks
    restore_s: float = 0.0  # seconds restoring, all chunks
    t_request: Optional[float] = None  # wall clock when kv_fetch took the request
    pipeline: Pipeline = field(default_factory=Pipeline)
    chunks: List[dict] = field(default_factory=list)  # per chunk: index, status, scheme, bytes, stamps, choice
    store: Dict[str, Any] = field(default_factory=dict)  # kv_fetch's store as the request came: breaker
    # (closed | half-open | open), threads, running, queued, abandoned calls (``serving.calls``)
    prompt_tokens: Optional[int] = None  # tokens in the prompt
    computed_tokens: Optional[int] = None  # prompt tokens the engine computed
    compute_first_token_s: Optional[float] = None  # engine seconds to the first token
    server_ttft_s: Optional[float] = None  # wall clock from t_request to the first token
    generated_tokens: Optional[int] = None  # tokens generated (last response only)
    generate_s: Optional[float] = None  # engine seconds for all tokens (last response only)
    engine: Dict[str, float] = field(default_factory=dict)  # what the engine reports: load_s (restored KV
    # into its blocks), saved_chunks and save_copy_s (write-back), ... (engines that page their KV)
    final: Optional[bool] = None  # whether this is the last response's record

    @classmethod
    def from_chunks(cls, infos: List[ChunkInfo], reused_tokens: int, reason: str) -> "RequestStats":
        used = [i for i in infos if i.ok and i.count]
        schemes: Dict[str, int] = {}
        signers: Dict[str, int] = {}
        tiers: Dict[str, int] = {}
        for i in used:
            schemes[i.scheme] = schemes.get(i.scheme, 0) + 1
            signers[i.signer or "current"] = signers.get(i.signer or "current", 0) + 1
            tiers[i.tier or "remote"] = tiers.get(i.tier or "remote", 0) + 1
        return cls(
            reused_tokens=reused_tokens,
            chunks_planned=infos[0].count if infos else 0,
            chunks_used=len(used),
            scheme=infos[0].scheme if infos else "",
            schemes=schemes,
            signers=signers,
            tiers=tiers,
            miss_reason=reason,
            bytes_fetched=sum(i.bytes for i in infos),
            fetch_s=round(sum(i.s.get("fetch", 0.0) for i in infos), 6),
            decode_s=round(sum(i.s.get("decode", 0.0) for i in infos), 6),
            restore_s=round(sum(i.s.get("restore", 0.0) for i in infos), 6),
            t_request=min((i.t["request"] for i in infos if "request" in i.t), default=None),
            pipeline=overlap(infos),
            store=dict(infos[0].store) if infos else {},
            chunks=[{"index": i.index, "status": i.status, "scheme": i.scheme, "scheme_id": i.scheme_id,
                     "tier": i.tier, "bytes": i.bytes, "t": i.t, "s": i.s, "choice": i.choice, "reason": i.reason} for i in infos],
        )

    @property
    def miss_status(self) -> str:
        """Why reuse stopped, as one word (a metrics label): the first failed chunk's status
        (``timeout``, ``error``, ``corrupt``, ``foreign``, ``miss``, ``recompute``), ``none`` when
        nothing was stored or reuse was off, ``unusable`` when the engine refused the restored KV,
        '' when every planned chunk was used."""
        if not self.miss_reason:
            return ""
        failed = next((c["status"] for c in self.chunks if c.get("status") != "ok"), "")
        if failed:
            return failed
        return "unusable" if self.chunks_used else "none"

    @property
    def outcome(self) -> str:
        """reuse | partial | prefill (the metrics label)."""
        if self.reused_tokens:
            return "partial" if self.miss_reason else "reuse"
        return "prefill"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["pipeline"] = {k: v for k, v in d["pipeline"].items() if v is not None}
        return {k: v for k, v in d.items() if v is not None}


def _union(intervals: List[tuple]) -> List[tuple]:
    merged: List[list] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [tuple(m) for m in merged]


def _intersection(a: List[tuple], b: List[tuple]) -> float:
    total = 0.0
    for x0, x1 in a:
        for y0, y1 in b:
            total += max(0.0, min(x1, y1) - max(x0, y0))
    return total


def overlap(infos: List[ChunkInfo]) -> Pipeline:
    """How much of the decode and restore work ran while chunks were still on the wire.

    Intervals come from each chunk's wall-clock stamps: transfer ``[fetch_start, sent]``, decode
    ``[decoded - s.decode, decoded]``, restore ``[restored - s.restore, restored]``. ``hidden_s`` is
    the decode and restore time that fell inside some transfer; ``bound_s`` (the pipeline bound
    without the first-token compute) is the slowest stage's total.
    """
    used = [i for i in infos if i.count and "fetch_start" in i.t and "sent" in i.t]
    transfer = _union([(i.t["fetch_start"], i.t["sent"]) for i in used])
    work = []
    for i in used:
        for stamp, step in (("decoded", "decode"), ("restored", "restore")):
            if stamp in i.t and step in i.s:
                work.append((i.t[stamp] - i.s[step], i.t[stamp]))
    totals = {step: sum(i.s.get(step, 0.0) for i in used) for step in ("fetch", "decode", "restore")}
    work_s = totals["decode"] + totals["restore"]
    hidden = _intersection(_union(work), transfer)
    return Pipeline(
        transfer_s=round(sum(b - a for a, b in transfer), 6),
        decode_s=round(totals["decode"], 6),
        restore_s=round(totals["restore"], 6),
        hidden_s=round(hidden, 6),
        hidden_fraction=round(hidden / work_s, 4) if work_s else 0.0,
        bound_s=round(max(totals.values()), 6) if used else 0.0,
        slowest_stage=max(totals, key=totals.get) if used else "",
    )


@dataclass
class StreamReport:
    """What an engine says of one ``stream`` call. The engine fills it as it goes; ``serving.generate``
    reads what the engine took at the first token and the rest at the end (``RequestStats.engine``).
    A field left None was not said (``reused_tokens`` None: the engine took all the KV it was given)."""

    reused_tokens: Optional[int] = None  # tokens of the restored KV the engine took (a paged engine: whole blocks)
    promised_tokens: Optional[int] = None  # vllm: what the connector promised the scheduler
    staged_tokens: Optional[int] = None  # trtllm: restored tokens staged on the pool's device
    async_load: Optional[bool] = None  # vllm: the load ran beside the engine's steps
    load_s: Optional[float] = None  # vllm: seconds spent writing restored KV into blocks
    saved_chunks: Optional[int] = None  # full chunks of the prompt handed to write-back
    save_copy_s: Optional[float] = None  # vllm: seconds spent copying them out of blocks
    local_tokens: Optional[int] = None  # vllm: prompt tokens its own prefix cache held (not loaded, not computed)

    def engine_stats(self) -> Dict[str, Any]:
        """The fields said, but ``reused_tokens``."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "reused_tokens" and getattr(self, f.name) is not None}
