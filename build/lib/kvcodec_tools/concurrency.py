"""``kvcodec bench concurrency``: requests/s and TTFT as concurrent clients grow, per engine.

1. Ingests ``contexts`` different contexts (real standard-library code, ``kvcodec_tools.texts``) at the
   ``raw`` rung with the chosen engine (``--engine``), into a file store of its own (no link):
   ``raw`` is each engine's own KV, so a reuse answer must equal prefill's exactly. Then closes
   the engine (vLLM steps it on a thread of its own; the server starts its own engine).
2. Starts one tritonserver on the model repository with that store (ladder ``raw``, the adaptive
   fetcher off: every reuse request fetches; write-back at ``raw``, which is stored already).
   ``--servers N`` (N > 1): N tritonservers, each its own home (logs, cost model), the one store and
   chunk key, behind the nginx ``Balancer`` (round-robin); the clients go through the balancer.
   Rows carry ``servers``; runs at other server counts are kept in the JSON, side by side.
3. Asks every prompt (context + question) alone, once with reuse and once with prefill, one after
   the other: the reference answers (and reuse's must equal prefill's).
4. For each client count ``C``: ``C`` threads, each with its own gRPC client
   (``kvcodec_client.KVCodecClient``), released together, each sends ``requests`` requests one
   after the other, alternating reuse and prefill (client ``c``'s ``j``-th request: prompt
   ``(c + j) % contexts``, reuse when ``c + j`` is even), ``max_tokens`` each.

Rows, one per (engine, clients, mode) with mode ``all``, ``reuse``, ``prefill``: ``requests_per_s``
(the mode's requests of the level / the level's wall time), ``ttft_p50_s`` / ``ttft_p90_s`` (client
side), ``total_p50_s``, ``answers_match`` (every answer equals the same request made alone, token
for token), ``speedup_vs_1`` (requests/s over the clients=1 row of the same engine and mode: the
one-at-a-time baseline, also under ``engines.<engine>.baseline``). The JSON keeps other engines'
rows: running once per engine's venv builds a side-by-side file and plot. The command exits
non-zero when an answer differs or a request fails (a wrong answer).
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .bench import SOURCES
from .cli import DEFAULT_REPOSITORY, PLOT_HELP, REPO_ROOT, _list, _settings, common
from .stats import percentile
from .texts import stdlib_text

QUESTION = "\n\n# Question: which function above is called first?\n# Answer:"
MODES = ("all", "reuse", "prefill")
RUNG = "raw"  # each engine's own KV: reuse gives prefill's tokens exactly


@dataclass
class ConcurrencyConfig:
    clients: List[int]
    requests: int = 4
    context_tokens: int = 600
    contexts: int = 3
    max_tokens: int = 16
    threads: int = 2
    servers: int = 1  # tritonservers on the one store; > 1: behind the nginx Balancer, clients through it

    def __post_init__(self) -> None:
        if self.servers < 1:
            raise ValueError(f"servers must be >= 1, got {self.servers}")
        if not self.clients or any(c < 1 for c in self.clients):
            raise ValueError(f"clients must be counts >= 1, got {self.clients}")
        if self.requests < 1 or self.contexts < 1 or self.max_tokens < 1:
            raise ValueError("requests, contexts and max_tokens must be >= 1")
        # clients=1 is the one-at-a-time baseline every speedup is measured against
        self.clients = sorted(set(self.clients) | {1})


@dataclass
class Sample:
    """One request's outcome inside a level."""

    client: int
    prompt: int
    mode: str  # reuse or prefill
    ttft_s: float = 0.0
    total_s: float = 0.0
    reused_tokens: int = 0
    server_ttft_s: Optional[float] = None  # the server's own clock, request in to first token
    compute_s: Optional[float] = None  # the engine's seconds to the first token (no queueing)
    match: bool = False
    error: str = ""
    tokens: List[int] = field(default_factory=list)


def plan(client: int, requests: int, prompts: int) -> List[Tuple[int, str]]:
    """(prompt index, mode) of each request a client sends, in order."""
    return [((client + j) % prompts, "reuse" if (client + j) % 2 == 0 else "prefill") for j in range(requests)]


def context_ids(tokenizer, tokens: int, index: int) -> List[int]:
    """The first ``tokens`` token ids of standard-library code, starting at source ``index``:
    contexts of different indices differ from their first chunk."""
    ids: List[int] = []
    names = SOURCES[index % len(SOURCES):] + SOURCES[:index % len(SOURCES)]
    for name in names * 4:
        ids += tokenizer.encode(stdlib_text(name))
        if len(ids) >= tokens:
            return ids[:tokens]
    raise RuntimeError(f"not enough source text for {tokens} tokens")


