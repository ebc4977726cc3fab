"""The benchmarks' remote store: nginx (writes only with a bearer token), on loopback for ingest or
inside a throttled link for measuring. One place for what ``kvcodec bench ttft`` and
``perf/kvcodec_tools/run_perf.py`` both set up."""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator, Tuple

from .ports import free_ports


def new_store_token() -> str:
    """A fresh write token, also put in ``KVCODEC_STORE_TOKEN`` so that ingest and the servers
    started from here present it."""
    token = secrets.token_hex(16)
    os.environ["KVCODEC_STORE_TOKEN"] = token
    return token


@contextlib.contextmanager
def loopback_store(root: Path, token: str) -> Iterator[str]:
    """nginx on 127.0.0.1 over ``root``'s data; yields its URL."""
    from kvcodec_tools.services.nginx import NginxStore

    (port,) = free_ports(1)
    with NginxStore(root, "127.0.0.1", port, token) as nginx:
        yield nginx.url


@contextlib.contextmanager
def store_behind_link(root: Path, token: str, rate_mbps: float, delay_ms: float,
                      mode: str) -> Iterator[Tuple[str, object]]:
    """nginx over the same data behind a link of ``rate_mbps``; yields (URL seen from here, link)."""
    from kvcodec_tools.services.nginx import NginxStore
    from kvcodec_tools.shaping import open_link

    with open_link(rate_mbps, delay_ms, mode) as link:
        (port,) = free_ports(1)
        with NginxStore(root, link.server_host, port, token, wrap=link.wrap):
            host, exposed = link.expose(port)
            yield f"http://{host}:{exposed}/kv", link
