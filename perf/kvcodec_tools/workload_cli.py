"""``kvcodec bench workload long-doc-qa|multi-round``: LMCache's published workloads against a server
(``kvcodec_tools.workload`` says what they send and what they measure).

    kvcodec bench workload long-doc-qa --method M (--url http://127.0.0.1:P [--target openai|ensemble] | --serve kvcodec|vllm)
        [--documents 8 --document-tokens 20000 --output-tokens 100 --repeat-count 2 --repeat-mode random
         --hit-miss 3:1 --inflight 2] [--restart-between-rounds] [--cache-salt S] [--bandwidth-mbps B]
        [--replicas 2 --routing prefix|round-robin] [--json perf/results/workloads.json [--plot FILE]]
    kvcodec bench workload long-doc-qa|multi-round --peers M1,M2 [--link-mbps 100,10000] [--peers-store redis|s3]
        [--restart-between-rounds] ... (workload_peers: the peers bench's methods side by side)
    kvcodec bench workload multi-round --method M ... [--users 10 --rounds 5 --system-tokens 1000
        --user-info-tokens 0 --answer-tokens 100 --qps 0.5]

``--url``: a running server on this machine (an OpenAI-compatible one, or with ``--target ensemble``
tritonserver's HTTP port). ``--serve``: the command starts ``vllm serve`` itself in this Python (the
vLLM venv: ``.venv-vllm/bin/kvcodec``), ``kvcodec`` with the KVCodec connector on ``--store`` (default:
a new folder of the run, so the warm-up round starts cold), ``vllm`` without it (its prefix cache
on), and with ``--restart-between-rounds`` starts a new server between the warm-up and the query
round. ``--replicas N`` starts N of them on the one store, each with a local tier of its own (a
machine's), behind nginx (``services.balancer``) routing by prefix (a consistent hash of the
``X-KVCodec-Prefix`` header every request carries) or round-robin; the row's ``routing``,
``tier_chunks`` and ``local_hit_rate`` say how the connectors' reused chunks split between the
local tiers and the store. The prompts are cut to token counts with the embedded model's tokenizer. Exit status 1 when
an answer differs from prefill's (greedy), 2 on a usage or server error.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .cli import PLOT_HELP, REPO_ROOT, _list, _settings, common

RESULTS = REPO_ROOT / "perf" / "results" / "workloads.json"


def _shared(p) -> None:
    common(p)
    p.add_argument("--method", required=True, help="the name of what is measured (a row's method)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server on a loopback address (http://127.0.0.1:PORT)")
    where.add_argument("--serve", choices=["kvcodec", "vllm"],
                       help="start vllm serve here: with the KVCodec connector (kvcodec) or plain (vllm)")
    where.add_argument("--peers", type=_list(str), default=None,
                       help="the peers bench's methods, side by side, each on a fresh store behind a shaped link "
                            "at each --link-mbps (prefill, lmcache, lmcache-fp8, kvcodec-vllm-serve, kvcodec-ensemble)")
    p.add_argument("--link-mbps", type=_list(float), default=[100.0, 10000.0], help="with --peers: the link rates")
    p.add_argument("--peers-store", choices=["redis", "s3"], default="redis", help="with --peers: the store")
    p.add_argument("--delay-ms", type=float, default=1.0, help="with --peers: the link's one-way delay")
    p.add_argument("--link-mode", choices=["auto", "netns", "userspace"], default="auto", help="with --peers")
    p.add_argument("--target", choices=["openai", "ensemble"], default="openai",
                   help="--url's interface: /v1/completions, or Triton's ensemble's generate_stream")
    p.add_argument("--served-model", default=None,
                   help="the model name to send (default: model for openai, kvcodec for the ensemble)")
    p.add_argument("--restart-between-rounds", action="store_true",
                   help="a new server between the warm-up and the query round (needs --serve)")
    p.add_argument("--replicas", type=int, default=1,
                   help="with --serve: this many vllm serve replicas behind an nginx router, each with its own "
                        "local tier (KVCODEC_LOCAL_STORE) on the one store")
    p.add_argument("--routing", choices=["prefix", "round-robin"], default="prefix",
                   help="the router's policy with --replicas > 1: nginx's consistent hash of the X-KVCodec-Prefix "
                        "header each request carries (its document's or conversation's head), or round-robin")
    p.add_argument("--cache-salt", default=None, help="the cache salt of every measured request")
    p.add_argument("--bandwidth-mbps", type=float, default=None, help="the link's rate, as recorded in the row")
    p.add_argument("--timeout-s", type=float, default=600.0, help="the limit on one request")
    p.add_argument("--json", default=None, help=f"the rows file to write into (e.g. {RESULTS.relative_to(REPO_ROOT)})")
    p.add_argument("--plot", default=None, help=PLOT_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def register(sub) -> None:
    """``kvcodec bench workload`` under ``kvcodec bench``'s subcommands ``sub``."""
    p = sub.add_parser("workload", help="LMCache's long-document QA and multi-round QA against a server")
    kinds = p.add_subparsers(dest="workload", required=True)
    d = kinds.add_parser("long-doc-qa", help="documents, a warm-up round, a query round of repeats")
    _shared(d)
    d.add_argument("--documents", type=int, default=8)
    d.add_argument("--document-tokens", type=int, default=20000)
    d.add_argument("--output-tokens", type=int, default=100)
    d.add_argument("--repeat-count", type=int, default=2)
    d.add_argument("--repeat-mode", choices=["random", "tile", "interleave"], default="random")
    d.add_argument("--shuffle-seed", type=int, default=0)
    d.add_argument("--hit-miss", default=None, help="H:M: in the query round, M of every H+M requests miss")
    d.add_argument("--inflight", type=int, default=2, help="the most requests in flight")
    d.set_defaults(func=cmd_workload)
    m = kinds.add_parser("multi-round", help="users arriving over time, each a growing conversation")
    _shared(m)
    m.add_argument("--users", type=int, default=10)
    m.add_argument("--rounds", type=int, default=5)
    m.add_argument("--system-tokens", type=int, default=1000, help="the shared system prompt's length")
    m.add_argument("--user-info-tokens", type=int, default=0, help="each user's own context's length")
    m.add_argument("--answer-tokens", type=int, default=100)
    m.add_argument("--qps", type=float, default=0.5, help="the overall request rate (sets the arrivals)")
    m.set_defaults(func=cmd_workload)


