"""The ``kvcodec`` command: a thin dispatcher. The product library is ``kvcodec``; the client
library is ``kvcodec_client`` (it imports nothing of these tools); serving, benchmarks and the
quality harness are the tools of this package, ``kvcodec_tools`` (under ``perf/``: the
tritonserver launcher, bench, demo, rd, eval). Imports go one way: tools -> client -> library.

    kvcodec serve    [--engine E] [--store URL] [--ladder RUNGS] [--http-port 8000 --grpc-port 8001 --metrics-port 8002]
    kvcodec ingest   --text-file F [--codec RUNG[,RUNG...]] [--quality Q] [--store URL] [--engine E]
    kvcodec generate --text-file F --max-tokens N [--protocol grpc|http] [--url U] [--no-reuse] [--json]
    kvcodec eval     --text-file F --prefix-tokens P --continuation-tokens C --codec NAME [--quality Q] [--json]
    kvcodec rd       [--json perf/results/rd.json --plot perf/results/rd.png] (every codec over the eval set)
    kvcodec eval-task --task passkey --codec RUNG[,RUNG...] --samples N --context-tokens T [--json] [--out FILE]
    kvcodec profile fit [--out backends/kvcodec/profiles/smollm2-135m-v1.npz] [--tokens 2048] [--model DIR]
    kvcodec profile weigh --base smollm2-135m-v1 --out backends/kvcodec/profiles/smollm2-135m-v2.npz
    kvcodec demo     [--json perf/results/demo.json]
    kvcodec bench ttft --bandwidth-mbps 100,1000,10000 --context-tokens 1024,4096 --methods LIST --json FILE
    kvcodec bench concurrency [--engine E] --clients 1,4,8 --requests 4 [--json perf/results/concurrency.json]
    kvcodec bench load --engine vllm --bandwidth-mbps 100 --clients 1,4,8 --variants wait,stream,stream-sliced
    kvcodec repository --variant cpu|gpu|trtllm|trtllm-llmapi --out DIR [--gpus 0] [--store URL] [--ladder RUNGS]
    kvcodec soak     [--engine E] --clients 8 --duration-s 300 --protocols grpc,http [--json perf/results/reliability.json]
    kvcodec store usage --store URL [--json];  kvcodec store gc --store URL --max-bytes N [--older-than D]

Commands that load a model take ``--model DIR`` (a Hugging Face folder of a Llama-family model;
default the embedded SmolLM2-135M-Instruct). Settings not given as flags come from ``KVCODEC_*``
variables, then defaults (see
``kvcodec.settings``); the store defaults to ``file://./.cache/store``.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REPOSITORY = REPO_ROOT / "model_repository"


def _settings(args):
    from kvcodec.settings import Settings

    explicit = {"home": args.home, "store": args.store, "model_cache": args.model_cache}
    for name in ("threads", "decoder", "ladder", "engine", "model"):
        if getattr(args, name, None) not in (None, ""):
            explicit[name] = str(getattr(args, name))
    return Settings.load(explicit)


def _read_text(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"kvcodec: cannot read --text-file {path}: {exc}") from None
    if not text.strip():
        raise SystemExit(f"kvcodec: --text-file {path} is empty")
    return text


def _unreachable(url: str, timeout_s: float = 5.0) -> str:
    """Why nothing accepts a connection at ``url`` (``HOST:PORT``), or "" when something does."""
    import socket

    host, _, port = url.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return ""
    except ValueError:
        return f"not a HOST:PORT address: {url!r}"
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _store_down(settings, timeout_s: float = 5.0) -> str:
    """Why the settings' store does not answer one look-up within ``timeout_s`` ("" when it does)."""
    import time

    from kvcodec.errors import StoreUnavailable
    from kvcodec.store import open_store
    from kvcodec.store.deadline import call_deadline

    try:
        with call_deadline(time.monotonic() + timeout_s), open_store(settings.store,
                                                                     settings.store_ca_file or None) as store:
            store.exists("kvcodec/probe")
    except StoreUnavailable as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ""


def _probe_store(settings) -> None:
    """Ingest's look-up in the store before any model is loaded: one line and exit when it is down."""
    down = _store_down(settings)
    if down:
        raise SystemExit(f"kvcodec ingest: {down}; start the store or pass --store")


