"""``kvcodec eval``: what one codec does to the model on one text (``kvcodec_tools.quality.evaluate``:
top-1, KL, greedy match, ratio), from the command line. Apart from the harness, which imports numpy,
so that building the ``kvcodec`` parser does not.
"""
from __future__ import annotations

import json
from dataclasses import replace

from kvcodec_tools.cli import _read_text, _settings, common


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


def register(sub) -> None:
    """``kvcodec eval`` under the CLI's subcommands ``sub``."""
    p = sub.add_parser("eval", help="what a codec does to the model: top-1, KL, greedy match, ratio")
    common(p)
    p.add_argument("--text-file", required=True)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--continuation-tokens", type=int, default=64)
    p.add_argument("--codec", default="video")
    p.add_argument("--quality", type=int, help="the codec's quality setting (video: QP)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)