def _config(args):
    from .workload import LongDocConfig, MultiRoundConfig

    if args.workload == "long-doc-qa":
        return LongDocConfig(args.documents, args.document_tokens, args.output_tokens, args.repeat_count,
                             args.repeat_mode, args.shuffle_seed, args.hit_miss, args.inflight)
    return MultiRoundConfig(args.users, args.rounds, args.system_tokens, args.user_info_tokens, args.answer_tokens,
                            args.qps)


class _Servers:
    """The ``vllm serve`` replicas of ``--serve`` (``--replicas``, each with its own local tier when
    more than one, all on one store), behind an nginx router (``--routing``) when more than one;
    restarted on new ports on demand (the local tiers' folders stay); ``stop`` ends them."""

    def __init__(self, args, model: Path, home: Path) -> None:
        self.args, self.model, self.current, self.router = args, model, [], None
        self.writeback: dict = {}  # the stopped servers' write-back counts (kvcodec_writeback_total)
        self.ports: list = []  # the replicas' ports and the router's two, kept across restarts
        self.starts = 0
        self.root = home / f"workload-{int(time.time())}"
        store = args.store or f"file://{self.root / 'store'}"
        self.env = {"KVCODEC_HOME": str(self.root), "KVCODEC_STORE": store}

    def _env(self, replica: int) -> dict:
        if self.args.replicas == 1 or self.args.serve != "kvcodec":
            return self.env
        # each replica is a machine of its own: its local tier (a folder here), read before the store
        return {**self.env, "KVCODEC_LOCAL_STORE": f"file://{self.root / f'replica-{replica}' / 'local'}"}

    def start(self):
        from .ports import free_ports
        from .services.balancer import Balancer
        from .services.vllm_serve import VllmServe
        from .workload_run import OpenAITarget

        self.stop()
        # each replica keeps its address across restarts (a StatefulSet's stable name): the router's
        # consistent hash is a ring of the replicas' addresses, so a new port would move prefixes
        # away from the local tier that holds them
        self.ports = self.ports or free_ports(self.args.replicas + 2)
        ports = self.ports
        for i, port in enumerate(ports[:self.args.replicas]):
            # a folder per start for the logs (a restarted replica keeps its port, whose log it would overwrite)
            server = VllmServe(self.model, self.root / f"start-{self.starts}", self._env(i), port,
                               connector=self.args.serve == "kvcodec")
            print(f"workload: starting vllm serve ({self.args.serve}) replica {i} on port {port}, log {server.log}",
                  file=sys.stderr, flush=True)
            self.current.append(server.start())
        self.starts += 1
        url = self.current[0].url
        if self.args.replicas > 1:
            self.router = Balancer(self.root / "router", "127.0.0.1", ports[-2], ports[-1],
                                   [(s.port, s.port) for s in self.current], timeout_s=int(self.args.timeout_s),
                                   routing=self.args.routing, grpc=False).start()
            url = f"http://{self.router.http_url}"
        return OpenAITarget(url, self.args.served_model or "model", self.args.cache_salt, self.args.timeout_s)

    def drain(self, timeout_s: float = 180.0) -> None:
        """Wait (at most ``timeout_s``) until the connectors have no write-back job waiting or running
        (``kvcodec_writeback_pending`` 0 on their /metrics), so a restart finds what the warm-up wrote."""
        if self.args.serve != "kvcodec":
            return
        deadline = time.monotonic() + timeout_s
        for server in self.current:
            while time.monotonic() < deadline:
                try:
                    # vLLM refreshes the connector's gauges at an engine step: a one-token request (no
                    # whole chunk, nothing written back) makes one, or the gauge would stay as the last
                    # request left it
                    server.completion("ping", 1)
                    if server.metrics().get("kvcodec_writeback_pending", 0) == 0:
                        break
                except OSError:
                    break
                time.sleep(0.5)
            else:
                print("workload: write-back still pending at the restart", file=sys.stderr, flush=True)

    def _by_label(self, family: str, label: str, out: dict) -> dict:
        """``family``'s samples summed over the running replicas by ``label``'s value, added to ``out``."""
        from .services.vllm_serve import by_label

        for server in self.current:
            for key, n in by_label(server.metrics_text(), family, label).items():
                out[key] = out.get(key, 0) + n
        return out

    def tiers(self) -> dict:
        """Chunks the replicas reused, by tier (``kvcodec_tier_chunks_total``: local, remote), summed."""
        return self._by_label("kvcodec_tier_chunks_total", "tier", {"local": 0, "remote": 0})

    def writeback_counts(self) -> dict:
        """Write-back jobs by state (``kvcodec_writeback_total``: queued, stored, dropped, failed,
        skipped) over every server of the run, the stopped ones included."""
        return self._by_label("kvcodec_writeback_total", "state", dict(self.writeback))

    def stop(self) -> None:
        if self.current:
            self.drain()
            if self.args.serve == "kvcodec":
                self.writeback = self.writeback_counts()
            for server in self.current:
                server.stop()
            self.current = []
        if self.router is not None:
            self.router.stop()
            self.router = None


