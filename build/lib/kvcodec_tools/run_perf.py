"""``make perf`` / ``kvcodec bench perf``: TTFT of KV reuse against full prefill, measured by
Triton's own tools on a real server: perf_analyzer, and genai-perf beside it.

1. sets up perf_analyzer (``.venv-pa/``, ``perf_analyzer_env.sh``);
2. takes the committed inputs ``perf/inputs/default.*`` (or makes them for ``--text-file``, into
   ``<home>/inputs/``), and ingests the context with ``kvcodec ingest`` into a file store under
   ``<home>`` (default ``.cache/perf``), at every rung of ``--ladder`` (by default the bench's:
   kvtc-w, video, int8-zstd, raw; the server's adaptive fetcher chooses per chunk);
3. starts tritonserver on free ports, warms it up and checks that the reuse prompt is served
   from the store (reused_tokens > 0), else stops;
4. runs perf_analyzer with the reuse input, then the prefill input; with ``--genai-perf`` (on for
   ``kvcodec bench perf``) genai-perf after each, on the same server, with the same prompt (its
   ``--input-file``) and ``reuse`` (``--extra-inputs``), ``--backend tensorrtllm --streaming``: its
   TTFT, inter-token latency, request latency and throughputs go into the row as ``genai_perf``;
5. writes ``perf/results/perf_analyzer.json`` and, across links, a plot beside it (``--plot``):
   TTFT against link rate, reuse and prefill, as each tool measured it.

With ``--bandwidth-mbps LIST`` (``make perf``: 100, 1000, 10000) the store is nginx (writes need
a bearer token) and, for each rate, it sits behind a throttled link (``kvcodec_tools.shaping``: a network
namespace with tc, else the userspace shaper; each row's ``link`` says which) with tritonserver
fetching across it; the context is ingested once over loopback. Reuse is measured at every rate,
prefill (which fetches nothing) at the first. Without it: one local server, a file store.

Exits non-zero when perf_analyzer fails or is unstable, or when the reuse rows did not reuse.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT / "perf") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "perf"))

from kvcodec_tools import genai_perf, make_inputs  # noqa: E402
from kvcodec_tools.bench import DEFAULT_LADDER  # noqa: E402
from kvcodec_tools.perf_analyzer import (  # noqa: E402
    RESULTS_PATH,
    PerfAnalyzerError,
    Target,
    ensure_perf_analyzer,
    perf_analyzer_version,
    run_targets,
    write_results,
)
from kvcodec_tools.ports import free_ports  # noqa: E402
from kvcodec_tools.remote_store import loopback_store, new_store_token, store_behind_link  # noqa: E402
from kvcodec_tools.texts import cut_to_tokens  # noqa: E402


def _rates(text: str) -> List[float]:
    try:
        rates = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma list of Mbit/s, got {text!r}") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"rates must be positive Mbit/s, got {text!r}")
    return rates


@contextlib.contextmanager
def local_server(settings) -> Iterator[Tuple[object, Target, dict]]:
    """One tritonserver on this host's store: no link in between."""
    from kvcodec_tools.tritonserver import Ports, TritonServer

    with TritonServer(REPO_ROOT / "model_repository", settings, Ports(*free_ports(3))) as server:
        yield server, Target("local", None, server.grpc_url), {}


@contextlib.contextmanager
def server_across_link(settings, nginx_root: Path, token: str, rate: float, delay_ms: float,
                       mode: str) -> Iterator[Tuple[object, Target, dict]]:
    """nginx behind a link of ``rate`` Mbit/s, and a tritonserver whose store is across it."""
    from kvcodec_tools.tritonserver import Ports, TritonServer

    with store_behind_link(nginx_root, token, rate, delay_ms, mode) as (url, link):
        across = replace(settings, store=url)
        with TritonServer(REPO_ROOT / "model_repository", across, Ports(*free_ports(3))) as server:
            yield server, Target(f"{rate:g}Mbps", rate, server.grpc_url), dict(link.describe(), store_url=url)


def ingest(settings, context_file: Path) -> dict:
    """The context into ``settings.store`` at every rung of ``settings.ladder`` (the one ingest path,
    ``kvcodec.ingest.ingest_rungs``, as ``kvcodec ingest`` and the bench use it)."""
    from kvcodec.engines import open_engine
    from kvcodec.ingest import ingest_rungs

    print(f"ingesting the context into {settings.store} ...", flush=True)
    engine = open_engine(settings)
    report = ingest_rungs(settings, engine, engine.tokenize(context_file.read_text(encoding="utf-8")))
    del engine
    print(f"  {report.chunks} chunks ({report.written} new), {report.bytes_written} bytes", flush=True)
    return {"chunks": report.chunks, "written": report.written, "bytes_written": report.bytes_written}