# Engines that need a package a venv may lack: (module, where that engine runs).
ENGINE_HOMES = {
    "vllm": ("vllm", f"the vLLM venv: {REPO_ROOT / '.venv-vllm' / 'bin' / 'kvcodec'} (make setup-vllm builds it)"),
    "trtllm": ("tensorrt_llm", "TensorRT-LLM's container (docs/deploy-trtllm.md)"),
}
# Commands that only send token ids (the engine's tokenizer needs no engine package) or load no model.
NO_ENGINE_COMMANDS = frozenset({"generate", "repository"})


def _engine_missing(args) -> str:
    """One line when the chosen engine's package is not in this Python (a wrong venv), else ""."""
    import importlib.util
    import os

    engine = getattr(args, "engine", None) or os.environ.get("KVCODEC_ENGINE") or "transformers"
    if args.command in NO_ENGINE_COMMANDS or engine not in ENGINE_HOMES:
        return ""
    module, home = ENGINE_HOMES[engine]
    if importlib.util.find_spec(module) is not None:
        return ""
    return (f"the {engine} engine needs {module}, which this Python ({sys.prefix}) lacks; "
            f"run this command from {home}")


def cmd_serve(args) -> int:
    from kvcodec import engines
    from kvcodec_tools.ports import port_is_free
    from kvcodec_tools.tritonserver import Ports, TritonServer

    busy = [f"{port} (--{name}-port)" for name, port in (("http", args.http_port), ("grpc", args.grpc_port),
                                                         ("metrics", args.metrics_port))
            if not port_is_free(args.host, port)]
    if busy:
        print(f"kvcodec serve: port {', '.join(busy)} on {args.host} is in use (another kvcodec serve?): "
              "stop what holds it or pass other ports", file=sys.stderr)
        return 1
    settings = _settings(args)
    engines.prepare(settings)
    _warn_unfitted(settings)
    down = _store_down(settings)
    if down:  # the server starts anyway: a store that comes back is used again
        print(f"kvcodec serve: warning: {down}; requests prefill until the store answers", file=sys.stderr,
              flush=True)
    server = TritonServer(Path(args.model_repository), settings,
                          Ports(args.http_port, args.grpc_port, args.metrics_port), host=args.host)
    stopping, watching = [], []  # watching: non-empty while a watchdog runs (it may be restarting the server)

    def on_signal(signum, _frame):
        stopping.append(signum)
        if not watching:
            server.terminate()  # the main thread's wait() returns, then stop() reaps everything

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        server.start(timeout_s=args.timeout)
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        if stopping:
            print("kvcodec serve: stopped before it was ready", flush=True)
            return 0
        print(f"kvcodec serve: {_start_failure(exc, server.log_path)}", file=sys.stderr)
        return 1
    # the watchdog takes the stubs it sees as the healthy set: before "ready", so that a stub that
    # dies right after it is a fault, not a server it never knew
    watchdog = _watchdog(server, watching, args.timeout) if args.watchdog else None
    print(f"kvcodec serve: ready (HTTP {server.http_url}, gRPC {server.grpc_url}, "
          f"metrics {args.host}:{args.metrics_port}); store {settings.store}; log {server.log_path}"
          f"{'; watchdog on' if args.watchdog else ''}", flush=True)
    code = _serve_watched(server, watchdog, stopping) if watchdog is not None else server.wait()
    server.stop()
    print("kvcodec serve: stopped", flush=True)
    return 0 if stopping else code


def _start_failure(exc: Exception, log_path: Path) -> str:
    """One line for a server that did not start: the models that failed to load, with the first
    line of each one's error, from the log's model table (else the error's first line), then the log."""
    try:
        rows = log_path.read_text(errors="replace").splitlines()
    except OSError:
        rows = []
    failed = []
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if row.startswith("|") and len(cells) >= 3 and cells[2].startswith("UNAVAILABLE"):
            message = cells[2].split("\\n")[0][:300]  # a multi-line error is quoted on one row
            failed.append(f"model {cells[0]}: {message}")
    reason = "; ".join(dict.fromkeys(failed)) or (str(exc).splitlines() or [type(exc).__name__])[0]
    return f"tritonserver did not start: {reason} (log {log_path})"


