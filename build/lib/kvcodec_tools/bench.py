"""``kvcodec bench ttft``: TTFT of every method, side by side, same store, same link.

For each link rate it brings up a throttled link (``kvcodec_tools.shaping``: a network namespace with tc,
or the userspace shaper), starts an nginx store (``kvcodec_tools.services.nginx``) on the far side of it
serving the chunks ingested once beforehand, starts tritonserver on the model repository with that
store and the kvcodec ladder, and asks each method the same prompts over gRPC:

- ``prefill``: no reuse;
- ``raw``, ``int8-zstd``, ``cachegen``, ``transform-zstd``, ``video`` (and any other rung spec):
  that rung alone, lossy ones at a setting that passes the quality gate on the eval set
  (``GATED``: from ``perf/results/rd.json``; the row's ``rung`` says which);
- ``kvcodec``: the server's ladder, chosen per chunk by the adaptive fetcher.

Each (method, rate, context) is asked once to warm up, then ``runs`` times. Rows carry
``{method, bandwidth_mbps, context_tokens, ttft_p50_s, ttft_p90_s, bytes_fetched, tokens_match}``
plus what explains them (reused tokens, rungs used, the pipeline bound and overlap, the link kind).
``checks`` in the JSON evaluates the targets of the TTFT issue on the rows. The command exits
non-zero when a lossless method's tokens differ from prefill's (a wrong answer).
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from kvcodec.format import ladder as ladder_defaults

from .cli import DEFAULT_REPOSITORY, PLOT_HELP, REPO_ROOT, _list, _settings, common
from .stats import percentile
from .texts import stdlib_text

# Context sources: real standard-library code, concatenated until the context is long enough.
SOURCES = ["json/decoder.py", "json/encoder.py", "csv.py", "textwrap.py", "shlex.py", "heapq.py",
           "bisect.py", "queue.py", "sched.py", "fnmatch.py", "glob.py", "string.py", "calendar.py"]
QUESTION = "\n\n# Question: which function above is the longest?\n# Answer:"
METHODS = ("prefill", "raw", "int8-zstd", "cachegen", "kvtc", "transform-zstd", "kvtc-w", "video", "kvcodec")
LOSSLESS = {"prefill", "raw"}
# The setting each lossy method runs at: the coarsest that passed the gate (mean KL <= 0.01, top-1
# >= 0.95) in `make eval` (perf/results/rd.json); the others' defaults pass it as they are.
GATED = {"cachegen": "cachegen:96"}
# What ingest stores for the kvcodec method: the video rung, the transform rung (the best ratio at
# the gate), and the cheap-to-decode rungs for fast links.
DEFAULT_LADDER = ",".join(ladder_defaults.DEFAULT_LADDER)


def method_rung(method: str) -> str:
    """The rung spec a static method fetches (its gated setting where it has one)."""
    return GATED.get(method, method)


@dataclass
class BenchConfig:
    bandwidths_mbps: List[float]
    contexts: List[int]
    methods: List[str]
    ladder: str = DEFAULT_LADDER
    runs: int = 3
    prefill_runs: int = 2
    max_tokens: int = 4
    delay_ms: float = 1.0
    link_mode: str = "auto"
    threads: int = 2


def context_ids(tokenizer, tokens: int) -> List[int]:
    """The first ``tokens`` token ids of real standard-library code."""
    ids: List[int] = []
    for name in SOURCES * 4:
        ids += tokenizer.encode(stdlib_text(name))
        if len(ids) >= tokens:
            return ids[:tokens]
    raise RuntimeError(f"not enough source text for {tokens} tokens")


def method_rungs(methods: Sequence[str], ladder: str) -> List[str]:
    """Every rung spec to ingest: each static method's, then the ladder's."""
    out: List[str] = []
    for m in methods:
        specs = ladder.split(",") if m == "kvcodec" else [] if m == "prefill" else [method_rung(m)]
        out += [s.strip() for s in specs if s.strip() and s.strip() not in out]
    return out


def run_bench(settings, repository: Path, config: BenchConfig, json_path: Path, plot_path: Optional[Path]) -> int:
    from tqdm import tqdm

    from kvcodec.engines import open_engine
    from kvcodec.format.ladder import parse_ladder
    from kvcodec.ingest import ingest_rungs
    from kvcodec_client.client import KVCodecClient
    from kvcodec_tools.tritonserver import Ports, TritonServer

    from .ports import free_ports
    from .remote_store import loopback_store, new_store_token, store_behind_link

    rungs = method_rungs(config.methods, config.ladder)
    parse_ladder(rungs)  # unknown names fail here, before anything starts
    work = settings.home / "bench"
    token = new_store_token()  # writes need it; the server inherits it

    # 1. Ingest every rung of every context once, over loopback (not through the link).
    engine = open_engine(replace(settings, threads=config.threads))
    prompts: Dict[int, List[int]] = {}
    question = engine.tokenize(QUESTION)
    with loopback_store(work / "nginx", token) as url:
        for n in config.contexts:
            ids = context_ids(engine.tokenizer, n)
            prompts[n] = ids + question
            with tqdm(total=n // settings.chunk_tokens, unit="chunk",
                      desc=f"ingest {n} tokens x {len(rungs)} rungs") as bar:
                report = ingest_rungs(settings, engine, ids, rungs, store_url=url, threads=config.threads,
                                      progress=bar.update)
            for name, r in report.rungs.items():
                if r.written:
                    print(f"  {name}: {r.ratio_vs_fp16:.2f}x vs fp16, encode {r.encode_s:.1f}s, "
                          f"decode {r.decode_s:.2f}s")
    if hasattr(engine, "close"):
        engine.close()  # vLLM: its stepping thread; each server starts its own engine
    del engine

    rows: List[dict] = []
    links: List[dict] = []
    wrong: List[str] = []
    total = len(config.bandwidths_mbps) * len(config.contexts) * len(config.methods)
    bar = tqdm(total=total, unit="cell", desc="ttft sweep")
    for bw in config.bandwidths_mbps:
        with store_behind_link(work / "nginx", token, bw, config.delay_ms, config.link_mode) as (url, link):
            links.append(dict(link.describe(), bandwidth_mbps=bw, store_url=url))
            server_settings = replace(settings, store=url, ladder=tuple(s.strip() for s in config.ladder.split(",")),
                                      adaptive=True, threads=config.threads, prefix_cache=False)  # the store path
            server = TritonServer(repository, server_settings, Ports(*free_ports(3)))
            server.start(timeout_s=600)  # the vLLM engine takes a while to load
            try:
                client = KVCodecClient(server.grpc_url, "grpc")
                client.generate(prompts[config.contexts[0]][:32], 1, reuse=False)  # one-time costs
                for n in config.contexts:
                    prefill_tokens = None
                    for method in config.methods:
                        bar.set_postfix_str(f"{bw:g} Mbit/s, {n} tokens, {method}")
                        row = _measure(client, method, prompts[n], config)
                        row.update(bandwidth_mbps=bw, context_tokens=n, link=link.kind)
                        if method == "prefill":
                            prefill_tokens = row.pop("_tokens")
                        else:
                            tokens = row.pop("_tokens")
                            row["tokens_match"] = prefill_tokens is not None and tokens == prefill_tokens
                        if method == "prefill":
                            row["tokens_match"] = True
                        if method in LOSSLESS and not row["tokens_match"]:
                            wrong.append(f"{method} at {bw} Mbit/s, {n} tokens")
                        rows.append(row)
                        bar.update(1)
            finally:
                server.stop()
    bar.close()
    result = {"rows": rows, "links": links, "engine": settings.engine, "config": {**config.__dict__, "rungs": rungs},
              "checks": checks(rows), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    print_table(rows)
    print(json.dumps(result["checks"], indent=1))
    if plot_path:
        plot(rows, plot_path)
        print(f"wrote {plot_path}")
    print(f"wrote {json_path}")
    if wrong:
        print("WRONG ANSWER (lossless method differs from prefill): " + "; ".join(wrong))
        return 1
    return 0


def _measure(client, method: str, prompt: List[int], config: BenchConfig) -> dict:
    reuse = method != "prefill"
    codecs = None if method in ("prefill", "kvcodec") else method_rung(method)
    runs = config.prefill_runs if method == "prefill" else config.runs
    if method != "prefill":
        client.generate(prompt, config.max_tokens, reuse=True, codecs=codecs)  # warm-up (and link estimate)
    results = [client.generate(prompt, config.max_tokens, reuse=reuse, codecs=codecs) for _ in range(runs)]
    ttfts = [r.ttft_s for r in results]
    last = results[-1].stats
    pipe = last.get("pipeline") or {}
    bounds = [(r.stats.get("pipeline") or {}).get("bound_with_compute_s") for r in results]
    bounds = [b for b in bounds if b]
    return {
        "method": method,
        "rung": codecs or ("ladder" if reuse else ""),
        "ttft_p50_s": round(percentile(ttfts, 50), 4),
        "ttft_p90_s": round(percentile(ttfts, 90), 4),
        "ttft_s": [round(t, 4) for t in ttfts],
        "bytes_fetched": int(last.get("bytes_fetched", 0)),
        "reused_tokens": results[-1].reused_tokens,
        "prompt_tokens": len(prompt),
        "schemes": last.get("schemes", {}),
        "miss_reason": last.get("miss_reason", ""),
        "server_ttft_s": last.get("server_ttft_s"),
        "compute_first_token_s": last.get("compute_first_token_s"),
        "pipeline_bound_s": round(statistics.median(bounds), 4) if bounds else None,
        "slowest_stage": pipe.get("slowest_stage", ""),
        "hidden_fraction": pipe.get("hidden_fraction"),
        "stage_s": {k: pipe.get(k) for k in ("transfer_s", "decode_s", "restore_s")} if pipe else {},
        "_tokens": results[-1].tokens,
    }


def checks(rows: List[dict]) -> dict:
    """The TTFT issue's targets, evaluated on the rows (missing rows make a check ``None``)."""
    by = {(r["method"], r["bandwidth_mbps"], r["context_tokens"]): r for r in rows}
    out: Dict[str, object] = {}
    cells = sorted({(r["bandwidth_mbps"], r["context_tokens"]) for r in rows})
    adaptivity = {}
    for bw, n in cells:
        k = by.get(("kvcodec", bw, n))
        static = [r for (m, b, c), r in by.items() if b == bw and c == n and m != "kvcodec"]
        if k and static:
            best = min(static, key=lambda r: r["ttft_p50_s"])
            adaptivity[f"{bw:g}Mbps/{n}"] = {"best_static": best["method"],
                                             "ratio": round(k["ttft_p50_s"] / best["ttft_p50_s"], 3)}
    out["kvcodec_vs_best_static"] = adaptivity
    out["adaptivity_within_1.1x"] = all(v["ratio"] <= 1.1 for v in adaptivity.values()) if adaptivity else None
    n_max = max((r["context_tokens"] for r in rows), default=0)
    k, raw, pre = (by.get((m, 100.0, n_max)) or by.get((m, 100, n_max)) for m in ("kvcodec", "raw", "prefill"))
    if k and raw:
        out["at_100mbps_raw_over_kvcodec"] = round(raw["ttft_p50_s"] / k["ttft_p50_s"], 3)
        out["at_100mbps_3x_below_raw"] = raw["ttft_p50_s"] >= 3 * k["ttft_p50_s"]
    if k and pre:
        out["at_100mbps_below_prefill"] = k["ttft_p50_s"] < pre["ttft_p50_s"]
    if k and k.get("pipeline_bound_s"):
        out["at_100mbps_over_pipeline_bound"] = round(k["ttft_p50_s"] / k["pipeline_bound_s"], 3)
        out["at_100mbps_within_1.3x_of_bound"] = k["ttft_p50_s"] <= 1.3 * k["pipeline_bound_s"]
    out["lossless_tokens_match"] = all(r["tokens_match"] for r in rows if r["method"] in LOSSLESS)
    return out


