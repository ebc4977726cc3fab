"""nginx as a load balancer in front of several tritonservers: ``Balancer(root, host, backends)``.

``backends``: ``(http_port, grpc_port)`` of each server (on ``backend_host``). The balancer listens on
two ports of its own: HTTP/1.1 (``proxy_pass`` to an upstream of the servers' HTTP ports) and gRPC
(``listen ... http2``, ``grpc_pass`` to an upstream of their gRPC ports; ``grpc=False``: none, for
servers that speak HTTP only, as ``vllm serve``), round-robin per request, or with
``routing="prefix"`` by nginx's consistent hash of the ``X-KVCodec-Prefix`` header (``kvcodec_client.route_key``).
Responses stream through unbuffered (a decoupled model's ``generate_stream`` / gRPC stream sends a
response per token), with read timeouts of ``timeout_s``; request bodies of any size.

``.http_url`` and ``.grpc_url`` are ``HOST:PORT`` as ``tritonclient`` takes them. Everything nginx
writes (config, pid, logs, temp files) lives in ``root``. The deployment this mirrors is in
docs/deploy-scale-out.md ("A load balancer"). ``tls`` (``BalancerTls``) terminates TLS on both
listeners, mutual with a client CA: the HTTP endpoint's TLS and client-certificate check.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from kvcodec_tools.procs import Process, ServiceError, Wrap

from .nginx import start_nginx, user_line

CONF = """\
{user}worker_processes 1;
daemon off;
master_process on;
pid {run}/nginx.pid;
error_log {run}/error.log warn;

events {{
    worker_connections 1024;
}}

http {{
    access_log off;
    client_max_body_size 0;
    client_body_temp_path {run}/client_body;
    proxy_temp_path {run}/proxy;
    fastcgi_temp_path {run}/fastcgi;
    uwsgi_temp_path {run}/uwsgi;
    scgi_temp_path {run}/scgi;

    upstream triton_http {{
{route}{http_servers}
        keepalive 32;
    }}
{grpc_upstream}
    server {{
        listen {host}:{http_port}{ssl};
{tls}
        location / {{
            proxy_pass http://triton_http;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout {timeout_s}s;
            proxy_send_timeout {timeout_s}s;
        }}
    }}

{grpc_server}}}
"""
GRPC_UPSTREAM = """\
    upstream triton_grpc {{
{route}{grpc_servers}
        keepalive 32;
    }}
"""
GRPC_SERVER = """\
    server {{
        listen {host}:{grpc_port}{ssl} http2;
{tls}
        location / {{
            grpc_pass grpc://triton_grpc;
            grpc_read_timeout {timeout_s}s;
            grpc_send_timeout {timeout_s}s;
        }}
    }}
"""
# Prefix-aware routing: nginx's consistent hash on the header a client sets to a hash of its
# prompt's stable prefix (the document, the conversation's head): requests for one prefix reach
# the replica that holds it (its engine cache, its local tier); a request without the header goes
# round-robin (nginx's hash falls back to it on an empty key). Adding or removing a replica moves
# only the prefixes of its share of the ring (``consistent``: ketama).
ROUTINGS = ("round-robin", "prefix")
ROUTE = "        hash $http_x_kvcodec_prefix consistent;\n"  # the header: kvcodec_client.ROUTE_HEADER


@dataclass(frozen=True)
class BalancerTls:
    """TLS on both of the balancer's listeners (HTTP and gRPC): its certificate and key (PEM); with
    ``client_ca``, only clients whose certificate that CA signed get through (nginx answers the
    others 400 itself: Triton never sees them)."""
    cert: Path
    key: Path
    client_ca: Optional[Path] = None

    def directives(self) -> str:
        lines = [f"ssl_certificate {self.cert};", f"ssl_certificate_key {self.key};", "ssl_protocols TLSv1.2 TLSv1.3;"]
        if self.client_ca is not None:
            lines += [f"ssl_client_certificate {self.client_ca};", "ssl_verify_client on;"]
        return "\n".join(f"        {line}" for line in lines)


class Balancer:
    def __init__(self, root: Path, host: str, http_port: int, grpc_port: int, backends: Sequence[Tuple[int, int]],
                 backend_host: str = "127.0.0.1", timeout_s: int = 600, wrap: Wrap = None,
                 tls: Optional[BalancerTls] = None, routing: str = "round-robin", grpc: bool = True) -> None:
        if not backends:
            raise ServiceError("a balancer needs at least one backend (http_port, grpc_port)")
        if routing not in ROUTINGS:
            raise ServiceError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        self.routing, self.grpc = routing, grpc
        self.root, self.host = Path(root).resolve(), host
        self.http_port, self.grpc_port = int(http_port), int(grpc_port)
        self.backends: List[Tuple[int, int]] = [(int(h), int(g)) for h, g in backends]
        self.backend_host, self.timeout_s, self.wrap, self.tls = backend_host, int(timeout_s), wrap, tls
        self.http_url = f"{host}:{self.http_port}"
        self.grpc_url = f"{host}:{self.grpc_port}"
        self._process: Optional[Process] = None

    @property
    def pid(self) -> Optional[int]:
        return self._process.pid if self._process else None

    def config(self) -> str:
        user = user_line()
        servers = {k: "\n".join(f"        server {self.backend_host}:{ports[i]};" for ports in self.backends)
                   for i, k in enumerate(("http_servers", "grpc_servers"))}
        fields = dict(user=user, run=self.root, host=self.host, http_port=self.http_port, grpc_port=self.grpc_port,
                      timeout_s=self.timeout_s, ssl=" ssl" if self.tls else "",
                      tls=self.tls.directives() if self.tls else "", route=ROUTE if self.routing == "prefix" else "",
                      **servers)
        grpc = self.grpc
        return CONF.format(grpc_upstream=GRPC_UPSTREAM.format(**fields) if grpc else "",
                           grpc_server=GRPC_SERVER.format(**fields) if grpc else "", **fields)

    def start(self, timeout_s: float = 15.0) -> "Balancer":
        if self._process and self._process.alive():
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.root / "nginx.conf"
        conf.write_text(self.config())
        ports = [self.http_port, self.grpc_port] if self.grpc else [self.http_port]
        self._process = start_nginx("nginx balancer", self.root, conf, self.host, ports, self.wrap, timeout_s)
        return self

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()

    def __enter__(self) -> "Balancer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
