"""The shell front end ``perf/link`` (``python -m kvcodec_tools.shaping``): ``up``, ``down``, ``run -- CMD``,
``check``, and ``proxy`` (the userspace proxy's child, not for people).

``up`` leaves a link up (its state in ``STATE_DIR``) and prints it with the environment ``run``
would give; ``down --name NAME`` ends it (``--stale`` also deletes the namespaces of dead
processes); ``run`` brings a link up, runs the command with ``KVCODEC_LINK_*`` set (``link_env``)
and tears the link down; ``check`` measures the achieved rate and RTT.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
from typing import Optional

from .base import Link
from .errors import LinkError
from .link import MODES, down_named, down_stale, open_link
from .measure import check
from .netns import NetnsLink
from .proxy import run_proxy


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="perf/link", description="Throttled links for the TTFT benchmarks.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def link_args(p, name=True):
        p.add_argument("--rate-mbit", type=float, required=True)
        p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (RTT grows by twice it)")
        p.add_argument("--mode", choices=MODES, default="auto")
        if name:
            p.add_argument("--name")
        p.add_argument("--expose", type=int, action="append", default=[], metavar="PORT",
                       help="server-side port to expose (needed for userspace, and for netns delay without netem)")

    link_args(sub.add_parser("up", help="bring a link up, print it as JSON, leave it up"))
    d = sub.add_parser("down", help="tear down a link left up by `up`")
    d.add_argument("--name")
    d.add_argument("--stale", action="store_true", help="also delete kvc-<pid>-<n> namespaces of dead processes")
    r = sub.add_parser("run", help="bring a link up, run CMD (env KVCODEC_LINK_*), tear it down")
    link_args(r)
    r.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD")
    c = sub.add_parser("check", help="measure the achieved rate and RTT of a link")
    link_args(c, name=False)
    c.add_argument("--megabytes", type=float, default=30.0)
    p = sub.add_parser("proxy", help=argparse.SUPPRESS)
    p.add_argument("--target", required=True)
    p.add_argument("--rate-mbit", type=float)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--detach", action="store_true")
    return ap


def link_env(link: Link) -> dict:
    """The ``KVCODEC_LINK_*`` environment that describes a link to a command run across it."""
    d = link.describe()
    env = {"KVCODEC_LINK_KIND": link.kind, "KVCODEC_LINK_NAME": link.name,
           "KVCODEC_LINK_SERVER_HOST": link.server_host, "KVCODEC_LINK_RATE_MBIT": str(link.rate_mbit),
           "KVCODEC_LINK_DELAY_MS": str(link.delay_ms), "KVCODEC_LINK_WRAP": shlex.join(link.wrap([])),
           "KVCODEC_LINK_EXPOSED": ",".join(f"{k}={h}:{p}" for k, (h, p) in d["exposed"].items())}
    if isinstance(link, NetnsLink):
        env["KVCODEC_LINK_NETNS"] = link.netns
    return env


def _expose_all(link: Link, ports: list[int]) -> None:
    for port in ports:
        link.expose(port)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "proxy":
        return run_proxy(args.target, args.rate_mbit, args.delay_ms, args.detach)
    try:
        if args.cmd == "down":
            if not args.name and not args.stale:
                raise LinkError("down needs --name NAME or --stale")
            out = down_named(args.name) if args.name else {}
            if args.stale:
                out["stale_removed"] = down_stale()
            print(json.dumps(out))
            return 0
        if args.cmd == "check":
            res = check(args.rate_mbit, args.delay_ms, args.mode, args.megabytes)
            print(json.dumps(res, indent=1))
            return 0
        link = open_link(args.rate_mbit, args.delay_ms, args.mode, args.name)
        if args.cmd == "up":
            try:
                link.detach()
                _expose_all(link, args.expose)
                link.save()
            except BaseException:
                link.down()
                raise
            print(json.dumps({**link.describe(), "env": link_env(link)}, indent=1))
            return 0
        # run
        cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not cmd:
            link.down()
            raise LinkError("run needs a command after --")

        def on_signal(signum, _frame):
            raise KeyboardInterrupt(signum)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, on_signal)
        with link:
            _expose_all(link, args.expose)
            try:
                return subprocess.run(cmd, env={**os.environ, **link_env(link)}).returncode
            except KeyboardInterrupt:
                return 130
    except (LinkError, ValueError) as e:
        print(f"perf/link: {e}", file=sys.stderr)
        return 2
