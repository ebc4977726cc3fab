"""``kvcodec bench load``: reuse under load: TTFT of reuse and of prefill requests in flight together,
with variants of the llm step's load path and the engine's scheduling side by side in one run.

1. Ingests ``contexts`` contexts (standard-library code) at one rung (default ``int8-zstd``) with the
   chosen engine, into an nginx store over loopback.
2. For each variant, a tritonserver whose store is that nginx behind a link of ``bandwidth_mbps``
   (``kvcodec_tools.shaping``: netns + tc as root, else the userspace shaper); the variant's settings
   on top of the engine's (adaptive fetcher off: every reuse request fetches):

   - ``wait``: the llm step gives vLLM a request after its last chunk (``stream_loads=0``);
   - ``stream``: at its first chunk; its blocks are allocated at once and each chunk is loaded into
     them as it arrives (an asynchronous load);
   - ``stream-queued``: at its first chunk; vLLM asks again at each step until the chunks are in,
     then loads them synchronously (``async_loads=0``);
   - ``*-sliced``: the same with vLLM's token budget per step and long-prefill slice small
     (``step_tokens``, ``prefill_slice``), so a reuse request's few tokens to compute start at the
     next short step instead of behind other requests' whole prefills;
   - ``NAME@STEP/SLICE`` (``stream@1024/256``): variant NAME with those two sizes, for a sweep.

3. Per variant: every prompt alone, reuse and prefill (the reference answers), then each client
   count: ``clients`` threads released together, each sending ``requests`` requests alternating
   reuse and prefill (``concurrency.plan``: with 4 clients, two reuse and two prefill in flight).

Rows: one per (variant, clients, mode) as ``concurrency.summarize`` makes them, plus the variant.
``checks``: per variant and client count, ``reuse_vs_prefill_ttft`` (reuse TTFT p50 over prefill's)
and ``throughput_vs_wait`` (requests/s of all requests over the ``wait`` variant's at that count).
Exits non-zero when an answer differs from the same request alone.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .cli import DEFAULT_REPOSITORY, PLOT_HELP, REPO_ROOT, _list, _settings, common
from .concurrency import QUESTION, ConcurrencyConfig, _level, context_ids, summarize

SLICED = {"step_tokens": 512, "prefill_slice": 128}  # the vLLM engine's defaults
WHOLE = {"step_tokens": 4096, "prefill_slice": 4096}  # vLLM's own on a CPU: 4096 tokens a step, whole prefills
VARIANTS: Dict[str, Dict[str, object]] = {
    "wait": {"stream_loads": False, **WHOLE},
    "stream": {"stream_loads": True, "async_loads": True, **WHOLE},
    "stream-queued": {"stream_loads": True, "async_loads": False, **WHOLE},
    "wait-sliced": {"stream_loads": False, **SLICED},
    "stream-sliced": {"stream_loads": True, "async_loads": True, **SLICED},
    "stream-queued-sliced": {"stream_loads": True, "async_loads": False, **SLICED},
}


def variant_settings(name: str) -> Dict[str, object]:
    """The settings of a variant: a name of ``VARIANTS``, or ``NAME@STEP/SLICE`` overriding its two sizes."""
    base, _, sizes = name.partition("@")
    if base not in VARIANTS:
        raise ValueError(f"variants must be among {', '.join(VARIANTS)} (optionally @STEP/SLICE), got {name!r}")
    if not sizes:
        return dict(VARIANTS[base])
    step, _, slice_ = sizes.partition("/")
    try:
        step_tokens, prefill_slice = int(step), int(slice_)
    except ValueError:
        raise ValueError(f"variant {name!r}: sizes must be STEP/SLICE token counts, like stream@1024/256") from None
    if not 0 < prefill_slice <= step_tokens:
        raise ValueError(f"variant {name!r}: need 0 < SLICE <= STEP")
    return dict(VARIANTS[base], step_tokens=step_tokens, prefill_slice=prefill_slice)


@dataclass
class LoadConfig:
    clients: List[int]
    variants: List[str]
    bandwidth_mbps: float = 100.0
    delay_ms: float = 1.0
    requests: int = 4
    context_tokens: int = 1024
    contexts: int = 2
    max_tokens: int = 8
    rung: str = "int8-zstd"
    threads: int = 2
    link_mode: str = "auto"

    def __post_init__(self) -> None:
        if not self.variants:
            raise ValueError(f"variants must be among {', '.join(VARIANTS)}, got none")
        for v in self.variants:
            variant_settings(v)
        if not self.clients or any(c < 1 for c in self.clients):
            raise ValueError(f"clients must be counts >= 1, got {self.clients}")
        if self.bandwidth_mbps <= 0:
            raise ValueError(f"bandwidth_mbps must be > 0, got {self.bandwidth_mbps}")


def checks(rows: List[dict]) -> List[dict]:
    """Per (variant, clients): reuse TTFT p50 over prefill's, and requests/s over the wait variant's."""
    by = {(r["variant"], r["clients"], r["mode"]): r for r in rows}
    out = []
    for (variant, clients, mode), r in sorted(by.items()):
        if mode != "all":
            continue
        reuse, prefill = by.get((variant, clients, "reuse")), by.get((variant, clients, "prefill"))
        wait = by.get(("wait", clients, "all"))
        ratio = (reuse["ttft_p50_s"] / prefill["ttft_p50_s"]) if reuse and prefill and prefill["ttft_p50_s"] else None
        tput = (r["requests_per_s"] / wait["requests_per_s"]) if wait and wait["requests_per_s"] else None
        out.append({"variant": variant, "clients": clients,
                    "reuse_ttft_p50_s": reuse["ttft_p50_s"] if reuse else None,
                    "prefill_ttft_p50_s": prefill["ttft_p50_s"] if prefill else None,
                    "reuse_vs_prefill_ttft": round(ratio, 3) if ratio is not None else None,
                    "requests_per_s": r["requests_per_s"],
                    "throughput_vs_wait": round(tput, 3) if tput is not None else None})
    return out


def plot(rows: List[dict], path: Path) -> None:
    """TTFT p50 of reuse and prefill against clients, one colour per variant; requests/s beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r["variant"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, variant in enumerate(variants):
        for mode, style in (("reuse", "-"), ("prefill", ":")):
            pts = sorted((r["clients"], r["ttft_p50_s"]) for r in rows
                         if r["variant"] == variant and r["mode"] == mode and r["ttft_p50_s"] is not None)
            if pts:
                xs, ys = zip(*pts, strict=True)
                left.plot(xs, ys, color=f"C{i}", linestyle=style, marker="o", label=f"{variant} {mode}")
        pts = sorted((r["clients"], r["requests_per_s"]) for r in rows
                     if r["variant"] == variant and r["mode"] == "all" and r["requests_per_s"] is not None)
        if pts:
            xs, ys = zip(*pts, strict=True)
            right.plot(xs, ys, color=f"C{i}", marker="o", label=variant)
    for ax, label, title in ((left, "TTFT p50 (s, client side)", "time to first token"),
                             (right, "requests/s (all)", "throughput")):
        ax.set_xlabel("concurrent clients (half reuse, half prefill)")
        ax.set_ylabel(label)
        ax.set_title(title)
        ax.set_xticks(sorted({r["clients"] for r in rows}))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_load(settings, repository: Path, config: LoadConfig, json_path: Path, plot_path: Optional[Path]) -> int:
    from tqdm import tqdm

    from kvcodec.engines import open_engine
    from kvcodec.ingest import ingest_rungs
    from kvcodec_client.client import KVCodecClient
    from kvcodec_tools.tritonserver import Ports, TritonServer

    from .ports import free_ports
    from .remote_store import loopback_store, new_store_token, store_behind_link

    work = settings.home / "loadbench"
    token = new_store_token()
    engine = open_engine(replace(settings, threads=config.threads))
    question = engine.tokenize(QUESTION)
    prompts: List[List[int]] = []
    with loopback_store(work / "nginx", token) as url:
        for i in range(config.contexts):
            ids = context_ids(engine.tokenizer, config.context_tokens, i)
            ingest_rungs(settings, engine, ids, config.rung, store_url=url, threads=config.threads)
            prompts.append(ids + question)
    if hasattr(engine, "close"):
        engine.close()
    del engine

    rows: List[dict] = []
    failures: List[str] = []
    level_config = ConcurrencyConfig(clients=config.clients, requests=config.requests, max_tokens=config.max_tokens)
    links = []
    total = len(config.variants) * sum(level_config.clients) * config.requests
    bar = tqdm(total=total, unit="req", desc="levels")
    with store_behind_link(work / "nginx", token, config.bandwidth_mbps, config.delay_ms, config.link_mode) as (
            url, link):
        links.append(dict(link.describe(), bandwidth_mbps=config.bandwidth_mbps))
        for variant in config.variants:
            server_settings = replace(settings, store=url, ladder=(config.rung,), adaptive=False, writeback=(),
                                      threads=config.threads, prefix_cache=False,  # the store path
                                      **variant_settings(variant))
            server = TritonServer(repository, server_settings, Ports(*free_ports(3)))
            print(f"starting tritonserver ({settings.engine}, {variant}) ...", flush=True)
            server.start(timeout_s=600)
            try:
                client = KVCodecClient(server.grpc_url, "grpc")
                references: Dict[Tuple[int, str], object] = {}
                for mode in ("reuse", "prefill"):  # one-time costs
                    client.generate(prompts[0], config.max_tokens, reuse=mode == "reuse")
                for p, prompt in enumerate(prompts):
                    for mode in ("reuse", "prefill"):
                        references[p, mode] = client.generate(prompt, config.max_tokens, reuse=mode == "reuse")
                    if references[p, "reuse"].reused_tokens <= 0:
                        failures.append(f"{variant}: prompt {p} reused nothing alone")
                for clients in level_config.clients:
                    bar.set_postfix_str(f"{variant}, {clients} clients")
                    samples, wall_s = _level(server.grpc_url, clients, prompts, references, level_config, bar)
                    for r in summarize(settings.engine, clients, samples, wall_s):
                        rows.append(dict(r, variant=variant))
                    failures += [f"{variant}, {clients} clients: {s.mode} prompt {s.prompt}: "
                                 f"{s.error or 'differs from the same request alone'}"
                                 for s in samples if s.error or not s.match]
            finally:
                server.stop()
    bar.close()
    doc = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu_count": os.cpu_count(),
        "engine": settings.engine,
        "config": {**config.__dict__, "variants": {v: variant_settings(v) for v in config.variants},
                   "prompt_tokens": [len(p) for p in prompts]},
        "links": links,
        "rows": rows,
        "checks": checks(rows),
        "failures": failures[:50],
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\n{'variant':<15}{'clients':>8}{'reuse p50':>11}{'prefill p50':>13}{'ratio':>8}{'req/s':>8}{'vs wait':>9}")
    for c in doc["checks"]:
        print(f"{c['variant']:<15}{c['clients']:>8}{c['reuse_ttft_p50_s'] or 0:>11.3f}{c['prefill_ttft_p50_s'] or 0:>13.3f}"
              f"{c['reuse_vs_prefill_ttft'] or 0:>8.2f}{c['requests_per_s'] or 0:>8.3f}{c['throughput_vs_wait'] or 0:>9.2f}")
    if plot_path:
        plot(rows, plot_path)
        print(f"wrote {plot_path}")
    print(f"wrote {json_path}")
    if failures:
        print(f"WRONG ANSWER ({len(failures)}): " + "; ".join(failures[:10]))
        return 1
    return 0


# -- kvcodec bench load ----------------------------------------------------------------------------
def cmd_bench_load(args) -> int:
    try:
        config = LoadConfig(args.clients, args.variants, bandwidth_mbps=args.bandwidth_mbps, requests=args.requests,
                            context_tokens=args.context_tokens, contexts=args.contexts, max_tokens=args.max_tokens,
                            rung=args.rung, link_mode=args.link_mode,
                            threads=args.threads if args.threads is not None else 2)
    except ValueError as exc:
        raise SystemExit(f"kvcodec bench load: {exc}") from None
    return run_load(_settings(args), Path(args.model_repository), config, Path(args.json),
                    Path(args.plot) if args.plot else None)


def register(sub) -> None:
    """``kvcodec bench load`` under ``kvcodec bench``'s subcommands ``sub``."""
    p = sub.add_parser("load", help="reuse under load: TTFT of reuse and prefill requests in flight together "
                                    "through a shaped link, variants of the load path side by side")
    common(p)
    p.add_argument("--clients", type=_list(int), default=[1, 4, 8])
    p.add_argument("--variants", type=_list(str), default=["wait", "stream", "stream-sliced"],
                   help="of kvcodec_tools.loadbench.VARIANTS: wait, stream, stream-queued, wait-sliced, "
                        "stream-sliced, stream-queued-sliced (sliced: smaller vLLM steps); NAME@STEP/SLICE "
                        "sets the step's token budget and the prefill slice, like stream@1024/256")
    p.add_argument("--bandwidth-mbps", type=float, default=100.0)
    p.add_argument("--link-mode", choices=["auto", "netns", "userspace"], default="auto")
    p.add_argument("--requests", type=int, default=4, help="requests per client, alternating reuse and prefill")
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--contexts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rung", default="int8-zstd")
    p.add_argument("--json", default=str(REPO_ROOT / "perf" / "results" / "reuse_under_load.json"))
    p.add_argument("--plot", default=None, help=PLOT_HELP)
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    p.set_defaults(func=cmd_bench_load)
