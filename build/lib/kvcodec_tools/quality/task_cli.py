"""``kvcodec eval-task``: task accuracy with prefill's KV and each rung's (``kvcodec_tools.quality.task``),
from the command line. Apart from the task harness, which imports numpy, so that building the
``kvcodec`` parser does not.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from kvcodec_tools.cli import _list, _settings, common


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


def register(sub) -> None:
    """``kvcodec eval-task`` under the CLI's subcommands ``sub``."""
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
