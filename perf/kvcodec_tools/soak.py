"""``kvcodec soak``: load for a while, every answer checked, the server's footprint watched.

1. Ingests ``contexts`` contexts (real standard-library code, ``kvcodec_tools.texts``) at the rungs ``raw`` and
   ``int8-zstd`` with the chosen engine (``--engine``) into an nginx store on loopback
   (``kvcodec_tools.services.nginx``: every reuse request reads the store over HTTP), then closes the engine.
2. Starts tritonserver on that store: ladder ``raw,int8-zstd``, the adaptive fetcher off (a
   request's rung never depends on load, so its answer does not either), write-back at ``raw``.
3. Asks every prompt alone, in every mode, one request at a time: the reference answers. Modes:
   ``prefill`` (reuse off), ``raw`` (reuse through the server's ladder: its first rung, ``raw``) and
   ``int8-zstd`` (reuse pinned to that rung with the request's ``codecs`` input).
4. Runs ``clients`` threads for ``duration_s`` (half gRPC streaming, half HTTP ``generate_stream``
   when both protocols are asked: client ``c`` uses ``protocols[c % len(protocols)]``), each asking
   request after request (``plan``: every prompt in every mode, ``max_tokens`` each). An answer
   whose tokens differ from the reference, or a request that fails, is an error.
5. A sampler thread, every ``sample_s``, reads the footprint of the tritonserver process and all
   its descendants (the python stubs) from ``/proc`` (``kvcodec_tools.procstats.sample_tree``:
   resident memory, open file descriptors, live processes and zombies, threads, and the python
   backend's shared memory).

The result (JSON and a plot of RSS, fds, shm and processes against time):
``requests`` done, ``requests_per_s``, ``errors`` (failed or differing answers) with the first
messages, TTFT p50/p90/p99 per protocol and mode (client side), the samples, and ``growth``: for RSS,
shm, fds and processes the median of the last window (``window_s``, default the last minute)
minus the median of the first window after the warm-up (from ``warmup_s``, default 30 s, for
``window_s``). Thresholds (``flat``): RSS grows by less than ``RSS_GROWTH_LIMIT`` (5%) of its first
window's median, and fds, processes and shm do not grow at all (growth <= 0). A run too short for
both windows is not flat. The command exits non-zero when there is an error or the footprint is
not flat.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .cli import DEFAULT_REPOSITORY, PLOT_HELP, REPO_ROOT, _list, _settings, common
from .footprint import RSS_GROWTH_LIMIT, flatness, growth, windows
from .procstats import sample_tree
from .soak_prompts import QUESTION, context_ids
from .stats import percentile

RUNGS = ("raw", "int8-zstd")
# mode -> (reuse, codecs): reuse off; the server's ladder (raw first, static); pinned to int8-zstd
MODES: Dict[str, Tuple[bool, Optional[str]]] = {"prefill": (False, None), "raw": (True, None),
                                                "int8-zstd": (True, "int8-zstd")}


@dataclass
class SoakConfig:
    clients: int = 8
    duration_s: float = 300.0
    protocols: Tuple[str, ...] = ("grpc", "http")
    contexts: int = 3
    context_tokens: int = 600
    max_tokens: int = 8
    threads: int = 2
    sample_s: float = 5.0
    warmup_s: float = 30.0
    window_s: float = 60.0
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        self.protocols = tuple(self.protocols)
        if self.clients < 1 or self.contexts < 1 or self.max_tokens < 1:
            raise ValueError("clients, contexts and max_tokens must be >= 1")
        if not self.protocols or any(p not in ("grpc", "http") for p in self.protocols):
            raise ValueError(f"protocols must be grpc and/or http, got {','.join(self.protocols)}")
        if self.duration_s <= 0 or self.sample_s <= 0 or self.window_s <= 0 or self.warmup_s < 0:
            raise ValueError("duration_s, sample_s and window_s must be > 0, warmup_s >= 0")


# -- the load (pure parts) -----------------------------------------------------------------------
def step(client: int, j: int, prompts: int) -> Tuple[int, str]:
    """(prompt, mode) of a client's ``j``-th request: every (prompt, mode) pair in turn, each client
    starting at another pair."""
    k = client + j
    return k % prompts, list(MODES)[(k // prompts) % len(MODES)]


def plan(client: int, prompts: int, n: int) -> List[Tuple[int, str]]:
    """(prompt, mode) of a client's first ``n`` requests."""
    return [step(client, j, prompts) for j in range(n)]


