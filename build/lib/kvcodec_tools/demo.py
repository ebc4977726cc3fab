"""``make demo``: KV reuse end to end on this machine, against full prefill.

1. Takes a real text from the Python standard library's source (``json/decoder.py``, cut to
   just over 1300 tokens, ``kvcodec_tools.texts``), ingests it at ``DEMO_RUNG`` (int8-zstd: the 8-bit
   values, losslessly, passes the quality gate; ``--codec`` picks another, e.g. ``raw`` with the
   vLLM engine: its own KV, exactly) into the store, with the chosen engine (``--engine``);
2. starts tritonserver on the model repository, on free ports, with a ladder of that one rung,
   write-back off and adaptive off: the demo's server reads exactly what the demo ingested and
   writes nothing, so a second run on the same store reuses the same chunks (chunks that another
   server wrote back at another rung, kvtc-w for instance, are never chosen over them) and the
   cost model, learning across runs, cannot turn reuse into recompute;
3. asks the same prompt (that context plus a question) over gRPC once with full prefill and once
   with KV reuse, 16 tokens each;
4. prints a table, writes the JSON and stops the server. Exits non-zero if the reuse run did not
   reuse or did not give the prefill run's tokens.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from .cli import DEFAULT_REPOSITORY, REPO_ROOT, _settings, common
from .texts import cut_to_tokens, stdlib_path

if TYPE_CHECKING:
    from .tritonserver import Ports

CONTEXT_SOURCE = stdlib_path("json/decoder.py")
CONTEXT_TOKENS = 1300
QUESTION = "\n\n# Question: what does the function scanstring return?\n# Answer:"
MAX_TOKENS = 16
DEMO_RUNG = "int8-zstd"


def demo_texts(tokenizer, target_tokens: int = CONTEXT_TOKENS):
    """(context, prompt): the fewest whole lines of the source holding ``target_tokens`` tokens,
    then the question."""
    context = cut_to_tokens(tokenizer, CONTEXT_SOURCE.read_text(encoding="utf-8"), target_tokens)
    return context, context + QUESTION


def demo_settings(settings, rung: str):
    """The demo server's settings: ``settings`` with a ladder of the one rung the demo ingests,
    write-back off, adaptive off and vLLM's own prefix cache off: the reuse run reads the store (see
    the module docstring)."""
    return replace(settings, ladder=(rung,), writeback=(), adaptive=False, prefix_cache=False)


def run_demo(settings, json_path: Path, repository: Path, rung: str = DEMO_RUNG,
             context_tokens: int = CONTEXT_TOKENS, ports: Optional[Ports] = None) -> int:
    """The demo; 0 when the reuse run reused and gave the prefill run's tokens. ``ports``: the
    server's (default: three free ones)."""
    from tqdm import tqdm

    from kvcodec.engines import open_engine
    from kvcodec.format.ladder import parse_ladder
    from kvcodec.ingest import ingest_rungs
    from kvcodec_client.client import KVCodecClient
    from kvcodec_tools.ports import free_ports
    from kvcodec_tools.tritonserver import Ports, TritonServer

    parse_ladder([rung])  # a bad rung fails before the model loads
    settings = demo_settings(settings, rung)
    engine = open_engine(settings)
    context, prompt = demo_texts(engine.tokenizer, context_tokens)
    work = settings.home / "demo"
    work.mkdir(parents=True, exist_ok=True)
    (work / "context.txt").write_text(context)
    (work / "prompt.txt").write_text(prompt)
    context_ids = engine.tokenize(context)
    prompt_ids = engine.tokenize(prompt)
    print(f"context: {len(context_ids)} tokens from {CONTEXT_SOURCE}; prompt: {len(prompt_ids)} tokens")
    with tqdm(total=len(context_ids) // settings.chunk_tokens, unit="chunk", desc="ingest") as bar:
        report = ingest_rungs(settings, engine, context_ids, rung, progress=bar.update)
    geometry = engine.geometry(1)
    if hasattr(engine, "close"):
        engine.close()  # vLLM: its stepping thread; the server starts its own engine
    del engine
    print(f"stored {report.chunks} chunks in {settings.store} ({report.written} new)")

    print("starting tritonserver ...", flush=True)
    t0 = time.perf_counter()
    with TritonServer(repository, settings, ports or Ports(*free_ports(3))) as server:
        print(f"ready in {time.perf_counter() - t0:.1f} s", flush=True)
        client = KVCodecClient(server.grpc_url, "grpc")
        client.generate(prompt_ids[:32], 2, reuse=False)  # warm-up: first calls pay one-time costs
        prefill = client.generate(prompt_ids, MAX_TOKENS, reuse=False)
        reuse = client.generate(prompt_ids, MAX_TOKENS, reuse=True)
    kv_fp16_bytes = reuse.reused_tokens * geometry.fp16_bytes
    result = {
        "context_tokens": len(context_ids),
        "prompt_tokens": len(prompt_ids),
        "engine": settings.engine,
        "codec": rung,
        "ttft_prefill_s": round(prefill.ttft_s, 4),
        "ttft_reuse_s": round(reuse.ttft_s, 4),
        "speedup": round(prefill.ttft_s / reuse.ttft_s, 2) if reuse.ttft_s else None,
        "reused_tokens": reuse.reused_tokens,
        "bytes_fetched": int(reuse.stats.get("bytes_fetched", 0)),
        "kv_fp16_bytes": kv_fp16_bytes,
        "tokens_match": prefill.tokens[:MAX_TOKENS] == reuse.tokens[:MAX_TOKENS],
        "prefill_tokens": prefill.tokens,
        "reuse_tokens": reuse.tokens,
        "reuse_server": {k: reuse.stats.get(k) for k in ("fetch_s", "decode_s", "restore_s",
                                                            "compute_first_token_s", "server_ttft_s")},
        "text": reuse.text,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    ratio = kv_fp16_bytes / result["bytes_fetched"] if result["bytes_fetched"] else 0.0
    print()
    print(f"{'run':<10}{'TTFT s':>9}{'reused':>9}{'fetched':>12}")
    print(f"{'prefill':<10}{prefill.ttft_s:>9.3f}{0:>9}{0:>12}")
    print(f"{'reuse':<10}{reuse.ttft_s:>9.3f}{reuse.reused_tokens:>9}{result['bytes_fetched']:>12}")
    size = (f"{ratio:.2f}x less than fp16 KV" if ratio >= 1 else
            f"{1 / ratio:.2f}x the fp16 KV's bytes" if ratio else "nothing")
    print(f"\nspeedup {result['speedup']}x; fetched {size}; tokens_match: {str(result['tokens_match']).lower()}")
    print(f"answer: {reuse.text!r}\nwrote {json_path}")
    ok = result["tokens_match"] and reuse.reused_tokens > 0
    return 0 if ok else 1


# -- kvcodec demo ----------------------------------------------------------------------------------
def cmd_demo(args) -> int:
    return run_demo(_settings(args), Path(args.json), Path(args.model_repository), args.codec)


def register(sub) -> None:
    """``kvcodec demo`` under the CLI's subcommands ``sub``."""
    p = sub.add_parser("demo", help="ingest a text, compare TTFT with and without reuse, write JSON")
    common(p)
    p.add_argument("--json", default=str(REPO_ROOT / "perf" / "results" / "demo.json"))
    p.add_argument("--codec", default="int8-zstd", help="the rung to ingest and reuse (raw: the engine's own KV)")
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    p.set_defaults(func=cmd_demo)