def _measure(server, target: Target, inputs, prompt: str, meta, args, home: Path) -> Optional[List[dict]]:
    """Warm up, check the reuse prompt reuses, then perf_analyzer on each input file."""
    from kvcodec_client.client import KVCodecClient

    client = KVCodecClient(server.grpc_url, "grpc")
    client.generate(prompt[:100], 2, reuse=False)  # warm-up: first calls pay one-time costs
    client.generate(prompt, 1, reuse=True)  # the fetcher's first estimate of the link
    check = client.generate(prompt, 1, reuse=True)
    print(f"  reuse check: {check.reused_tokens} of {check.prompt_tokens} prompt tokens reused", flush=True)
    if check.reused_tokens <= 0:
        print(f"run_perf: the reuse prompt reused nothing (stats {check.stats})", file=sys.stderr)
        return None
    try:
        rows = run_targets([target], inputs, meta["context_tokens"], request_count=args.request_count,
                           max_trials=args.max_trials, work_dir=home / "perf_analyzer" / target.label)
    except PerfAnalyzerError as exc:
        print(f"run_perf: {exc}", file=sys.stderr)
        return None
    if args.genai_perf:
        try:
            for row in rows:
                row["genai_perf"] = _genai_perf(server, target, prompt, row, args, home)
        except (genai_perf.GenaiPerfError, OSError, subprocess.SubprocessError) as exc:
            print(f"run_perf: genai-perf: {exc}", file=sys.stderr)
            return None
    return rows


def _genai_perf(server, target: Target, prompt: str, row: dict, args, home: Path) -> dict:
    """genai-perf on ``server`` with ``prompt`` and the row's reuse: its figures (``genai_perf.summary``)."""
    from kvcodec.engines.gguf import ensure_model

    binary, env = genai_perf.ensure_genai_perf()
    kind = "reuse" if row["reuse"] else "prefill"
    work = home / "genai_perf" / target.label / kind
    prompts = genai_perf.write_prompts(work / "prompts.jsonl", [prompt])
    result = genai_perf.profile(binary, env, server.grpc_url, ensure_model(args.model_cache).path, work / "out",
                                output_tokens=row["max_tokens"], requests=args.request_count * 3,
                                input_file=prompts, extra_inputs=[f"reuse:{str(row['reuse']).lower()}"])
    out = genai_perf.summary(result)
    ttft = out.get("time_to_first_token", {})
    print(f"  genai-perf [{target.label}, {kind}]: TTFT p50 {ttft.get('p50', float('nan')):.1f} ms, "
          f"ITL p50 {out.get('inter_token_latency', {}).get('p50', float('nan')):.1f} ms", flush=True)
    return dict(out, command=[a if a != str(prompts) else "prompts.jsonl" for a in result["command"]])


def plot(rows: List[dict], path: Path) -> Optional[Path]:
    """TTFT p50 against link rate (log), reuse and prefill, by perf_analyzer and by genai-perf where it
    ran; prefill (which fetches nothing) as a level line. None when no row crossed a link."""
    across = [r for r in rows if r.get("bandwidth_mbps")]
    if not across:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    tools = [("perf_analyzer", lambda r: r["ttft_p50_s"], "o-"),
             ("genai-perf", lambda r: (r.get("genai_perf") or {}).get("time_to_first_token", {}).get("p50", 0) / 1e3,
              "s--")]
    for name, value, style in tools:
        reuse = sorted((r["bandwidth_mbps"], value(r)) for r in across if r["reuse"] and value(r))
        if reuse:
            ax.plot(*zip(*reuse, strict=True), style, label=f"reuse ({name})")
        prefill = [value(r) for r in across if not r["reuse"] and value(r)]
        if prefill:
            ax.axhline(prefill[0], linestyle=":" if name == "perf_analyzer" else "-.", color="gray",
                       label=f"prefill ({name})")
    ax.set_xscale("log")
    ax.set_xlabel("link rate to the store (Mbit/s)")
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title(f"TTFT, {across[0]['context_tokens']}-token context: perf_analyzer and genai-perf")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(p: argparse.ArgumentParser, genai_perf_default: bool = False) -> None:
    p.add_argument("--home", type=Path, default=REPO_ROOT / ".cache" / "perf",
                   help="store, logs and perf_analyzer outputs (default .cache/perf)")
    p.add_argument("--model-cache", type=Path, default=REPO_ROOT / ".cache" / "models")
    p.add_argument("--text-file", type=Path, default=None,
                   help="another context (default: the committed perf/inputs/default.*)")
    p.add_argument("--context-tokens", type=int, default=None, help="cut --text-file to about this many tokens")
    p.add_argument("--max-tokens", type=int, default=make_inputs.MAX_TOKENS)
    p.add_argument("--request-count", type=int, default=3, help="perf_analyzer --measurement-request-count")
    p.add_argument("--max-trials", type=int, default=10, help="perf_analyzer --max-trials: windows to find a stable one")
    p.add_argument("--output", type=Path, default=RESULTS_PATH)
    p.add_argument("--bandwidth-mbps", type=_rates, default=None,
                   help="measure across a throttled link at each of these rates (default: no link)")
    p.add_argument("--delay-ms", type=float, default=1.0, help="the link's one-way delay")
    p.add_argument("--link-mode", choices=("auto", "netns", "userspace"), default="auto")
    p.add_argument("--ladder", default=DEFAULT_LADDER,
                   help="the rungs ingest stores and the server's adaptive fetcher chooses from")
    p.add_argument("--genai-perf", action=argparse.BooleanOptionalAction, default=genai_perf_default,
                   help="also measure with genai-perf (--backend tensorrtllm --streaming) beside perf_analyzer")
    p.add_argument("--plot", type=Path, default=None,
                   help="the plot across links (default: --output's path with .png)")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv), p.error)


