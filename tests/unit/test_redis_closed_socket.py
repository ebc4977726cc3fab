"""A Redis call whose socket is closed under it (redis-py raises ``ValueError: I/O operation on
closed file``, seen in ``kvcodec soak --chaos`` when redis-server was killed and the breaker dropped
the connections) is ``StoreUnavailable`` (a miss, then prefill), not an internal error."""
from __future__ import annotations

import pytest

from kvcodec.errors import StoreUnavailable
from kvcodec.store import open_store


def test_a_socket_closed_under_a_call_is_store_unavailable():
    store = open_store("redis://:pw-0123456789@127.0.0.1:1/0")

    def closed(_client):
        raise ValueError("I/O operation on closed file.")

    with pytest.raises(StoreUnavailable, match="connection closed under GET"):
        store._call("GET", "k", closed)

    def bug(_client):
        raise ValueError("something else")

    with pytest.raises(ValueError, match="something else"):  # other ValueErrors are bugs: raised as they are
        store._call("GET", "k", bug)
