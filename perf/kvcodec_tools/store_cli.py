"""``kvcodec store usage`` and ``kvcodec store gc``: the capacity of a chunk store
(``kvcodec.store.capacity``), from the command line.

    kvcodec store usage --store URL [--json]
    kvcodec store gc    --store URL --max-bytes N [--older-than D] [--dry-run] [--json]

``--older-than`` means "not used for": it is refused on a store that reports only when a chunk was
written (an HTTP/WebDAV store, S3 with ``touch_s=0``); on S3 use is the mark reads leave
(``kvcodec.store.s3``). ``N`` takes a suffix (``500M``, ``20G``, ``1T``: powers of 1024); ``D`` is seconds or ``30m``,
``12h``, ``7d``. With ``--json`` the last line printed is one JSON object (``bytes`` and
``chunks`` of the whole store, and the rest of the report). Credentials come as for serving
(``KVCODEC_STORE_TOKEN``, the ``AWS_*`` variables, ``KVCODEC_STORE_CA_FILE``).
"""
from __future__ import annotations

import json
import re
import time

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgtp]?)i?b?$", re.IGNORECASE)
_AGE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw]?)$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    m = _SIZE.match(text.strip())
    if not m:
        raise ValueError(f"not a size: {text!r} (use bytes or 500M, 20G, 1T)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_age(text: str) -> float:
    m = _AGE.match(text.strip())
    if not m:
        raise ValueError(f"not an age: {text!r} (use seconds or 30m, 12h, 7d)")
    return float(m.group(1)) * _AGE_UNITS[m.group(2).lower()]


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(t)) if t else "?"


def cmd_store_usage(args) -> int:
    from kvcodec.store import open_store
    from kvcodec.store.capacity import usage

    with open_store(args.store) as store:
        report = usage(store)
    print(f"{report['store']}: {_mb(report['bytes'])} in {report['chunks']} chunks")
    for g in report["groups"]:
        print(f"  {g['model']}  {g['rung']:<16} {g['chunks']:>8} chunks {_mb(g['bytes']):>14}  "
              f"last used {_when(g['oldest'])} .. {_when(g['newest'])}  ({g['model_tag']}/{g['codec_tag']})")
    if report["foreign"]["objects"]:
        print(f"  other objects: {report['foreign']['objects']} ({_mb(report['foreign']['bytes'])})")
    if args.json:
        print(json.dumps(report, sort_keys=True))
    return 0


def cmd_store_gc(args) -> int:
    from kvcodec.errors import ConfigError
    from kvcodec.store import open_store
    from kvcodec.store.capacity import gc

    try:
        max_bytes = parse_size(args.max_bytes) if args.max_bytes is not None else None
        older = parse_age(args.older_than) if args.older_than is not None else None
    except ValueError as exc:
        raise SystemExit(f"kvcodec store gc: {exc}") from None
    with open_store(args.store) as store:
        try:
            report = gc(store, max_bytes, older, dry_run=args.dry_run)
        except ConfigError as exc:
            raise SystemExit(f"kvcodec store gc: {exc}") from None
    verb = "would delete" if args.dry_run else "deleted"
    d = report["deleted"]
    print(f"{report['store']}: {_mb(report['before']['bytes'])} in {report['before']['chunks']} chunks; "
          f"{verb} {d['chunks']} chunks ({_mb(d['bytes'])}, {d['orphans']} unreachable); "
          f"now {_mb(report['after']['bytes'])} in {report['after']['chunks']} chunks")
    if report["unreadable"]:
        print(f"  {report['unreadable']} chunks with unreadable headers left alone")
    if args.json:
        print(json.dumps(report, sort_keys=True))
    if not report["met"]:
        print(f"kvcodec store gc: still above --max-bytes {args.max_bytes} (what is left cannot be placed "
              "in a chain: foreign objects or unreadable headers)")
        return 1
    return 0


def register(sub) -> None:
    """``kvcodec store {usage,gc}`` under the CLI's subcommands ``sub``."""
    p = sub.add_parser("store", help="capacity of a chunk store: usage, gc")
    store = p.add_subparsers(dest="store_command", required=True)
    p = store.add_parser("usage", help="bytes and chunks per model and rung")
    p.add_argument("--store", required=True, help="store URL (file://, http[s]://, redis[s]://, redis+cluster://, s3://)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object on the last line")
    p.set_defaults(func=cmd_store_usage)
    p = store.add_parser("gc", help="delete least recently used chunks, chains from their tail, down to a size")
    p.add_argument("--store", required=True, help="store URL")
    p.add_argument("--max-bytes", help="keep at most this much (bytes, or 500M, 20G, 1T)")
    p.add_argument("--older-than", help="also delete what was not used for this long (seconds, or 30m, 12h, 7d); refused on "
                        "stores that record only writes (http[s]://, s3:// with touch_s=0)")
    p.add_argument("--dry-run", action="store_true", help="report what would go, delete nothing")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object on the last line")
    p.set_defaults(func=cmd_store_gc)
