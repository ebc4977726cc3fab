"""``kvcodec generate``: ask a running server to continue a text (``kvcodec_client.KVCodecClient``)
and print the text and its TTFT (``--json``: one JSON object).

    kvcodec generate (--prompt TEXT | --text-file F) --max-tokens N [--temperature T] [--top-p P]
                     [--top-k K] [--seed S] [--stop WORD]... [--ids] [--protocol grpc|http] [--url U]
                     [--no-reuse] [--json]

It sends the text (``text_input``: the server tokenizes it with the model's own tokenizer); with
``--ids`` it tokenizes here with the engine's tokenizer and sends token ids (the engine's package
is not needed). With no server at the address it says so in one line, at once.
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


def add_tls_args(p) -> None:
    """``--tls-ca`` (and for mutual TLS ``--tls-cert``, ``--tls-key``): the client side of a server's
    TLS (``kvcodec serve --grpc-tls-cert ...``, or a TLS proxy in front of HTTP)."""
    p.add_argument("--tls-ca", help="speak TLS: the CA (PEM) that signed the server's certificate")
    p.add_argument("--tls-cert", help="mutual TLS: this client's certificate (PEM)")
    p.add_argument("--tls-key", help="mutual TLS: its private key (PEM)")


def client_tls(args):
    from kvcodec_client.client import ClientTls

    if not args.tls_ca:
        if args.tls_cert or args.tls_key:
            raise SystemExit("--tls-cert and --tls-key need --tls-ca (the CA of the server's certificate)")
        return None
    return ClientTls(args.tls_ca, args.tls_cert, args.tls_key)


def cmd_generate(args) -> int:
    from kvcodec.engines import open_tokenizer
    from kvcodec_client.client import ClientError, KVCodecClient

    settings = _settings(args)
    client = KVCodecClient(args.url, args.protocol, fallback_s=args.fallback_s, tls=client_tls(args))
    unreachable = _unreachable(client.url)
    if unreachable:
        print(f"kvcodec generate: no server at {client.url} ({args.protocol}: {unreachable}); start one with "
              f"`kvcodec serve`, or pass --url", file=sys.stderr)
        return 1
    text = args.prompt if args.prompt is not None else _read_text(args.text_file)
    prompt = open_tokenizer(settings).encode(text) if args.ids else text
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
                "stop_words": args.stop or None}
    try:
        result = client.generate(prompt, args.max_tokens, reuse=not args.no_reuse, codecs=args.codecs,
                                 cache_salt=args.cache_salt, **sampling)
    except (ClientError, ConnectionError, OSError) as exc:
        print(f"kvcodec generate: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"tokens": result.tokens, "text": result.text, "ttft_s": round(result.ttft_s, 6),
                          "reused_tokens": result.reused_tokens, "prompt_tokens": result.prompt_tokens,
                          "total_s": round(result.total_s, 6), "stats": result.stats,
                          "failures": result.failures}))
    else:
        print(result.text)
        print(f"\n[ttft {result.ttft_s:.3f} s, reused {result.reused_tokens}/{result.prompt_tokens} prompt tokens, "
              f"{len(result.tokens)} tokens in {result.total_s:.3f} s]", file=sys.stderr)
    return 0


def register(sub) -> None:
    """``kvcodec generate`` under the CLI's subcommands ``sub``."""
    p = sub.add_parser("generate", help="ask the server to continue a text; prints text and TTFT")
    common(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt's text")
    prompt.add_argument("--text-file", help="a file holding the prompt's text")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, help="keep the likeliest tokens holding this much probability")
    p.add_argument("--top-k", type=int, help="keep the k likeliest tokens")
    p.add_argument("--seed", type=int, help="the seed of a sampled answer (the same seed, the same answer)")
    p.add_argument("--stop", action="append", metavar="WORD", help="end the answer before this word (repeatable)")
    p.add_argument("--ids", action="store_true", help="tokenize here and send token ids instead of the text")
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--url", help="server address (default 127.0.0.1:8001 for gRPC, :8000 for HTTP)")
    p.add_argument("--no-reuse", action="store_true", help="force full prefill")
    p.add_argument("--codecs", help="this request only: rung specs to fetch from (default: the server's ladder)")
    p.add_argument("--cache-salt", metavar="SALT",
                   help="the caller's tenant: only KV stored under this salt is reused (kvcodec ingest --cache-salt)")
    p.add_argument("--fallback-s", type=float, default=60.0,
                   help="after a server failure (a stub that died, a restart), ask again as prefill for this "
                        "many seconds (0: report the failure)")
    p.add_argument("--json", action="store_true")
    add_tls_args(p)
    p.set_defaults(func=cmd_generate)
