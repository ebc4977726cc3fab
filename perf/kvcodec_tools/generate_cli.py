"""``kvcodec generate``: ask a running server to continue a text (``kvcodec_client.KVCodecClient``)
and print the text and its TTFT (``--json``: one JSON object).

    kvcodec generate --text-file F --max-tokens N [--protocol grpc|http] [--url U] [--no-reuse] [--json]

It tokenizes with the engine's tokenizer and sends token ids (the engine's package is not needed);
with no server at the address it says so in one line, at once.
"""
from __future__ import annotations

import json
import sys

from kvcodec_tools.cli import _read_text, _settings, common


def _unreachable(url: str, timeout_s: float = 5.0) -> str:
    """Why nothing accepts a connection at ``url`` (``HOST:PORT``), or "" when something does."""
    import socket

    host, _, port = url.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return ""
    except ValueError:
        return f"not a HOST:PORT address: {url!r}"
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def cmd_generate(args) -> int:
    from kvcodec.engines import tokenizer
    from kvcodec_client.client import ClientError, KVCodecClient

    settings = _settings(args)
    client = KVCodecClient(args.url, args.protocol, fallback_s=args.fallback_s)
    unreachable = _unreachable(client.url)
    if unreachable:
        print(f"kvcodec generate: no server at {client.url} ({args.protocol}: {unreachable}); start one with "
              f"`kvcodec serve`, or pass --url", file=sys.stderr)
        return 1
    ids = tokenizer(settings).encode(_read_text(args.text_file))
    try:
        result = client.generate(ids, args.max_tokens, reuse=not args.no_reuse, codecs=args.codecs)
    except (ClientError, ConnectionError, OSError) as exc:
        print(f"kvcodec generate: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"tokens": result.tokens, "text": result.text, "ttft_s": round(result.ttft_s, 6),
                          "reused_tokens": result.reused_tokens, "prompt_tokens": len(ids),
                          "total_s": round(result.total_s, 6), "stats": result.stats,
                          "failures": result.failures}))
    else:
        print(result.text)
        print(f"\n[ttft {result.ttft_s:.3f} s, reused {result.reused_tokens}/{len(ids)} prompt tokens, "
              f"{len(result.tokens)} tokens in {result.total_s:.3f} s]", file=sys.stderr)
    return 0


def register(sub) -> None:
    """``kvcodec generate`` under the CLI's subcommands ``sub``."""
    p = sub.add_parser("generate", help="ask the server to continue a text; prints text and TTFT")
    common(p)
    p.add_argument("--text-file", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--url", help="server address (default 127.0.0.1:8001 for gRPC, :8000 for HTTP)")
    p.add_argument("--no-reuse", action="store_true", help="force full prefill")
    p.add_argument("--codecs", help="this request only: rung specs to fetch from (default: the server's ladder)")
    p.add_argument("--fallback-s", type=float, default=60.0,
                   help="after a server failure (a stub that died, a restart), ask again as prefill for this "
                        "many seconds (0: report the failure)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_generate)
