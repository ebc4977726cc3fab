"""``kvcodec ingest``: prefill a text once and store its KV chunks (``kvcodec.ingest.ingest_rungs``),
from the command line.

    kvcodec ingest --text-file F [--codec RUNG[,RUNG...]] [--quality Q] [--store URL] [--engine E] [--json] [--quiet]
    kvcodec ingest --text-file F --chat          # F as the system message of chats (the model's chat template)
    kvcodec ingest --chat-messages M.json        # the messages every such chat starts with

``--chat`` / ``--chat-messages`` store the text the served model's chat template makes of those
messages (``kvcodec.engines.tokenizer.chat_prefix``): a chat request that starts with them, through
Triton's OpenAI frontend (given the same model's tokenizer) or as ``text_input``, reuses it.

Without ``--codec`` it stores at every rung of the ladder a server started with the same settings
fetches from. A bad rung name, a rung whose codec profile is not fitted for the model and a store
that does not answer are each refused in one line before the model loads.
"""
from __future__ import annotations

import json
import sys

from kvcodec_tools.cli import _read_text, _settings, _store_down, common


def _probe_store(settings) -> None:
    """Ingest's look-up in the store before any model is loaded: one line and exit when it is down."""
    down = _store_down(settings)
    if down:
        raise SystemExit(f"kvcodec ingest: {down}; start the store or pass --store")


def cmd_ingest(args) -> int:
    from tqdm import tqdm

    from kvcodec.engines import model_card, open_engine
    from kvcodec.format.ladder import parse_ladder
    from kvcodec.ingest import ingest_rungs
    from kvcodec.profiles import require_profiles

    settings = _settings(args)
    codec = args.codec or ",".join(settings.ladder)  # default: the rungs the server fetches from
    if args.quality is not None:
        if "," in codec:
            raise SystemExit("kvcodec ingest: --quality takes one --codec; name rungs as NAME:QUALITY instead")
        codec = f"{codec}:{args.quality}"
    schemes = parse_ladder(codec, model_card(settings))  # bad names fail before the model loads
    require_profiles(schemes)  # so does a rung whose codec profile is not fitted for this model
    text = _read_text(args.text_file) if args.text_file else None
    messages = _chat_messages(args, text)
    _probe_store(settings)  # and a store that does not answer
    engine = open_engine(settings)
    if messages is not None:
        from kvcodec.engines.tokenizer import chat_prefix
        from kvcodec.errors import ConfigError

        try:
            text = chat_prefix(engine.tokenizer, messages)
        except ConfigError as exc:
            raise SystemExit(f"kvcodec ingest: {exc}") from None
    ids = engine.tokenize(text)
    n_chunks = len(ids) // settings.chunk_tokens
    if n_chunks == 0:
        print(f"kvcodec ingest: {len(ids)} tokens is less than one chunk ({settings.chunk_tokens}); nothing stored",
              file=sys.stderr)
        return 1
    with tqdm(total=n_chunks, unit="chunk", desc="ingest", disable=args.quiet) as bar:
        report = ingest_rungs(settings, engine, ids, codec, progress=bar.update, salt=args.cache_salt or "")
    summary = {"tokens": report.tokens, "chunks": report.chunks, "written": report.written,
               "bytes_written": report.bytes_written, "ratio_vs_fp16": round(report.ratio_vs_fp16, 3),
               "prefill_s": round(report.prefill_s, 3), "encode_s": round(report.encode_s, 3),
               "codec": schemes[0].identity if len(schemes) == 1 else [s.identity for s in schemes],
               "rungs": {name: {"written": r.written, "bytes_written": r.bytes_written,
                                "ratio_vs_fp16": round(r.ratio_vs_fp16, 3), "encode_s": round(r.encode_s, 3),
                                "decode_s": round(r.decode_s, 3)} for name, r in report.rungs.items()},
               "store": settings.store}
    if args.json:
        print(json.dumps(summary))
    else:
        for name, r in report.rungs.items():
            print(f"{name}: {r.written} chunks written, {r.bytes_written} bytes, {r.ratio_vs_fp16:.2f}x vs fp16")
        print(f"ingested {report.tokens} tokens: {report.chunks} chunks into {settings.store}")
    return 0


def _chat_messages(args, text):
    """The chat messages to store the prefix of (None: store ``text`` as it is)."""
    if args.chat_messages:
        if args.text_file or args.chat:
            raise SystemExit("kvcodec ingest: --chat-messages takes the place of --text-file and --chat")
        try:
            messages = json.loads(_read_text(args.chat_messages))
        except ValueError as exc:
            raise SystemExit(f"kvcodec ingest: --chat-messages {args.chat_messages} is not JSON: {exc}") from None
        if not isinstance(messages, list):
            raise SystemExit("kvcodec ingest: --chat-messages holds a JSON list of {\"role\", \"content\"} messages")
        return messages
    if not args.text_file:
        raise SystemExit("kvcodec ingest: give --text-file (or --chat-messages)")
    return [{"role": "system", "content": text}] if args.chat else None


def register(sub) -> None:
    """``kvcodec ingest`` under the CLI's subcommands ``sub``."""
    p = sub.add_parser("ingest", help="prefill a text once and store its KV chunks")
    common(p)
    p.add_argument("--text-file", help="the text to store (with --chat: the system message of chats)")
    p.add_argument("--chat", action="store_true",
                   help="store the text as the system message of chats, in the model's chat template")
    p.add_argument("--chat-messages", metavar="FILE",
                   help="a JSON list of chat messages ({role, content}) that chats start with: store their prefix")
    p.add_argument("--codec",
                   help="a rung spec NAME[:QUALITY], or a comma list of them (default: the server's ladder)")
    p.add_argument("--quality", type=int, help="the codec's quality setting (video: QP)")
    p.add_argument("--cache-salt", metavar="SALT",
                   help="store under this tenant's keys: only requests with the same cache salt reuse them "
                        "(docs/operations.md, \"Tenants\")")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_ingest)
