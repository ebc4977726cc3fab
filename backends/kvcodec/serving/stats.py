"""``RequestStats``: what one request did, in one typed record.

It is built once in the ``llm`` step from the request's ``ChunkInfo``s (``from_chunks``), completed
by ``serving.generate`` as tokens come, sent to the client as JSON (``to_dict``: the ``stats``
output of the first and last responses) and read by the metrics and the cost model. A field that
is not known yet (``None``) is left out of the JSON.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from .chunkinfo import ChunkInfo


@dataclass
class Pipeline:
    """How the fetch, decode and restore stages overlapped (see ``serving.assemble.overlap``)."""

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
    miss_reason: str = ""  # why reuse stopped short ('' when every planned chunk was used)
    bytes_fetched: int = 0  # chunk bytes read from the store
    fetch_s: float = 0.0  # seconds in store reads, all chunks
    decode_s: float = 0.0  # seconds decoding, all chunks
    restore_s: float = 0.0  # seconds restoring, all chunks
    t_request: Optional[float] = None  # wall clock when kv_fetch took the request
    pipeline: Pipeline = field(default_factory=Pipeline)
    chunks: List[dict] = field(default_factory=list)  # per chunk: index, status, scheme, bytes, stamps, choice
    prompt_tokens: Optional[int] = None  # tokens in the prompt
    computed_tokens: Optional[int] = None  # prompt tokens the engine computed
    compute_first_token_s: Optional[float] = None  # engine seconds to the first token
    server_ttft_s: Optional[float] = None  # wall clock from t_request to the first token
    generated_tokens: Optional[int] = None  # tokens generated (last response only)
    generate_s: Optional[float] = None  # engine seconds for all tokens (last response only)
    final: Optional[bool] = None  # whether this is the last response's record

    @classmethod
    def from_chunks(cls, infos: List[ChunkInfo], reused_tokens: int, reason: str) -> "RequestStats":
        from .assemble import overlap

        used = [i for i in infos if i.ok and i.count]
        schemes: Dict[str, int] = {}
        for i in used:
            schemes[i.scheme] = schemes.get(i.scheme, 0) + 1
        return cls(
            reused_tokens=reused_tokens,
            chunks_planned=infos[0].count if infos else 0,
            chunks_used=len(used),
            scheme=infos[0].scheme if infos else "",
            schemes=schemes,
            miss_reason=reason,
            bytes_fetched=sum(i.bytes for i in infos),
            fetch_s=round(sum(i.s.get("fetch", 0.0) for i in infos), 6),
            decode_s=round(sum(i.s.get("decode", 0.0) for i in infos), 6),
            restore_s=round(sum(i.s.get("restore", 0.0) for i in infos), 6),
            t_request=min((i.t["request"] for i in infos if "request" in i.t), default=None),
            pipeline=overlap(infos),
            chunks=[{"index": i.index, "status": i.status, "scheme": i.scheme, "scheme_id": i.scheme_id,
                     "bytes": i.bytes, "t": i.t, "s": i.s, "choice": i.choice, "reason": i.reason} for i in infos],
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