def _warn_unfitted(settings) -> None:
    """One line if the ladder or the write-back rungs need a codec profile this model lacks: those
    rungs are misses, and write-back at them fails, until ``kvcodec profile fit --model`` has run."""
    from kvcodec.engines import model_card
    from kvcodec.errors import ConfigError
    from kvcodec.format.ladder import parse_ladder
    from kvcodec.profiles import require_profiles

    card = model_card(settings)
    try:
        for rungs in (settings.ladder, settings.writeback):
            if rungs:
                require_profiles(parse_ladder(list(rungs), card))
    except ConfigError as exc:
        print(f"kvcodec serve: warning: {exc}", file=sys.stderr, flush=True)


def _watchdog(server, watching: list, start_timeout_s: float):
    """A watchdog started on the ready server. Once ``watching`` is marked, the signal handler only
    appends to ``stopping``: the watchdog may be restarting the server."""
    import logging

    from kvcodec_tools.watchdog import Watchdog

    logging.basicConfig(format="kvcodec serve: %(message)s")
    watching.append(True)
    return Watchdog(server, start_timeout_s=start_timeout_s).start()


def _serve_watched(server, watchdog, stopping: list) -> int:
    """Serve beside the running watchdog until a signal (``stopping``) or until the watchdog gives up
    (its exit code); on a signal this thread halts the watchdog first, then ends a start under way."""
    while not stopping and watchdog.join(0.5):
        pass
    watchdog.halt()
    while watchdog.running():
        server.terminate()  # a start under way fails at once; the watchdog restarts nothing more
        watchdog.join(0.5)
    if watchdog.gave_up:
        print(f"kvcodec serve: more than {watchdog.max_restarts} restarts within {watchdog.window_s:.0f} s; "
              "stopped", file=sys.stderr)
    return watchdog.exit_code or (0 if stopping else 1)  # 1 also when the watchdog itself failed


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
    text = _read_text(args.text_file)
    _probe_store(settings)  # and a store that does not answer
    engine = open_engine(settings)
    ids = engine.tokenize(text)
    n_chunks = len(ids) // settings.chunk_tokens
    if n_chunks == 0:
        print(f"kvcodec ingest: {len(ids)} tokens is less than one chunk ({settings.chunk_tokens}); nothing stored",
              file=sys.stderr)
        return 1
    with tqdm(total=n_chunks, unit="chunk", desc="ingest", disable=args.quiet) as bar:
        report = ingest_rungs(settings, engine, ids, codec, progress=bar.update)
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


