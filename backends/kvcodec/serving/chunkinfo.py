"""``ChunkInfo``: the small record that travels with each chunk through the serving steps.

It says which request (``session``) a chunk belongs to, its place (``index`` of ``count``), its
status, and the timestamps and seconds each step spent on it. Over Triton it travels as one JSON
string. ``count == 0`` marks a request with nothing to reuse (one record is still sent, so the
model step runs).

Status values: ``ok``; ``none`` (nothing stored or reuse disabled); ``miss`` (gone between lookup
and fetch); ``recompute`` (the fetcher found computing the rest faster than fetching it);
``timeout`` (the store did not answer within the request's fetch deadline); ``corrupt`` (checksum,
header or decode failed); ``foreign`` (not signed with this deployment's key, another model, codec
or key); ``error`` (anything else on the server). Anything but ``ok`` is a miss from that chunk on.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict

from ..errors import BadRequest

OK = "ok"


@dataclass
class ChunkInfo:
    session: str
    index: int
    count: int
    status: str = OK
    reason: str = ""
    scheme: str = ""
    scheme_id: str = ""  # the scheme's full identity (name, versions, settings)
    key: str = ""
    bytes: int = 0
    token_start: int = 0
    tokens: int = 0
    choice: str = ""  # the adaptive fetcher's estimates, best first, for this chunk
    signer: str = ""  # the key that verified the chunk (kv_decode): current, or previous (format.auth)
    tier: str = ""  # the store's tier that served it: remote, or local (a local tier, store.tiered)
    t: Dict[str, float] = field(default_factory=dict)  # wall-clock stamps: request, sent, received, decoded, restored
    s: Dict[str, float] = field(default_factory=dict)  # seconds spent: fetch, decode, restore
    store: Dict[str, Any] = field(default_factory=dict)  # the first record's: kv_fetch's store calls and
    # breaker as the request came (``serving.calls.StoreCalls.snapshot``)

    @property
    def ok(self) -> bool:
        return self.status == OK

    def fail(self, status: str, reason: str) -> "ChunkInfo":
        if self.ok:
            self.status, self.reason = status, reason[:300]
        return self

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text) -> "ChunkInfo":
        if isinstance(text, (bytes, bytearray)):
            text = text.decode("utf-8", "replace")
        try:
            data = json.loads(text)
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise BadRequest(f"bad chunk_info: {exc}") from None