def print_table(rows: List[dict]) -> None:
    print(f"\n{'method':<12}{'Mbit/s':>8}{'context':>9}{'TTFT p50':>10}{'p90':>8}{'MB':>8}{'reused':>8}  match  rungs")
    for r in rows:
        print(f"{r['method']:<12}{r['bandwidth_mbps']:>8g}{r['context_tokens']:>9}{r['ttft_p50_s']:>10.3f}"
              f"{r['ttft_p90_s']:>8.3f}{r['bytes_fetched'] / 1e6:>8.1f}{r['reused_tokens']:>8}  "
              f"{str(r['tokens_match']).lower():<6} {r.get('schemes') or ''}")


def plot(rows: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context_tokens"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.5), squeeze=False)
    for ax, n in zip(axes[0], contexts, strict=True):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["bandwidth_mbps"], r["ttft_p50_s"]) for r in rows
                         if r["method"] == method and r["context_tokens"] == n)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=method, linewidth=2.5 if method == "kvcodec" else 1.2)
        ax.set_xscale("log")
        ax.set_xlabel("link bandwidth (Mbit/s)")
        ax.set_ylabel("TTFT p50 (s)")
        ax.set_title(f"{n}-token context")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# -- kvcodec bench ttft ----------------------------------------------------------------------------