# -- the pure parts: rows, speedups, merging, table, plot -----------------------------------------
def summarize(engine: str, clients: int, samples: Sequence[Sample], wall_s: float) -> List[dict]:
    """The rows of one level: one per mode (``all``, ``reuse``, ``prefill``)."""
    rows = []
    for mode in MODES:
        picked = [s for s in samples if mode == "all" or s.mode == mode]
        if not picked:
            continue
        ok = [s for s in picked if not s.error]
        ttfts = [s.ttft_s for s in ok]
        totals = [s.total_s for s in ok]
        server = [s.server_ttft_s for s in ok if s.server_ttft_s is not None]
        compute = [s.compute_s for s in ok if s.compute_s is not None]
        rows.append({
            "engine": engine,
            "clients": clients,
            "mode": mode,
            "requests": len(picked),
            "errors": len(picked) - len(ok),
            "wall_s": round(wall_s, 4),
            "requests_per_s": round(len(ok) / wall_s, 4) if wall_s > 0 else None,
            "ttft_p50_s": round(percentile(ttfts, 50), 4) if ttfts else None,
            "ttft_p90_s": round(percentile(ttfts, 90), 4) if ttfts else None,
            "total_p50_s": round(percentile(totals, 50), 4) if totals else None,
            "server_ttft_p50_s": round(percentile(server, 50), 4) if server else None,
            "compute_first_token_p50_s": round(percentile(compute, 50), 4) if compute else None,
            "reused_tokens_min": min((s.reused_tokens for s in ok), default=0),
            "mismatches": sum(1 for s in picked if not s.match),
            "answers_match": all(s.match for s in picked),
        })
    return rows


def add_speedups(rows: List[dict]) -> List[dict]:
    """``speedup_vs_1`` on every row: its requests/s over the clients=1 row of the same engine and
    mode (None without one)."""
    base = {(r["engine"], r.get("servers", 1), r["mode"]): r["requests_per_s"] for r in rows if r["clients"] == 1}
    for r in rows:
        b = base.get((r["engine"], r.get("servers", 1), r["mode"]))
        r["speedup_vs_1"] = round(r["requests_per_s"] / b, 3) if b and r["requests_per_s"] is not None else None
    return rows


