"""The store behind the link of ``kvcodec bench peers`` (``kvcodec_tools.peers``): one store every
method reads across one shaped link, as each sees it (``PeersStore``: KVCodec's URL and variables,
LMCache's L2 adapter, the bytes it sent, a wait for the writes off the requests' path).

``store_behind_link(root, rate, config)``: a Redis server (``redis_store``) or SeaweedFS's S3 gateway
(``s3_store``, virtual-hosted at ``<bucket>.s3.peers.test``: ``resolve`` adds the line to /etc/hosts)
behind a new link; ``redis_info`` reads Redis's counters over RESP; ``settle`` waits for a count to
stop changing.
"""
from __future__ import annotations

import contextlib
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, Tuple


# -- the store behind the link ------------------------------------------------------------------------
@dataclass
class PeersStore:
    """One store behind the link, as every method sees it: KVCodec's ``url`` (and ``env``, the
    variables its servers need), LMCache's L2 ``adapter``, ``sent()`` (bytes the store has sent so
    far) and ``settle()`` (returns once the writes off the requests' path are done)."""

    kind: str
    url: str
    adapter: dict
    env: Dict[str, str]
    sent: Callable[[], int]
    settle: Callable[[], None]


@contextlib.contextmanager
def store_behind_link(root: Path, rate: float, config) -> Iterator[Tuple[PeersStore, object]]:
    """``config.store``'s server (``config``: ``peers.PeersConfig``: ``store``, ``delay_ms``, ``link_mode``) (``redis``: Redis; ``s3``: SeaweedFS's S3) behind a new shaped link."""
    from kvcodec_tools.shaping import open_link

    with open_link(rate, config.delay_ms, config.link_mode) as link:
        opened = redis_store(root, rate, link) if config.store == "redis" else s3_store(root, rate, link)
        with opened as store:
            yield store, link


@contextlib.contextmanager
def redis_store(root: Path, rate: float, link) -> Iterator[PeersStore]:
    from kvcodec_tools.ports import free_ports
    from kvcodec_tools.services.redis import RedisServer

    password = secrets.token_hex(12)
    (port,) = free_ports(1)
    with RedisServer(root / f"redis-{rate:g}", link.server_host, port, password, wrap=link.wrap):
        host, exposed = link.expose(port)
        address = (host, exposed)
        yield PeersStore("redis", f"redis://:{password}@{host}:{exposed}/0",
                         {"type": "resp", "host": host, "port": exposed, "password": password}, {},
                         lambda: redis_info(address, password).get("total_net_output_bytes", 0),
                         lambda: settle(lambda: redis_info(address, password).get("keys", 0)))


S3_DOMAIN = "s3.peers.test"  # LMCache's S3 adapter addresses buckets virtual-hosted only: <bucket>.<domain>
S3_BUCKET = "kvpeers"


@contextlib.contextmanager
def s3_store(root: Path, rate: float, link) -> Iterator[PeersStore]:
    """SeaweedFS's S3 gateway in the link's namespace (netns links only: the bytes it sends are the
    veth's), virtual-hosted buckets on, ``<bucket>.<S3_DOMAIN>`` in /etc/hosts."""
    from kvcodec_tools.services.seaweedfs import SeaweedS3

    veth = getattr(link, "veth", None)
    if not veth:
        raise SystemExit("kvcodec bench peers --store s3 needs a netns link (root): the bytes S3 sends are the veth's")
    from kvcodec_tools.ports import free_port_run
    from kvcodec_tools.services.seaweedfs import PORTS

    key, secret = "peers-" + secrets.token_hex(4), secrets.token_hex(16)
    base = free_port_run(len(PORTS), offsets=(0, 10000))  # probed here: the namespace's ports are as free
    with SeaweedS3(root / f"s3-{rate:g}", link.server_host, key, secret, bucket=S3_BUCKET, prefix="kv",
                   base_port=base, wrap=link.wrap, domain=S3_DOMAIN).start(timeout_s=120) as weed:
        host, exposed = link.expose(weed.port)
        resolve(f"{S3_BUCKET}.{S3_DOMAIN}", host)
        env = dict(weed.environ(), AWS_ENDPOINT_URL_S3=f"http://{host}:{exposed}")
        received = Path(f"/sys/class/net/{veth[0]}/statistics/rx_bytes")  # host side: what the store sent
        sent = lambda: int(received.read_text())  # noqa: E731
        yield PeersStore("s3", weed.url, {"type": "s3", "s3_endpoint": f"{S3_BUCKET}.{S3_DOMAIN}:{exposed}",
                                          "s3_region": "us-east-1", "disable_tls": True,
                                          "aws_access_key_id": key, "aws_secret_access_key": secret},
                         env, sent, lambda: settle(sent))


def resolve(name: str, address: str, hosts: Path = Path("/etc/hosts")) -> None:
    """``name`` resolves to ``address``: a line in ``hosts`` (added when missing; root)."""
    line = f"{address} {name}"
    text = hosts.read_text()
    if any(row.split()[:2] == [address, name] for row in text.splitlines() if row.strip()):
        return
    try:
        hosts.write_text(text.rstrip("\n") + f"\n{line}\n")
    except OSError as exc:
        raise SystemExit(f"kvcodec bench peers --store s3: add '{line}' to {hosts} ({exc.strerror})") from None


def redis_info(address: Tuple[str, int], password: str) -> Dict[str, int]:
    """``INFO`` counters of the Redis server (bytes sent, keys) over RESP, no client library."""
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(f"*2\r\n$4\r\nAUTH\r\n${len(password)}\r\n{password}\r\n*1\r\n$4\r\nINFO\r\n".encode())
        data = b""
        while b"total_net_output_bytes" not in data or not data.endswith(b"\r\n\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    out = {}
    for line in data.decode(errors="replace").splitlines():
        name, _, value = line.partition(":")
        if name in ("total_net_output_bytes", "total_net_input_bytes") and value.strip().isdigit():
            out[name] = int(value)
        if name.startswith("db0") and "keys=" in value:
            out["keys"] = int(value.split("keys=")[1].split(",")[0])
    return out


def settle(count: Callable[[], int], quiet_s: float = 8.0, limit_s: float = 600.0) -> int:
    """Wait until ``count()`` (the store's keys, or the bytes it has moved) stops changing for
    ``quiet_s`` (the stores off the request's path are done); the count."""
    deadline, last, since = time.monotonic() + limit_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = count()
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(1.0)
    return last