def register(sub) -> None:
    """``kvcodec bench perf`` under ``kvcodec bench``'s subcommands ``sub``."""
    p = sub.add_parser("perf", help="TTFT by perf_analyzer and genai-perf, reuse against prefill, across shaped links")
    add_arguments(p, genai_perf_default=True)
    p.set_defaults(func=lambda args: run(args, p.error))


def run(args, error) -> int:
    """The run of the module's docstring; ``error(message)`` refuses bad arguments."""

    from kvcodec import engines
    from kvcodec.settings import Settings

    t_start = time.perf_counter()
    print("perf_analyzer: setting up .venv-pa/ ...", flush=True)
    version = perf_analyzer_version(*ensure_perf_analyzer())
    print(f"perf_analyzer {version}", flush=True)

    home = args.home.resolve()
    settings = Settings.load({"home": str(home), "store": f"file://{home / 'store'}",
                              "model_cache": str(args.model_cache.resolve()), "threads": "1",
                              "ladder": args.ladder, "prefix_cache": "0"}, env={})
    engines.prepare(settings)
    if args.text_file:
        tokenizer = make_inputs.load_tokenizer(settings.model_cache)
        text = args.text_file.read_text(encoding="utf-8")
        if args.context_tokens:
            text = cut_to_tokens(tokenizer, text, args.context_tokens)
        name = args.text_file.stem
        make_inputs.make_inputs(tokenizer, text, name, home / "inputs", max_tokens=args.max_tokens,
                                source=args.text_file.name)
        files = make_inputs.paths(name, home / "inputs")
    else:
        files = make_inputs.paths(make_inputs.DEFAULT_NAME)
        if args.max_tokens != make_inputs.MAX_TOKENS:
            error("--max-tokens other than the committed inputs' needs --text-file")
    meta = json.loads(files["meta"].read_text())
    [prompt] = json.loads(files["reuse"].read_text())["data"][0]["text_input"]
    print(f"context: {meta['context_tokens']} tokens ({meta['source']}), prompt {meta['prompt_tokens']} tokens, "
          f"max_tokens {meta['max_tokens']}", flush=True)

    if args.bandwidth_mbps:
        token = new_store_token()  # nginx takes writes only with it; ingest inherits it
        nginx_root = home / "nginx"
        with loopback_store(nginx_root, token) as url:
            ingest(replace(settings, store=url), files["context"])
        servers = [lambda rate=rate: server_across_link(settings, nginx_root, token, rate, args.delay_ms,
                                                        args.link_mode) for rate in args.bandwidth_mbps]
    else:
        ingest(settings, files["context"])
        servers = [lambda: local_server(settings)]

    rows: List[dict] = []
    for i, make_server in enumerate(servers):
        inputs = [files["reuse"], files["prefill"]] if i == 0 else [files["reuse"]]
        t0 = time.perf_counter()
        with make_server() as (server, target, link):
            print(f"[{target.label}] tritonserver ready in {time.perf_counter() - t0:.1f} s "
                  f"(gRPC {server.grpc_url}, log {server.log_path}){'; link ' + link['kind'] if link else ''}",
                  flush=True)
            got = _measure(server, target, inputs, prompt, meta, args, home)
            if got is None:
                return 1
            for row in got:
                row["link"] = link.get("kind", "none")
            rows += got
    write_results(rows, args.output, version)
    drawn = plot(rows, args.plot or args.output.with_suffix(".png"))

    print()
    print(f"{'label':<10}{'Mbit/s':>8}{'link':>10}{'reuse':>7}{'requests':>10}{'p50 s':>9}{'p90 s':>9}"
          f"{'mean s':>9}{'reused':>8}")
    for r in rows:
        mbps = "-" if r["bandwidth_mbps"] is None else f"{r['bandwidth_mbps']:g}"
        print(f"{r['label']:<10}{mbps:>8}{r['link']:>10}{str(r['reuse']).lower():>7}{r['requests']:>10}"
              f"{r['ttft_p50_s']:>9.3f}{r['ttft_p90_s']:>9.3f}{r['ttft_mean_s']:>9.3f}{str(r['reused_tokens']):>8}")
    for r in rows:
        g = r.get("genai_perf")
        if g:
            print(f"genai-perf {r['label']} reuse={str(r['reuse']).lower()}: TTFT p50 "
                  f"{g['time_to_first_token']['p50']:.1f} ms, ITL p50 {g['inter_token_latency']['p50']:.1f} ms, "
                  f"{g['output_token_throughput']['avg']:.1f} tokens/s")
    print(f"\nwrote {args.output}{' and ' + str(drawn) if drawn else ''} in {time.perf_counter() - t_start:.0f} s")
    bad = [r["label"] for r in rows if r["reuse"] and not (r["reused_tokens"] or 0) > 0]
    if bad:
        print(f"run_perf: reuse rows that did not reuse: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
