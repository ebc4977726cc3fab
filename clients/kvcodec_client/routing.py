"""Prefix-aware routing, the client's half: every request may carry ``X-KVCodec-Prefix``, a hash of
its prompt's stable head (the document it asks about; a conversation's system prompt and user
context), so that a router in front of several replicas (nginx's ``hash $http_x_kvcodec_prefix
consistent``: deploy/router/nginx-prefix.conf) sends one head to one replica, where its KV already
is. ``route_key(head)``: the header's value, for a text or token ids."""
from __future__ import annotations

import hashlib
from typing import Sequence, Union

ROUTE_HEADER = "X-KVCodec-Prefix"


def route_key(head: Union[str, Sequence[int]]) -> str:
    """The header's value for a prompt whose stable head is ``head`` (32 hex characters)."""
    data = head.encode("utf-8", "surrogatepass") if isinstance(head, str) else ",".join(map(str, head)).encode()
    return hashlib.sha256(data).hexdigest()[:32]