@dataclass
class Outcome:
    client: int
    protocol: str
    prompt: int
    mode: str
    t_s: float  # when it ended, from the start of the load
    ttft_s: Optional[float] = None
    total_s: Optional[float] = None
    error: str = ""  # a failure, or a wrong answer


def ttft_table(outcomes: Sequence[Outcome]) -> Dict[str, Dict[str, dict]]:
    """{protocol: {mode: {requests, p50_s, p90_s, p99_s}}} over the successful requests (client side)."""
    groups: Dict[Tuple[str, str], List[float]] = defaultdict(list)
    for o in outcomes:
        if not o.error and o.ttft_s is not None:
            groups[o.protocol, o.mode].append(o.ttft_s)
    out: Dict[str, Dict[str, dict]] = defaultdict(dict)
    for (protocol, mode), xs in sorted(groups.items()):
        out[protocol][mode] = {"requests": len(xs), **{f"p{q}_s": round(percentile(xs, q), 4) for q in (50, 90, 99)}}
    return dict(out)


def summarize(config: SoakConfig, outcomes: Sequence[Outcome], samples: Sequence[dict], wall_s: float) -> dict:
    """The JSON document's measured part."""
    errors = [o for o in outcomes if o.error]
    grown, base = growth(samples, config.warmup_s, config.window_s)
    flat, why = flatness(grown, base)
    first, last = windows(samples, config.warmup_s, config.window_s)
    return {
        "requests": len(outcomes),
        "requests_per_s": round(len(outcomes) / wall_s, 4) if wall_s > 0 else None,
        "wall_s": round(wall_s, 2),
        "errors": len(errors),
        "wrong_answers": sum(1 for o in errors if o.error.startswith("wrong answer")),
        "error_messages": [f"client {o.client} ({o.protocol}) prompt {o.prompt} {o.mode}: {o.error}"
                           for o in errors[:10]],
        "by_protocol": {p: sum(1 for o in outcomes if o.protocol == p) for p in config.protocols},
        "ttft": ttft_table(outcomes),
        "growth": grown,
        "first_window_median": base,
        "windows_s": {"first": [s["t_s"] for s in first[:1] + first[-1:]], "last": [s["t_s"] for s in last[:1] + last[-1:]]},
        "flat": flat,
        "not_flat": why,
        "thresholds": {"rss_growth_below": f"{100 * RSS_GROWTH_LIMIT:g}% of the first window's median",
                       "fds_processes_shm_growth": "<= 0", "warmup_s": config.warmup_s, "window_s": config.window_s},
        "samples": list(samples),
    }