def cmd_workload(args) -> int:
    from kvcodec.engines.gguf import ensure_model
    from kvcodec.engines.tokenizer import Tokenizer

    from .workload import make_row, merge_rows, plot, summary
    from .workload_run import EnsembleTarget, OpenAITarget, WorkloadError, config_dict, run_long_doc_qa, run_multi_round

    prefix = f"kvcodec bench workload {args.workload}"
    try:
        config = _config(args)
    except ValueError as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 2
    if args.peers:
        return _peers(args, config, prefix)
    if args.restart_between_rounds and not args.serve:
        print(f"{prefix}: --restart-between-rounds needs --serve (the command restarts only servers it started)",
              file=sys.stderr)
        return 2
    if args.replicas < 1 or (args.replicas > 1 and not args.serve):
        print(f"{prefix}: --replicas N (N >= 1) needs --serve (the command starts the replicas and their router)",
              file=sys.stderr)
        return 2
    if args.serve and args.target != "openai":
        print(f"{prefix}: --serve starts vllm serve (--target openai)", file=sys.stderr)
        return 2
    settings = _settings(args)
    files = ensure_model(settings.model_cache)
    tokenizer = Tokenizer(files)
    servers = _Servers(args, files.path, Path(settings.home)) if args.serve else None
    run = run_long_doc_qa if args.workload == "long-doc-qa" else run_multi_round
    try:
        if servers is not None:
            target = servers.start()
        elif args.target == "ensemble":
            target = EnsembleTarget(args.url, args.served_model or "kvcodec", args.cache_salt, args.timeout_s)
        else:
            target = OpenAITarget(args.url, args.served_model or "model", args.cache_salt, args.timeout_s)
        restart = servers.start if args.restart_between_rounds else None
        records, times = run(target, tokenizer, config, restart=restart, progress=not args.no_progress)
        tiers = servers.tiers() if servers is not None and args.serve == "kvcodec" else None
        writeback = servers.writeback_counts() if servers is not None and args.serve == "kvcodec" else None
    except (ValueError, WorkloadError) as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 2
    finally:
        if servers is not None:
            servers.stop()
    details = {**config_dict(config), "target": "vllm serve (" + args.serve + ")" if args.serve else args.target,
               "cache_salt": bool(args.cache_salt)}
    if args.serve == "kvcodec":  # the connector's settings as the server had them (the chunk keys left out)
        details["settings"] = {k: v for k, v in {**os.environ, **servers.env}.items()
                               if k.startswith("KVCODEC_") and "KEY" not in k and k != "KVCODEC_HOME"}
    routing = args.routing if args.replicas > 1 else "none"
    details["replicas"] = args.replicas
    if writeback is not None:  # what write-back did under the run's load: stored, or dropped (queue full) and why
        details["writeback"] = writeback
    row = make_row(args.workload, args.method, args.bandwidth_mbps, args.restart_between_rounds, records, details,
                   routing=routing, tiers=tiers, **times)
    print(json.dumps(summary(row), indent=2))
    if args.json:
        rows = merge_rows(Path(args.json), [row])
        if args.plot:
            plot(rows, Path(args.plot), log=lambda m: print(m, file=sys.stderr))
    if not row["answers_equal"]:
        print(f"{prefix}: {row['mismatches']} of {len(records)} answers differ from prefill's", file=sys.stderr)
        return 1
    return 0