def cmd_bench_ttft(args) -> int:
    config = BenchConfig(args.bandwidth_mbps, args.context_tokens, args.methods, ladder=args.ladder, runs=args.runs,
                         prefill_runs=args.prefill_runs, max_tokens=args.max_tokens, delay_ms=args.delay_ms,
                         link_mode=args.link_mode, threads=args.threads if args.threads is not None else 2)
    return run_bench(_settings(args), Path(args.model_repository), config, Path(args.json),
                     Path(args.plot) if args.plot else None)


def register(sub) -> None:
    """``kvcodec bench ttft`` under ``kvcodec bench``'s subcommands ``sub``."""
    p = sub.add_parser("ttft", help="TTFT of every method against link bandwidth (starts link, store, server)")
    common(p)
    p.add_argument("--bandwidth-mbps", type=_list(float), default=[100.0, 1000.0, 10000.0])
    p.add_argument("--context-tokens", type=_list(int), default=[1024, 4096])
    p.add_argument("--methods", type=_list(str), default=list(METHODS),
                   help="prefill, kvcodec (the adaptive ladder), or a rung spec (raw, int8-zstd, cachegen, video, ...)")
    p.add_argument("--ladder", default=DEFAULT_LADDER, help="the rungs the kvcodec method chooses from")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prefill-runs", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--delay-ms", type=float, default=1.0, help="one-way delay of the link")
    p.add_argument("--link-mode", choices=["auto", "netns", "userspace"], default="auto")
    p.add_argument("--json", default=str(REPO_ROOT / "perf" / "results" / "ttft.json"))
    p.add_argument("--plot", default=None, help=PLOT_HELP)
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    p.set_defaults(func=cmd_bench_ttft)
