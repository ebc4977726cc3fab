"""``kvcodec probe``: the liveness check a deployment runs (a Kubernetes ``exec`` probe): one
request of one token through the whole ensemble, reuse off, within ``--timeout-s``. Exit 0 when
the server answered with a token; 1 with one line saying why not (nothing listening, an error
from a step, no answer in time).

    kvcodec probe [--url HOST:PORT] [--protocol grpc|http] [--timeout-s 20] [--tls-ca CA [--tls-cert C --tls-key K]]

Readiness is Triton's own ``/v2/health/ready`` (every model loaded); this checks that a request
goes through fetch, decode, restore and the engine, which a hung python stub fails.
"""
from __future__ import annotations

import sys
import time


def cmd_probe(args) -> int:
    from kvcodec_client.client import ClientError, KVCodecClient
    from kvcodec_tools.generate_cli import _unreachable, client_tls

    client = KVCodecClient(args.url, args.protocol, timeout_s=args.timeout_s, tls=client_tls(args))
    unreachable = _unreachable(client.url, timeout_s=min(5.0, args.timeout_s))
    if unreachable:
        print(f"kvcodec probe: no server at {client.url} ({args.protocol}: {unreachable})", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    try:
        result = client.generate(args.prompt, 1, reuse=False)
    except ClientError as exc:
        print(f"kvcodec probe: {client.url} failed: {exc.message}", file=sys.stderr)
        return 1
    if len(result.tokens) != 1:
        print(f"kvcodec probe: {client.url} answered {len(result.tokens)} tokens, asked for 1", file=sys.stderr)
        return 1
    print(f"ok: {client.url} answered 1 token in {time.perf_counter() - t0:.3f} s")
    return 0


def register(sub) -> None:
    from kvcodec_tools.generate_cli import add_tls_args

    p = sub.add_parser("probe", help="liveness: one one-token request through the ensemble")
    p.add_argument("--url", default=None, help="HOST:PORT (default 127.0.0.1:8001 for grpc, :8000 for http)")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--timeout-s", type=float, default=20.0)
    p.add_argument("--prompt", default="ping", help="the request's text (default 'ping')")
    add_tls_args(p)
    p.set_defaults(func=cmd_probe)