def cmd_generate(args) -> int:
    from kvcodec.engines import tokenizer
    from kvcodec_client.client import ClientError, KVCodecClient

    settings = _settings(args)
    client = KVCodecClient(args.url, args.protocol, fallback_s=args.fallback_s)
    unreachable = _unreachable(client.url)
    if unreachable:
        print(f"kvcodec generate: no server at {client.url} ({args.protocol}: {unreachable}); start one with "
              f"`kvcodec serve`, or pass --url", file=sys.stderr)
        return 1
    ids = tokenizer(settings).encode(_read_text(args.text_file))
    try:
        result = client.generate(ids, args.max_tokens, reuse=not args.no_reuse, codecs=args.codecs)
    except (ClientError, ConnectionError, OSError) as exc:
        print(f"kvcodec generate: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"tokens": result.tokens, "text": result.text, "ttft_s": round(result.ttft_s, 6),
                          "reused_tokens": result.reused_tokens, "prompt_tokens": len(ids),
                          "total_s": round(result.total_s, 6), "stats": result.stats,
                          "failures": result.failures}))
    else:
        print(result.text)
        print(f"\n[ttft {result.ttft_s:.3f} s, reused {result.reused_tokens}/{len(ids)} prompt tokens, "
              f"{len(result.tokens)} tokens in {result.total_s:.3f} s]", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    from kvcodec.engines import open_engine
    from kvcodec.format.codecs import get_scheme
    from kvcodec_tools.quality.evaluate import evaluate

    settings = _settings(args)
    engine = open_engine(replace(settings, writeback=()))  # measures: stores nothing
    scheme = get_scheme(args.codec, args.quality).for_card(engine.card)
    ids = engine.tokenize(_read_text(args.text_file))
    result = evaluate(engine, ids, args.prefix_tokens, args.continuation_tokens, scheme, settings.chunk_tokens)
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(f"{scheme.name}: {result.ratio_vs_fp16:.2f}x vs fp16, top-1 {result.top1_agreement:.3f}, "
              f"mean KL {result.mean_kl:.5f}, greedy {result.greedy_match_tokens}/{result.greedy_tokens}, "
              f"encode {result.encode_s:.2f} s, decode {result.decode_s:.2f} s")
    return 0


def cmd_rd(args) -> int:
    from kvcodec_tools.quality.rd import DEFAULT_SETTINGS, RdConfig, run_rd

    settings = _settings(args)
    config = RdConfig(settings=args.settings or DEFAULT_SETTINGS, prefix_tokens=args.prefix_tokens,
                      continuation_tokens=args.continuation_tokens, workers=args.workers,
                      decode_threads=args.decode_threads, texts=args.texts, chunk_tokens=settings.chunk_tokens,
                      model_cache=str(settings.model_cache), engine=settings.engine,
                      model=str(settings.model) if settings.model else None)
    return run_rd(config, Path(args.json), Path(args.plot) if args.plot else None,
                  task_path=Path(args.task_json) if args.task_json else None)


def cmd_eval_task(args) -> int:
    from kvcodec.engines import open_engine
    from kvcodec_tools.quality.task import TaskConfig, run_task

    settings = _settings(args)
    config = TaskConfig(task=args.task, codecs=args.codec, samples=args.samples, context_tokens=args.context_tokens,
                        seed=args.seed, chunk_tokens=settings.chunk_tokens, threads=settings.threads or 1,
                        answer_tokens=args.answer_tokens)
    result = run_task(open_engine(replace(settings, writeback=())), config)  # measures: stores nothing
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        lo, hi = result["prefill_interval95"]
        print(f"{result['task']}, {result['samples']} samples, {result['context_tokens']} context tokens: prefill "
              f"{result['accuracy_prefill']:.3f} (95% {lo:.3f}-{hi:.3f}); {result['seconds']:.0f} s, "
              f"{result['memo']['encodes_saved_share']:.0%} of chunk encodes saved")
        for spec, r in result["codecs"].items():
            print(f"  {spec}: {r['accuracy_codec']:.3f} at {r['ratio_vs_fp16']:.2f}x vs fp16, "
                  f"{'lossless' if r['lossless_in_accuracy'] else 'NOT lossless'} in accuracy")
    return 0


def cmd_profile_fit(args) -> int:
    from kvcodec_tools.quality.fit import fit_codec_profile

    print(json.dumps(fit_codec_profile(_settings(args), args.tokens, Path(args.out) if args.out else None,
                                       weigh=args.weigh)))
    return 0


def cmd_profile_weigh(args) -> int:
    from kvcodec_tools.quality.sensitivity import weigh_codec_profile

    print(json.dumps(weigh_codec_profile(_settings(args), args.base, Path(args.out), args.exponent, args.texts)))
    return 0


def cmd_demo(args) -> int:
    from kvcodec_tools.demo import run_demo

    return run_demo(_settings(args), Path(args.json), Path(args.model_repository), args.codec)


def _list(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma list of {kind.__name__}: {text!r}") from None
    return parse


def cmd_bench_ttft(args) -> int:
    from kvcodec_tools.bench import BenchConfig, run_bench

    config = BenchConfig(args.bandwidth_mbps, args.context_tokens, args.methods, ladder=args.ladder, runs=args.runs,
                         prefill_runs=args.prefill_runs, max_tokens=args.max_tokens, delay_ms=args.delay_ms,
                         link_mode=args.link_mode, threads=args.threads if args.threads is not None else 2)
    return run_bench(_settings(args), Path(args.model_repository), config, Path(args.json),
                     Path(args.plot) if args.plot else None)


def concurrency_config(args):
    """The ``ConcurrencyConfig`` of ``kvcodec bench concurrency``'s flags (one line on a bad value)."""
    from kvcodec_tools.concurrency import ConcurrencyConfig

    try:
        return ConcurrencyConfig(args.clients, requests=args.requests, context_tokens=args.context_tokens,
                                 contexts=args.contexts, max_tokens=args.max_tokens,
                                 threads=args.threads if args.threads is not None else 2,
                                 servers=args.servers)
    except ValueError as exc:
        raise SystemExit(f"kvcodec bench concurrency: {exc}") from None


def cmd_bench_concurrency(args) -> int:
    from kvcodec_tools.concurrency import run_concurrency

    return run_concurrency(_settings(args), Path(args.model_repository), concurrency_config(args), Path(args.json),
                           Path(args.plot) if args.plot else None)


def cmd_bench_load(args) -> int:
    from kvcodec_tools.loadbench import LoadConfig, run_load

    try:
        config = LoadConfig(args.clients, args.variants, bandwidth_mbps=args.bandwidth_mbps, requests=args.requests,
                            context_tokens=args.context_tokens, contexts=args.contexts, max_tokens=args.max_tokens,
                            rung=args.rung, link_mode=args.link_mode,
                            threads=args.threads if args.threads is not None else 2)
    except ValueError as exc:
        raise SystemExit(f"kvcodec bench load: {exc}") from None
    return run_load(_settings(args), Path(args.model_repository), config, Path(args.json),
                    Path(args.plot) if args.plot else None)


def soak_config(args):
    """The ``SoakConfig`` of ``kvcodec soak``'s flags (exits with one line on a bad value)."""
    from kvcodec_tools.soak import SoakConfig

    try:
        return SoakConfig(args.clients, args.duration_s, tuple(args.protocols), contexts=args.contexts,
                          context_tokens=args.context_tokens, max_tokens=args.max_tokens,
                          threads=args.threads if args.threads is not None else 2, sample_s=args.sample_s,
                          warmup_s=args.warmup_s, window_s=args.window_s)
    except ValueError as exc:
        raise SystemExit(f"kvcodec soak: {exc}") from None


def cmd_soak(args) -> int:
    from kvcodec_tools.soak import run_soak

    return run_soak(_settings(args), Path(args.model_repository), soak_config(args), Path(args.json),
                    Path(args.plot) if args.plot else None)


def cmd_repository(args) -> int:
    from kvcodec_tools.repository import TRTLLM_CONFIG_FILE, TRTLLM_MODEL, TRTLLM_MODEL_PY, parse_instances, render

    settings = None
    if args.variant == "trtllm-llmapi":  # model.yaml names the project's converted model folder: make it ready
        from kvcodec.engines import model_files

        settings = _settings(args)
        model_files.files_for(settings)
    out = render(Path(args.source), Path(args.out), args.variant, gpus=args.gpus, settings=settings,
                 instances=parse_instances(args.instances or ""))
    print(f"kvcodec repository: wrote the {args.variant} repository to {out}")
    if args.variant == "trtllm":
        print("  next: in NVIDIA's tritonserver -trtllm-python container, install this project and run\n"
              f"        tritonserver --model-repository {out}   (docs/deploy-trtllm.md)")
    if args.variant == "trtllm-llmapi":
        version = out / TRTLLM_MODEL / "1"
        print(f"  next: cp {TRTLLM_MODEL_PY}/model.py {TRTLLM_MODEL_PY}/helpers.py {version}/\n"
              f"        export TRTLLM_KVCODEC_CONFIG={version / TRTLLM_CONFIG_FILE}\n"
              f"        tritonserver --model-repository {out}   (docs/deploy-trtllm.md)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcodec", description="KV cache reuse through video codecs on Triton")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--home", help="folder for caches and logs (default ./.cache)")
        p.add_argument("--store", help="store URL (default file://<home>/store)")
        p.add_argument("--model-cache", help="folder of the converted model (default <home>/models)")
        p.add_argument("--threads", type=int, help="torch / decoder threads (0: torch's default)")
        p.add_argument("--engine", help="the engine that runs the model (default transformers; KVCODEC_ENGINE)")
        p.add_argument("--model", help="a Hugging Face model folder of a Llama-family model (default: the embedded "
                                       "SmolLM2-135M-Instruct; KVCODEC_MODEL)")

    p = sub.add_parser("serve", help="run tritonserver on the model repository in the foreground")
    common(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    p.add_argument("--decoder", choices=["pyav", "nvdec", "auto"])
    p.add_argument("--ladder", "--codecs", dest="ladder",
                   help="comma list of rungs to fetch chunks from, in preference order (KVCODEC_LADDER)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the server to be ready")
    p.add_argument("--watchdog", action=argparse.BooleanOptionalAction, default=True,
                   help="restart the server when a python stub or the server dies (default on; at most 5 "
                        "restarts in 300 s, then exit 1)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("ingest", help="prefill a text once and store its KV chunks")
    common(p)
    p.add_argument("--text-file", required=True)
    p.add_argument("--codec",
                   help="a rung spec NAME[:QUALITY], or a comma list of them (default: the server's ladder)")
    p.add_argument("--quality", type=int, help="the codec's quality setting (video: QP)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("generate", help="ask the server to continue a text; prints text and TTFT")
    common(p)
    p.add_argument("--text-file", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("--url", help="server address (default 127.0.0.1:8001 for gRPC, :8000 for HTTP)")
    p.add_argument("--no-reuse", action="store_true", help="force full prefill")
    p.add_argument("--codecs", help="this request only: rung specs to fetch from (default: the server's ladder)")
    p.add_argument("--fallback-s", type=float, default=60.0,
                   help="after a server failure (a stub that died, a restart), ask again as prefill for this "
                        "many seconds (0: report the failure)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="what a codec does to the model: top-1, KL, greedy match, ratio")
    common(p)
    p.add_argument("--text-file", required=True)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--continuation-tokens", type=int, default=64)
    p.add_argument("--codec", default="video")
    p.add_argument("--quality", type=int, help="the codec's quality setting (video: QP)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True)
    p = bench.add_parser("ttft", help="TTFT of every method against link bandwidth (starts link, store, server)")
    common(p)
    from kvcodec_tools.bench import DEFAULT_LADDER, METHODS

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

    p = bench.add_parser("concurrency", help="requests/s and TTFT against concurrent clients, reuse and prefill "
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

    p = bench.add_parser("load", help="reuse under load: TTFT of reuse and prefill requests in flight together "
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

    p = sub.add_parser("soak", help="concurrent clients for a while (gRPC and HTTP, reuse and prefill), every answer "
                                    "checked, the server's RSS, fds, shm and processes sampled; exits 1 on an "
                                    "error or growth")
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
    p.add_argument("--json", default=str(REPO_ROOT / "perf" / "results" / "reliability.json"))
    p.add_argument("--plot", default=None, help=PLOT_HELP)
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    p.set_defaults(func=cmd_soak)

    p = sub.add_parser("repository", help="write a model repository variant derived from model_repository/: "
                                          "cpu, gpu, trtllm (the ensemble on TensorRT-LLM) or trtllm-llmapi "
                                          "(TensorRT-LLM's own LLM-API model with our connector)")
    p.add_argument("--variant", choices=["cpu", "gpu", "trtllm", "trtllm-llmapi"], required=True)
    p.add_argument("--out", required=True, help="the folder to write (replaced if it exists)")
    p.add_argument("--gpus", type=_list(int), default=[0], help="GPU ids of the KIND_GPU instances (trtllm: one)")
    p.add_argument("--source", default=str(DEFAULT_REPOSITORY), help="the committed repository it is derived from")
    p.add_argument("--instances", help="STEP=COUNT,...: instance_group counts of kv_fetch, kv_decode, kv_restore "
                                       "(per GPU on the gpu variant); llm runs as one")
    p.add_argument("--home", help="folder for caches (default ./.cache)")
    p.add_argument("--store", help="trtllm-llmapi: the store URL the connector reads and writes "
                                   "(default file://<home>/store)")
    p.add_argument("--model-cache", help="trtllm-llmapi: folder of the converted model (default <home>/models)")
    p.add_argument("--model", help="trtllm-llmapi: a Hugging Face model folder (default: the embedded SmolLM2)")
    p.add_argument("--ladder", help="trtllm-llmapi: the rungs the connector fetches from, preferred first")
    p.add_argument("--decoder", choices=["pyav", "nvdec", "auto"], help="trtllm-llmapi: the connector's video decoder")
    p.set_defaults(func=cmd_repository)

    p = sub.add_parser("rd", help="every codec at several settings over the eval set: rd.json and rd.png")
    common(p)
    p.add_argument("--settings", type=_list(str), help="rung specs (default: every codec at several settings)")
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--continuation-tokens", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="processes sharing out the texts")
    p.add_argument("--decode-threads", type=int, default=2, help="threads for the decode speed pass")
    p.add_argument("--texts", type=int, help="only the first N texts of the eval set")
    p.add_argument("--json", default=str(REPO_ROOT / "perf" / "results" / "rd.json"))
    p.add_argument("--plot", default=None, help=PLOT_HELP)
    p.add_argument("--task-json", help="an eval-task result: gates lossless8 on task accuracy and adds each "
                   "measured rung's accuracy")
    p.set_defaults(func=cmd_rd)

    p = sub.add_parser("eval-task", help="task accuracy (passkey retrieval) with prefill's KV and each rung's; "
                                         "lossless in accuracy: inside prefill's 95%% interval")
    common(p)
    p.add_argument("--task", default="passkey", help="the task (passkey)")
    p.add_argument("--codec", type=_list(str), default=["video"],
                   help="a rung spec NAME[:QUALITY], or a comma list of them (prefill is computed once for all)")
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--context-tokens", type=int, default=1024,
                   help="tokens of context; its whole chunks go through the codec")
    p.add_argument("--seed", type=int, default=0, help="samples are reproducible from (task, seed, index)")
    p.add_argument("--answer-tokens", type=int, help="greedy tokens of each answer (default: the task's)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--out", help="also write the result's JSON to this file")
    p.set_defaults(func=cmd_eval_task)

    p = sub.add_parser("profile", help="codec profiles (the per-model transform of transform-zstd)")
    prof = p.add_subparsers(dest="profile", required=True)
    p = prof.add_parser("fit", help="fit the PCA profile on the fit texts (outside the eval set) and weigh it; "
                                    "with --model, cached for that model")
    common(p)
    p.add_argument("--out", help="default: backends/kvcodec/profiles/<the model card's profile>.npz; with --model, "
                                 "<model cache>/profiles/<the model card's profile>.npz")
    p.add_argument("--weigh", action=argparse.BooleanOptionalAction, default=None,
                   help="add the sensitivity weights (video and kvtc-w need them; default on)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of each fit text")
    p.set_defaults(func=cmd_profile_fit)
    p = prof.add_parser("weigh", help="add sensitivity weights (where the model looks) to a fitted profile")
    common(p)
    p.add_argument("--base", required=True, help="the fitted profile to weigh (its name)")
    p.add_argument("--out", required=True, help="the weighted profile's file (.npz)")
    p.add_argument("--exponent", type=float, default=0.5, help="weights = (layer x component gain) ** this")
    p.add_argument("--texts", type=int, default=3, help="fit texts to measure on")
    p.set_defaults(func=cmd_profile_weigh)

    p = sub.add_parser("demo", help="ingest a text, compare TTFT with and without reuse, write JSON")
    common(p)
    p.add_argument("--json", default=str(REPO_ROOT / "perf" / "results" / "demo.json"))
    p.add_argument("--codec", default="int8-zstd", help="the rung to ingest and reuse (raw: the engine's own KV)")
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    p.set_defaults(func=cmd_demo)

    from kvcodec_tools.store_cli import add_store_parser  # kvcodec store usage | gc

    add_store_parser(sub)
    return parser


PLOT_HELP = "the plot (default: --json's path with .png; \"\": none)"


def plot_beside_json(args) -> None:
    """``--plot`` left out: the plot goes beside ``--json`` (``x.json`` -> ``x.png``), so a run
    written elsewhere never replaces the committed plot of another."""
    if getattr(args, "plot", "") is None:
        args.plot = str(Path(args.json).with_suffix(".png"))


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    plot_beside_json(args)
    from kvcodec.errors import KVCodecError

    missing = _engine_missing(args)
    if missing:
        print(f"kvcodec {args.command}: {missing}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KVCodecError as exc:
        print(f"kvcodec {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
