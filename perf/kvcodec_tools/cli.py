"""The ``kvcodec`` command: the top-level parser and its dispatch. The product library is
``kvcodec``; the client library is ``kvcodec_client`` (it imports nothing of these tools); serving,
benchmarks and the quality harness are the tools of this package, ``kvcodec_tools`` (under
``perf/``: the tritonserver launcher, bench, demo, rd, eval). Imports go one way: tools -> client ->
library.

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
    kvcodec soak --chaos [--servers 2 --chaos-store nginx|redis|redis-cluster|s3 --duration-s 1800] [--json perf/results/chaos.json]
    kvcodec store usage --store URL [--json];  kvcodec store gc --store URL --max-bytes N [--older-than D]

Each command is registered by the module that runs it (``COMMANDS``, in the order of
``kvcodec --help``): its ``register(subparsers)`` adds the command's parser, with the options
shared here (``common``), and sets its handler (``func``). A tool whose module is heavy to import
(numpy, protobuf) is registered by a small ``*_cli.py`` beside it: building the parser imports
neither; a handler imports its tool when it runs.

Commands that load a model take ``--model DIR`` (a Hugging Face folder of a Llama-family model;
default the embedded SmolLM2-135M-Instruct). Settings not given as flags come from ``KVCODEC_*``
variables, then defaults (see
``kvcodec.settings``); the store defaults to ``file://./.cache/store``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import List, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
# the model repository: model_repository/ of a checkout, the same files in an installed wheel
# (perf/kvcodec_tools/model_repository links to it; pyproject's package-data carries them)
DEFAULT_REPOSITORY = (Path(__file__).resolve().parent / "model_repository").resolve()

# The commands in the order ``kvcodec --help`` lists them: a module whose ``register(subparsers)``
# adds one, or (name, help, modules): a command whose subcommands those modules register.
COMMANDS = (
    "kvcodec_tools.tritonserver",  # serve
    "kvcodec_tools.ingest_cli",  # ingest
    "kvcodec_tools.generate_cli",  # generate
    "kvcodec_tools.probe_cli",  # probe
    "kvcodec_tools.quality.evaluate_cli",  # eval
    ("bench", "benchmarks", ("kvcodec_tools.bench", "kvcodec_tools.concurrency", "kvcodec_tools.loadbench",
                             "kvcodec_tools.run_perf", "kvcodec_tools.peers", "kvcodec_tools.tenants_bench",
                             "kvcodec_tools.workload_cli")),
    "kvcodec_tools.soak",  # soak
    "kvcodec_tools.repository_cli",  # repository
    "kvcodec_tools.quality.rd",  # rd
    "kvcodec_tools.quality.task_cli",  # eval-task
    ("profile", "codec profiles (the per-model transform of transform-zstd)",
     ("kvcodec_tools.quality.fit", "kvcodec_tools.quality.sensitivity_cli")),
    "kvcodec_tools.demo",  # demo
    "kvcodec_tools.store_cli",  # store usage | gc
)


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


def _list(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a comma list of {kind.__name__}: {text!r}") from None
    return parse


def common(p) -> None:
    """The options of every command that builds settings: home, store, model cache, threads, engine, model."""
    p.add_argument("--home", help="folder for caches and logs (default ./.cache)")
    p.add_argument("--store", help="store URL (default file://<home>/store)")
    p.add_argument("--model-cache", help="folder of the converted model (default <home>/models)")
    p.add_argument("--threads", type=int, help="torch / decoder threads (0: torch's default)")
    p.add_argument("--engine", help="the engine that runs the model (default transformers; KVCODEC_ENGINE)")
    p.add_argument("--model", help="a Hugging Face model folder of a Llama-family model (default: the embedded "
                                   "SmolLM2-135M-Instruct; KVCODEC_MODEL)")


def _register(sub, commands) -> None:
    for entry in commands:
        if isinstance(entry, str):
            importlib.import_module(entry).register(sub)
        else:
            name, help_text, modules = entry
            _register(sub.add_parser(name, help=help_text).add_subparsers(dest=name, required=True), modules)


def build_parser() -> argparse.ArgumentParser:
    from kvcodec import __version__

    parser = argparse.ArgumentParser(prog="kvcodec", description="KV cache reuse through video codecs on Triton")
    parser.add_argument("--version", action="version", version=f"kvcodec {__version__}")
    _register(parser.add_subparsers(dest="command", required=True), COMMANDS)
    return parser


PLOT_HELP = "the plot (default: --json's path with .png; \"\": none)"


def plot_beside_json(args) -> None:
    """``--plot`` left out: the plot goes beside ``--json`` (``x.json`` -> ``x.png``), so a run
    written elsewhere never replaces the committed plot of another."""
    if getattr(args, "plot", "") is None and getattr(args, "json", None) is not None:
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