def _peers(args, config, prefix: str) -> int:
    """``--peers``: every method at every rate (``workload_peers.run_peers``), rows merged into ``--json``."""
    from kvcodec.engines.gguf import ensure_model
    from kvcodec.engines.tokenizer import Tokenizer

    from .workload import merge_rows, plot, summary
    from .workload_peers import run_peers
    from .workload_run import WorkloadError, run_long_doc_qa, run_multi_round

    settings = _settings(args)
    files = ensure_model(settings.model_cache)
    work = Path(settings.home) / f"workload-peers-{int(time.time())}"
    run = run_long_doc_qa if args.workload == "long-doc-qa" else run_multi_round
    try:
        rows = run_peers(args, config, Tokenizer(files), files.path, work, run,
                         log=lambda m: print(m, file=sys.stderr, flush=True))
    except (ValueError, WorkloadError) as exc:
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps([summary(r) for r in rows], indent=2))
    if args.json:
        merged = merge_rows(Path(args.json), rows)
        if args.plot:
            plot(merged, Path(args.plot), log=lambda m: print(m, file=sys.stderr))
    wrong = [r["method"] for r in rows if not r["answers_equal"]]
    if wrong:
        print(f"{prefix}: answers differ from prefill's: {', '.join(wrong)}", file=sys.stderr)
        return 1
    return 0