def plot(samples: Sequence[dict], path: Path, config: SoakConfig, title: str = "") -> None:
    """RSS, fds, shm and processes of the server's process tree against time, the windows shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [s["t_s"] for s in samples]
    panels = (("rss_bytes", "RSS (MiB)", 2**20), ("fds", "open fds", 1), ("shm_bytes", "python backend shm (MiB)", 2**20),
              ("processes", "processes", 1))
    first, last = windows(samples, config.warmup_s, config.window_s)
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    for ax, (key, label, scale) in zip(axes.flat, panels, strict=True):
        ax.plot(ts, [s[key] / scale for s in samples], marker=".", linewidth=1.2)
        for win, color in ((first, "C2"), (last, "C3")):
            if win:
                ax.axvspan(win[0]["t_s"], win[-1]["t_s"], color=color, alpha=0.12)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("seconds under load")
    fig.suptitle(title or "tritonserver and its stubs under load (green: first window, red: last)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the run -------------------------------------------------------------------------------------
class Sampler(threading.Thread):
    """Samples ``sample_tree(root)`` every ``every_s`` from ``t0`` until ``until_s`` (the load's end:
    the clients' last requests finishing are not sampled) or until stopped; progress on stdout."""

    def __init__(self, root: int, every_s: float, t0: float, until_s: float, progress) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.root, self.every_s, self.t0, self.until_s, self.progress = root, every_s, t0, until_s, progress
        self.samples: List[dict] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while True:
            t = time.monotonic() - self.t0
            if t > self.until_s + 0.5:
                return
            sample = {"t_s": round(t, 2), **sample_tree(self.root), **self.progress()}
            self.samples.append(sample)
            print(f"[{t:6.0f} s] {sample['requests']:5d} requests, {sample['errors']} errors; RSS "
                  f"{sample['rss_bytes'] / 2**20:7.1f} MiB, {sample['fds']} fds, {sample['processes']} processes, "
                  f"{sample['threads']} threads, shm {sample['shm_bytes'] / 2**20:.1f} MiB", flush=True)
            if self.stopped.wait(self.every_s - (time.monotonic() - self.t0 - t)):
                return


def run_soak(settings, repository: Path, config: SoakConfig, json_path: Path, plot_path: Optional[Path]) -> int:
    from tqdm import tqdm

    from kvcodec.engines import open_engine
    from kvcodec.ingest import ingest_rungs
    from kvcodec_client.client import KVCodecClient
    from kvcodec_tools.tritonserver import Ports, TritonServer

    from .ports import free_ports
    from .remote_store import loopback_store, new_store_token

    work = settings.home / "soak"
    token = new_store_token()  # the write-back (vLLM) presents it; the server inherits it
    settings = replace(settings, threads=config.threads)
    engine_name = settings.engine
    with loopback_store(work / "nginx", token) as url:
        # 1. Ingest each context at every rung, over loopback, then close the engine.
        engine = open_engine(settings)
        question = engine.tokenize(QUESTION)
        prompts: List[List[int]] = []
        with tqdm(total=config.contexts, unit="context", desc=f"ingest ({engine_name}, {','.join(RUNGS)})") as bar:
            for i in range(config.contexts):
                ids = context_ids(engine.tokenizer, config.context_tokens, i)
                ingest_rungs(settings, engine, ids, list(RUNGS), store_url=url, threads=config.threads)
                prompts.append(ids + question)
                bar.update(1)
        if hasattr(engine, "close"):
            engine.close()  # vLLM: its stepping thread; the server starts its own engine
        del engine

        server_settings = replace(settings, store=url, ladder=RUNGS, adaptive=False, writeback=(RUNGS[0],),
                                  prefix_cache=False)  # every reuse crosses the store
        server = TritonServer(repository, server_settings, Ports(*free_ports(3)), log_path=work / "tritonserver.log")
        print(f"starting tritonserver ({engine_name}; store {url}) ...", flush=True)
        server.start(timeout_s=600)
        try:
            references, ref_failures = _references(KVCodecClient(server.grpc_url, "grpc", config.request_timeout_s),
                                                   prompts, config)
            idle = sample_tree(server.pid)
            outcomes, samples, wall_s = [], [], 0.0
            if len(references) == len(prompts) * len(MODES):
                print(f"{len(references)} reference answers; {config.clients} clients for {config.duration_s:g} s "
                      f"({', '.join(config.protocols)}) ...", flush=True)
                outcomes, samples, wall_s = _load(server, prompts, references, config)
        finally:
            server.stop()
            print(f"server stopped; log {server.log_path}", flush=True)

    result = {"engine": engine_name, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "cpu_count": os.cpu_count(),
              "config": {**asdict(config), "rungs": list(RUNGS), "modes": list(MODES), "store": "nginx (loopback)",
                         "prompt_tokens": [len(p) for p in prompts], "chunk_tokens": settings.chunk_tokens},
              "references": [{"prompt": p, "mode": m, "tokens": t} for (p, m), t in sorted(references.items())],
              "reference_failures": ref_failures, "idle_sample": idle,
              **summarize(config, outcomes, samples, wall_s)}
    if ref_failures:
        result["errors"] += len(ref_failures)
        result["error_messages"] = ref_failures[:10] + result["error_messages"]
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    if plot_path:
        plot(samples, plot_path, config, f"soak: {engine_name}, {config.clients} clients, {config.duration_s:g} s")
        print(f"wrote {plot_path}")
    print(f"wrote {json_path}")
    print(json.dumps({k: result[k] for k in ("requests", "requests_per_s", "errors", "growth", "flat", "not_flat")}))
    if result["errors"] or not result["flat"]:
        print(f"SOAK FAILED: {result['errors']} errors; " + ("; ".join(result["not_flat"]) or "flat")
              + "".join(f"\n  {m}" for m in result["error_messages"]))
        return 1
    return 0


def _references(client, prompts: List[List[int]], config: SoakConfig) -> Tuple[Dict[Tuple[int, str], List[int]],
                                                                                List[str]]:
    """Every (prompt, mode) asked alone: its tokens; failures where reuse reused nothing, or raw reuse
    (the engine's own KV) differs from prefill."""
    for reuse, codecs in MODES.values():  # one-time costs of each step (imports, first calls)
        client.generate(prompts[0], config.max_tokens, reuse=reuse, codecs=codecs)
    refs: Dict[Tuple[int, str], List[int]] = {}
    failures = []
    for p, prompt in enumerate(prompts):
        for mode, (reuse, codecs) in MODES.items():
            try:
                r = client.generate(prompt, config.max_tokens, reuse=reuse, codecs=codecs)
            except Exception as exc:  # reported; the load does not start without every reference
                failures.append(f"reference prompt {p} {mode}: {type(exc).__name__}: {exc}"[:500])
                continue
            refs[p, mode] = r.tokens
            if reuse and r.reused_tokens <= 0:
                failures.append(f"reference prompt {p} {mode}: reused nothing ({r.stats.get('miss_reason', '')})")
        if (p, "raw") in refs and (p, "prefill") in refs and refs[p, "raw"] != refs[p, "prefill"]:
            failures.append(f"reference prompt {p}: raw reuse {refs[p, 'raw']} != prefill {refs[p, 'prefill']}")
    return refs, failures


def _load(server, prompts: List[List[int]], references, config: SoakConfig) -> Tuple[List[Outcome], List[dict], float]:
    """The clients for ``duration_s`` and the sampler; (outcomes, samples, wall seconds)."""
    from kvcodec_client.client import KVCodecClient

    outcomes: List[Outcome] = []
    lock = threading.Lock()
    start = threading.Barrier(config.clients + 1)
    clock = {}  # t0 and the deadline, set before the barrier opens

    def progress() -> dict:
        with lock:
            return {"requests": len(outcomes), "errors": sum(1 for o in outcomes if o.error)}

    def work(c: int) -> None:
        protocol = config.protocols[c % len(config.protocols)]
        client = KVCodecClient(server.grpc_url if protocol == "grpc" else server.http_url, protocol,
                               config.request_timeout_s)
        start.wait()
        j = 0
        while time.monotonic() < clock["deadline"]:
            p, mode = step(c, j, len(prompts))
            reuse, codecs = MODES[mode]
            o = Outcome(c, protocol, p, mode, 0.0)
            try:
                r = client.generate(prompts[p], config.max_tokens, reuse=reuse, codecs=codecs)
                o.ttft_s, o.total_s = r.ttft_s, r.total_s
                if r.tokens != references[p, mode]:
                    o.error = f"wrong answer: {r.tokens} != alone {references[p, mode]}"
            except Exception as exc:  # a failed request is a counted error, not a crash
                o.error = f"{type(exc).__name__}: {exc}"[:500]
            o.t_s = round(time.monotonic() - clock["t0"], 3)
            with lock:
                outcomes.append(o)
            j += 1

    threads = [threading.Thread(target=work, args=(c,), name=f"soak-client{c}", daemon=True)
               for c in range(config.clients)]
    for t in threads:
        t.start()
    t0 = clock["t0"] = time.monotonic()
    clock["deadline"] = t0 + config.duration_s
    start.wait()
    sampler = Sampler(server.pid, config.sample_s, t0, config.duration_s, progress)
    sampler.start()
    for t in threads:
        t.join(config.duration_s + config.request_timeout_s + 60)
    wall_s = time.monotonic() - t0
    sampler.stopped.set()
    sampler.join()
    with lock:
        return list(outcomes), sampler.samples, wall_s


# -- kvcodec soak ----------------------------------------------------------------------------------
def soak_config(args):
    """The ``SoakConfig`` of ``kvcodec soak``'s flags (exits with one line on a bad value)."""
    try:
        return SoakConfig(args.clients, args.duration_s, tuple(args.protocols), contexts=args.contexts,
                          context_tokens=args.context_tokens, max_tokens=args.max_tokens,
                          threads=args.threads if args.threads is not None else 2, sample_s=args.sample_s,
                          warmup_s=args.warmup_s, window_s=args.window_s)
    except ValueError as exc:
        raise SystemExit(f"kvcodec soak: {exc}") from None


def chaos_config(args):
    """The ``chaos.ChaosConfig`` of ``kvcodec soak --chaos``'s flags (exits with one line on a bad value)."""
    from .chaos import ChaosConfig

    try:
        return ChaosConfig(servers=args.servers, clients=args.clients, duration_s=args.duration_s, store=args.chaos_store,
                           faults=tuple(args.faults or ()), seed=args.seed, mean_gap_s=args.mean_gap_s,
                           protocols=tuple(args.protocols), contexts=min(args.contexts, 2),
                           context_tokens=args.context_tokens, max_tokens=args.max_tokens,
                           threads=args.threads if args.threads is not None else 1, sample_s=args.sample_s,
                           warmup_s=args.warmup_s, window_s=args.window_s, fallback_s=args.fallback_s,
                           disk_mb=args.disk_mb)
    except ValueError as exc:
        raise SystemExit(f"kvcodec soak --chaos: {exc}") from None


def cmd_soak(args) -> int:
    json_path = Path(args.json or REPO_ROOT / "perf" / "results" / ("chaos.json" if args.chaos else "reliability.json"))
    plot_path = json_path.with_suffix(".png") if args.plot is None else Path(args.plot) if args.plot else None
    if args.chaos:
        from .chaos import default_engine, run_chaos

        config = chaos_config(args)
        if args.engine is None and not os.environ.get("KVCODEC_ENGINE"):
            args.engine = default_engine()
        return run_chaos(_settings(args), Path(args.model_repository), config, json_path, plot_path)
    return run_soak(_settings(args), Path(args.model_repository), soak_config(args), json_path, plot_path)


def register(sub) -> None:
    """``kvcodec soak`` under the CLI's subcommands ``sub``."""
    p = sub.add_parser("soak", help="concurrent clients for a while (gRPC and HTTP, reuse and prefill), every answer "
                                    "checked, the server's RSS, fds, shm and processes sampled; exits 1 on an "
                                    "error or growth; --chaos: with faults, several servers")
    common(p)
    p.add_argument("--clients", type=int, default=8, help="concurrent clients, shared out over the protocols")
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--protocols", type=_list(str), default=["grpc", "http"])
    p.add_argument("--contexts", type=int, default=3, help="different contexts the prompts are made of")
    p.add_argument("--context-tokens", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between footprint samples")
    p.add_argument("--warmup-s", type=float, default=30.0, help="the first window starts after this")
    p.add_argument("--window-s", type=float, default=60.0, help="growth: last window's median - first window's")
    p.add_argument("--json", default=None, help="the result (default perf/results/reliability.json, with --chaos "
                                                 "perf/results/chaos.json)")
    chaos = p.add_argument_group("chaos", "--chaos: several servers behind the balancer while the store, the link, "
                                          "the stubs and the decoders fail at random moments (kvcodec_tools.chaos)")
    chaos.add_argument("--chaos", action="store_true", help="inject faults under load (exits 1 on a wrong or lost "
                                                            "answer, a corrupt chunk stored, an unhealed fault, growth)")
    chaos.add_argument("--servers", type=int, default=2, help="tritonservers behind the balancer")
    chaos.add_argument("--chaos-store", default="nginx", choices=("nginx", "redis", "redis-cluster", "s3"))
    chaos.add_argument("--faults", type=_list(str), default=None,
                       help="fault kinds (default: every one the store allows; disk-full only as root): store-kill, "
                            "store-pause, trickle, stall, failover, disk-full, stub-kill, decoder-kill")
    chaos.add_argument("--seed", type=int, default=0, help="the fault schedule's seed")
    chaos.add_argument("--mean-gap-s", type=float, default=20.0, help="mean seconds between fault starts")
    chaos.add_argument("--fallback-s", type=float, default=300.0,
                       help="a client asks again after a server failure for up to this long (then the request is lost)")
    chaos.add_argument("--disk-mb", type=int, default=512, help="the tmpfs under the nginx store (disk-full)")
    p.add_argument("--plot", default=None, help=PLOT_HELP)
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    p.set_defaults(func=cmd_soak)
