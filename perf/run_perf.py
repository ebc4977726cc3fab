"""``make perf``: TTFT of KV reuse against full prefill, measured by perf_analyzer on a real server.

1. sets up perf_analyzer (``.venv-pa/``, ``perf_analyzer_env.sh``);
2. takes the committed inputs ``perf/inputs/default.*`` (or makes them for ``--text-file``, into
   ``<home>/inputs/``), and ingests the context with ``kvcodec ingest`` into a file store under
   ``<home>`` (default ``.cache/perf``);
3. starts tritonserver on free ports, warms it up and checks that the reuse prompt is served
   from the store (reused_tokens > 0), else stops;
4. runs perf_analyzer with the reuse input, then the prefill input, at each target (for now one:
   the local server, no throttled link), and writes ``perf/results/perf_analyzer.json``.

Exits non-zero when perf_analyzer fails or is unstable, or when the reuse rows did not reuse.
The link is not wired in yet: ``targets_for(server)`` is where throttled targets will come from.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from perf import make_inputs  # noqa: E402
from perf.perf_analyzer import (RESULTS_PATH, PerfAnalyzerError, Target, ensure_perf_analyzer,  # noqa: E402
                                perf_analyzer_version, run_targets, write_results)

KVCODEC = Path(sys.executable).parent / "kvcodec"


from kvcodec_client.ports import free_ports  # noqa: E402


def targets_for(server) -> List[Target]:
    """Where perf_analyzer measures: the local server, no link in between (for now)."""
    return [Target("local", None, server.grpc_url)]


def ingest(settings, context_file: Path) -> dict:
    cmd = [str(KVCODEC), "ingest", "--home", str(settings.home), "--store", settings.store,
           "--model-cache", str(settings.model_cache), "--threads", "1",
           "--text-file", str(context_file), "--json", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"run_perf: kvcodec ingest failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--home", type=Path, default=REPO_ROOT / ".cache" / "perf",
                   help="store, logs and perf_analyzer outputs (default .cache/perf)")
    p.add_argument("--model-cache", type=Path, default=REPO_ROOT / ".cache" / "models")
    p.add_argument("--text-file", type=Path, default=None,
                   help="another context (default: the committed perf/inputs/default.*)")
    p.add_argument("--context-tokens", type=int, default=None, help="cut --text-file to about this many tokens")
    p.add_argument("--max-tokens", type=int, default=make_inputs.MAX_TOKENS)
    p.add_argument("--request-count", type=int, default=3, help="perf_analyzer --measurement-request-count")
    p.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = p.parse_args(argv)

    from kvcodec.engines.model_files import ensure_model
    from kvcodec.settings import Settings
    from kvcodec.tritonserver import Ports, TritonServer
    from kvcodec_client.client import KVCodecClient

    t_start = time.perf_counter()
    print("perf_analyzer: setting up .venv-pa/ ...", flush=True)
    version = perf_analyzer_version(*ensure_perf_analyzer())
    print(f"perf_analyzer {version}", flush=True)

    home = args.home.resolve()
    settings = Settings.load({"home": str(home), "store": f"file://{home / 'store'}",
                              "model_cache": str(args.model_cache.resolve()), "threads": "1"}, env={})
    ensure_model(settings.model_cache)
    if args.text_file:
        tokenizer = make_inputs.load_tokenizer(settings.model_cache)
        text = args.text_file.read_text(encoding="utf-8")
        if args.context_tokens:
            text = make_inputs.cut_to_tokens(tokenizer, text, args.context_tokens)
        name = args.text_file.stem
        make_inputs.make_inputs(tokenizer, text, name, home / "inputs", max_tokens=args.max_tokens,
                                source=args.text_file.name)
        files = make_inputs.paths(name, home / "inputs")
    else:
        files = make_inputs.paths(make_inputs.DEFAULT_NAME)
        if args.max_tokens != make_inputs.MAX_TOKENS:
            p.error("--max-tokens other than the committed inputs' needs --text-file")
    meta = json.loads(files["meta"].read_text())
    prompt_ids = json.loads(files["reuse"].read_text())["data"][0]["input_ids"]["content"]
    print(f"context: {meta['context_tokens']} tokens ({meta['source']}), prompt {meta['prompt_tokens']} tokens, "
          f"max_tokens {meta['max_tokens']}; store {settings.store}", flush=True)

    print("ingesting the context (kvcodec ingest) ...", flush=True)
    report = ingest(settings, files["context"])
    print(f"  {report['chunks']} chunks ({report['written']} new), {report['bytes_written']} bytes", flush=True)

    print("starting tritonserver ...", flush=True)
    t0 = time.perf_counter()
    http, grpc, metrics = free_ports(3)
    with TritonServer(REPO_ROOT / "model_repository", settings, Ports(http, grpc, metrics)) as server:
        print(f"  ready in {time.perf_counter() - t0:.1f} s (gRPC {server.grpc_url}, log {server.log_path})",
              flush=True)
        client = KVCodecClient(server.grpc_url, "grpc")
        client.generate(prompt_ids[:32], 2, reuse=False)  # warm-up: first calls pay one-time costs
        check = client.generate(prompt_ids, 1, reuse=True)
        print(f"  reuse check: {check.reused_tokens} of {len(prompt_ids)} prompt tokens reused", flush=True)
        if check.reused_tokens <= 0:
            print(f"run_perf: the reuse prompt reused nothing (stats {check.stats})", file=sys.stderr)
            return 1
        try:
            rows = run_targets(targets_for(server), [files["reuse"], files["prefill"]], meta["context_tokens"],
                               request_count=args.request_count, work_dir=home / "perf_analyzer")
        except PerfAnalyzerError as exc:
            print(f"run_perf: {exc}", file=sys.stderr)
            return 1
    write_results(rows, args.output, version)

    print()
    print(f"{'label':<10}{'Mbit/s':>8}{'reuse':>7}{'requests':>10}{'p50 s':>9}{'p90 s':>9}{'mean s':>9}{'reused':>8}")
    for r in rows:
        mbps = "-" if r["bandwidth_mbps"] is None else f"{r['bandwidth_mbps']:g}"
        print(f"{r['label']:<10}{mbps:>8}{str(r['reuse']).lower():>7}{r['requests']:>10}{r['ttft_p50_s']:>9.3f}"
              f"{r['ttft_p90_s']:>9.3f}{r['ttft_mean_s']:>9.3f}{str(r['reused_tokens']):>8}")
    print(f"\nwrote {args.output} in {time.perf_counter() - t_start:.0f} s")
    bad = [r["label"] for r in rows if r["reuse"] and not (r["reused_tokens"] or 0) > 0]
    if bad:
        print(f"run_perf: reuse rows that did not reuse: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