def merge(existing: Optional[dict], engine: str, rows: List[dict], meta: dict, servers: int = 1) -> dict:
    """The JSON document: ``existing``'s rows and metadata of other engines (or server counts), this
    engine's at ``servers`` replaced (metadata under ``engine``, or ``engine/servers=N`` for N > 1)."""
    existing = existing if isinstance(existing, dict) else {}
    name = engine if servers == 1 else f"{engine}/servers={servers}"
    kept = [r for r in existing.get("rows", []) if isinstance(r, dict)
            and (r.get("engine") != engine or r.get("servers", 1) != servers)]
    engines = {k: v for k, v in (existing.get("engines") or {}).items() if k != name}
    engines[name] = meta
    order = {name: i for i, name in enumerate(MODES)}
    merged = sorted(kept + rows, key=lambda r: (r["engine"], r.get("servers", 1), r["clients"],
                                                order.get(r["mode"], len(order))))
    return {"rows": merged, "engines": dict(sorted(engines.items())),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu_count": os.cpu_count()}


def read_json(path: Path) -> Optional[dict]:
    """The document at ``path``, or None when there is none (or it is not one of ours)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("rows"), list) else None


def print_table(rows: List[dict]) -> None:
    print(f"\n{'engine':<14}{'clients':>8} {'mode':<9}{'req/s':>8}{'x vs 1':>8}{'TTFT p50':>10}{'p90':>8}"
          f"{'total p50':>11}{'compute':>9}  match")
    for r in rows:
        print(f"{r['engine']:<14}{r['clients']:>8} {r['mode']:<9}{_num(r, 'requests_per_s', 8)}"
              f"{_num(r, 'speedup_vs_1', 8, 2)}{_num(r, 'ttft_p50_s', 10)}{_num(r, 'ttft_p90_s', 8)}"
              f"{_num(r, 'total_p50_s', 11)}{_num(r, 'compute_first_token_p50_s', 9)}  "
              f"{str(r['answers_match']).lower()}")


def _num(row: dict, key: str, width: int, digits: int = 3) -> str:
    v = row.get(key)
    return f"{v:>{width}.{digits}f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"


def plot(rows: List[dict], path: Path) -> None:
    """Requests/s and TTFT p50 against clients, one line per (engine, mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"all": "-", "reuse": "--", "prefill": ":"}
    engines = list(dict.fromkeys((r["engine"], r.get("servers", 1)) for r in rows))
    colors = {e: f"C{i}" for i, e in enumerate(engines)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for engine in engines:
        for mode in MODES:
            pts = sorted((r["clients"], r["requests_per_s"], r["ttft_p50_s"]) for r in rows
                         if (r["engine"], r.get("servers", 1)) == engine and r["mode"] == mode
                         and r["requests_per_s"] is not None)
            if not pts:
                continue
            xs, rps, ttft = zip(*pts, strict=True)
            kw = dict(color=colors[engine], linestyle=styles.get(mode, "-"), marker="o", label=f"{engine[0]}{'' if engine[1] == 1 else f' x{engine[1]} servers'} {mode}")
            left.plot(xs, rps, linewidth=2.5 if mode == "all" else 1.2, **kw)
            if mode != "all":  # all mixes reuse and prefill: its TTFT says little
                right.plot(xs, ttft, linewidth=1.5, **kw)
    for ax, label in ((left, "requests/s"), (right, "TTFT p50 (s, client side)")):
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_xticks(sorted({r["clients"] for r in rows}))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    left.set_title("throughput")
    right.set_title("time to first token")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the run -------------------------------------------------------------------------------------
def run_concurrency(settings, repository: Path, config: ConcurrencyConfig, json_path: Path,
                    plot_path: Optional[Path]) -> int:
    from tqdm import tqdm

    from kvcodec.engines import open_engine
    from kvcodec.ingest import ingest_rungs
    from kvcodec_client.client import KVCodecClient
    from kvcodec_tools.tritonserver import Ports, TritonServer

    from .ports import free_ports

    work = settings.home / "concurrency"
    store = f"file://{work / 'store'}"
    settings = replace(settings, store=store, ladder=(RUNG,), adaptive=False, writeback=(RUNG,),
                       threads=config.threads)
    engine_name = settings.engine

    # 1. Ingest each context at raw with this engine, then close it.
    engine = open_engine(settings)
    question = engine.tokenize(QUESTION)
    prompts: List[List[int]] = []
    with tqdm(total=config.contexts * (config.context_tokens // settings.chunk_tokens), unit="chunk",
              desc=f"ingest {config.contexts} x {config.context_tokens} tokens ({engine_name}, {RUNG})") as bar:
        for i in range(config.contexts):
            ids = context_ids(engine.tokenizer, config.context_tokens, i)
            ingest_rungs(settings, engine, ids, RUNG, threads=config.threads, progress=bar.update)
            prompts.append(ids + question)
    if hasattr(engine, "close"):
        engine.close()  # vLLM: its stepping thread; the server starts its own engine
    del engine

    rows: List[dict] = []
    failures: List[str] = []
    references: Dict[Tuple[int, str], object] = {}
    # each server its own home (logs, cost model); the store and chunk key are shared
    settings = replace(settings, prefix_cache=False)  # every reuse crosses the store
    servers = [TritonServer(repository, settings if config.servers == 1 else
                            replace(settings, home=work / f"server{i}"), Ports(*free_ports(3)))
               for i in range(config.servers)]
    balancer = None
    print(f"starting {config.servers} tritonserver(s) ({engine_name}) ...", flush=True)
    try:
        for server in servers:
            server.start(timeout_s=600)
        url = servers[0].grpc_url
        if config.servers > 1:
            from .services.balancer import Balancer

            http_port, grpc_port = free_ports(2)
            balancer = Balancer(work / "balancer", "127.0.0.1", http_port, grpc_port,
                                [(s.ports.http, s.ports.grpc) for s in servers]).start()
            url = balancer.grpc_url
        client = KVCodecClient(url, "grpc")
        for _ in servers:  # one-time costs of each step (imports, first calls), on every server
            for mode in ("reuse", "prefill"):
                client.generate(prompts[0], config.max_tokens, reuse=mode == "reuse")
        # 2. The reference answers: every prompt alone, reuse and prefill, one after the other.
        for p, prompt in enumerate(tqdm(prompts, desc="references (alone)", unit="prompt")):
            for mode in ("reuse", "prefill"):
                references[p, mode] = client.generate(prompt, config.max_tokens, reuse=mode == "reuse")
            if references[p, "reuse"].reused_tokens <= 0:
                failures.append(f"prompt {p}: the reuse request reused nothing "
                                f"({references[p, 'reuse'].stats.get('miss_reason', '')})")
            if references[p, "reuse"].tokens != references[p, "prefill"].tokens:
                failures.append(f"prompt {p}: reuse alone differs from prefill alone (raw must be exact)")
        # 3. The levels.
        total = sum(config.clients) * config.requests
        with tqdm(total=total, unit="req", desc="levels") as bar:
            for clients in config.clients:
                bar.set_postfix_str(f"{clients} clients")
                samples, wall_s = _level(url, clients, prompts, references, config, bar)
                level = summarize(engine_name, clients, samples, wall_s)
                for r in level:
                    r["servers"] = config.servers
                rows += level
                for s in samples:
                    if s.error:
                        failures.append(f"{clients} clients, client {s.client}: {s.mode} prompt {s.prompt}: {s.error}")
                    elif not s.match:
                        failures.append(f"{clients} clients, client {s.client}: {s.mode} prompt {s.prompt}: "
                                        f"{s.tokens} != alone {references[s.prompt, s.mode].tokens}")
    finally:
        if balancer is not None:
            balancer.stop()
        for server in servers:
            server.stop()

    add_speedups(rows)
    meta = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu_count": os.cpu_count(),
        "config": {**config.__dict__, "rung": RUNG, "chunk_tokens": settings.chunk_tokens,
                   "prompt_tokens": [len(p) for p in prompts], "store": "file (loopback, no link)"},
        "baseline": {r["mode"]: {k: r[k] for k in ("requests_per_s", "ttft_p50_s", "total_p50_s")}
                     for r in rows if r["clients"] == 1},
        "references": [{"prompt": p, "mode": m, "ttft_s": round(r.ttft_s, 4), "total_s": round(r.total_s, 4),
                        "compute_first_token_s": r.stats.get("compute_first_token_s"),
                        "reused_tokens": r.reused_tokens, "tokens": r.tokens}
                       for (p, m), r in sorted(references.items())],
        "failures": failures[:50],
    }
    doc = merge(read_json(json_path), engine_name, rows, meta, config.servers)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    print_table(doc["rows"])
    if plot_path:
        plot(doc["rows"], plot_path)
        print(f"wrote {plot_path}")
    print(f"wrote {json_path}")
    if failures:
        print(f"WRONG ANSWER ({len(failures)}): " + "; ".join(failures[:10]))
        return 1
    return 0


def _level(url: str, clients: int, prompts: List[List[int]], references, config: ConcurrencyConfig,
           bar) -> Tuple[List[Sample], float]:
    """Run one level: ``clients`` threads released together; returns the samples and the wall time."""
    from kvcodec_client.client import KVCodecClient

    samples: List[List[Sample]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)
    lock = threading.Lock()

    def work(c: int) -> None:
        client = KVCodecClient(url, "grpc")
        start.wait()
        for p, mode in plan(c, config.requests, len(prompts)):
            s = Sample(c, p, mode)
            try:
                r = client.generate(prompts[p], config.max_tokens, reuse=mode == "reuse")
                s.ttft_s, s.total_s, s.reused_tokens, s.tokens = r.ttft_s, r.total_s, r.reused_tokens, r.tokens
                s.server_ttft_s, s.compute_s = r.stats.get("server_ttft_s"), r.stats.get("compute_first_token_s")
                s.match = r.tokens == references[p, mode].tokens
            except Exception as exc:  # a failed request is a failed check, reported, not a crash
                s.error = f"{type(exc).__name__}: {exc}"
            samples[c].append(s)
            with lock:
                bar.update(1)

    threads = [threading.Thread(target=work, args=(c,), name=f"client{c}") for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return [s for per in samples for s in per], time.perf_counter() - t0


# -- kvcodec bench concurrency ---------------------------------------------------------------------
def concurrency_config(args):
    """The ``ConcurrencyConfig`` of ``kvcodec bench concurrency``'s flags (one line on a bad value)."""
    try:
        return ConcurrencyConfig(args.clients, requests=args.requests, context_tokens=args.context_tokens,
                                 contexts=args.contexts, max_tokens=args.max_tokens,
                                 threads=args.threads if args.threads is not None else 2,
                                 servers=args.servers)
    except ValueError as exc:
        raise SystemExit(f"kvcodec bench concurrency: {exc}") from None


def cmd_bench_concurrency(args) -> int:
    return run_concurrency(_settings(args), Path(args.model_repository), concurrency_config(args), Path(args.json),
                           Path(args.plot) if args.plot else None)


def register(sub) -> None:
    """``kvcodec bench concurrency`` under ``kvcodec bench``'s subcommands ``sub``."""
    p = sub.add_parser("concurrency", help="requests/s and TTFT against concurrent clients, reuse and prefill "
                                           "(one server, file store; merges the engine's rows into the JSON)")
    common(p)
    p.add_argument("--clients", type=_list(int), default=[1, 4, 8], help="client counts (1, the baseline, is added)")
    p.add_argument("--requests", type=int, default=4, help="requests per client, alternating reuse and prefill")
    p.add_argument("--context-tokens", type=int, default=600)
    p.add_argument("--contexts", type=int, default=3, help="different contexts the prompts are made of")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--servers", type=int, default=1, help="tritonservers on the one store; more than 1: behind "
                                                         "an nginx load balancer, clients through it")
    p.add_argument("--json", default=str(REPO_ROOT / "perf" / "results" / "concurrency.json"))
    p.add_argument("--plot", default=None, help=PLOT_HELP)
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    p.set_defaults(func=cmd_bench_concurrency)
