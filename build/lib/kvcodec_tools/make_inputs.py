"""perf_analyzer ``--input-data`` files for the ``kvcodec`` ensemble, made with the model's tokenizer.

A prompt is a context text followed by a short question, sent as text (the ensemble's
``text_input``, tokenized by the server with the model's own tokenizer, as ingest tokenizes the
context: every stored full chunk of the context matches; a BPE merge where the question meets the
context touches only the partial chunk at its end). For one context, under a name N, this writes
into the output folder:

    N.context.txt   the context text (what ``kvcodec ingest --text-file`` must store)
    N.reuse.json    {"data": [{"text_input": [prompt], "max_tokens": [M], "reuse": [true], "stream": [true],
                               "exclude_input_in_output": [true]}]}
    N.prefill.json  the same with "reuse": [false] (the full-prefill baseline)
    N.meta.json     context_tokens, prompt_tokens (the prompt's tokens as the server counts them),
                    max_tokens, question, source, tokenizer

``input_data`` also writes the token-id form (``input_ids``), which the ensemble still takes.
Shapes are written without the ensemble's batch dimension: perf_analyzer adds it (batch size 1).

``perf/inputs/default.*`` are committed: the demo's context (just over 1300 tokens of whole lines
of the standard library's ``json/decoder.py``). Regenerate, or make another context's files::

    .venv/bin/python perf/kvcodec_tools/make_inputs.py                                # perf/inputs/default.*
    .venv/bin/python perf/kvcodec_tools/make_inputs.py --text-file F --name mine [--context-tokens 300]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Union

from kvcodec_tools.texts import cut_to_tokens

PERF_DIR = Path(__file__).resolve().parents[1]  # perf/: inputs, results
REPO_ROOT = PERF_DIR.parent
INPUTS_DIR = PERF_DIR / "inputs"
DEFAULT_NAME = "default"
QUESTION = "\n\n# Question: what does this code do?\n# Answer:"
MAX_TOKENS = 4


def input_data(prompt: Union[str, Sequence[int]], max_tokens: int, reuse: bool) -> dict:
    """One perf_analyzer input-data document: a single request, sent again and again; text as
    ``text_input`` (streamed, the answer without the prompt), token ids as ``input_ids``."""
    common = {"max_tokens": [int(max_tokens)], "reuse": [bool(reuse)]}
    if isinstance(prompt, str):
        return {"data": [{"text_input": [prompt], **common, "stream": [True], "exclude_input_in_output": [True]}]}
    ids = [int(t) for t in prompt]
    return {"data": [{"input_ids": {"content": ids, "shape": [len(ids)]}, **common}]}


def paths(name: str, out_dir: Path = INPUTS_DIR) -> dict:
    out_dir = Path(out_dir)
    return {kind: out_dir / f"{name}.{kind}.{'txt' if kind == 'context' else 'json'}"
            for kind in ("context", "reuse", "prefill", "meta")}


def make_inputs(tokenizer, context: str, name: str = DEFAULT_NAME, out_dir: Path = INPUTS_DIR,
                question: str = QUESTION, max_tokens: int = MAX_TOKENS, source: str = "") -> dict:
    """Write ``name``'s four files (see the module docstring) and return the meta document, with
    the files' paths under ``"files"``."""
    if not context.strip():
        raise ValueError("the context text is empty")
    if not 1 <= max_tokens <= 4096:
        raise ValueError(f"max_tokens must be in 1..4096, got {max_tokens}")
    context_ids: List[int] = tokenizer.encode(context)
    prompt = context + question
    files = paths(name, out_dir)
    files["context"].parent.mkdir(parents=True, exist_ok=True)
    files["context"].write_text(context, encoding="utf-8")
    for kind, reuse in (("reuse", True), ("prefill", False)):
        files[kind].write_text(json.dumps(input_data(prompt, max_tokens, reuse)) + "\n")
    meta = {"name": name, "context_tokens": len(context_ids), "prompt_tokens": len(tokenizer.encode(prompt)),
            "max_tokens": max_tokens, "question": question, "source": source,
            "tokenizer": "SmolLM2-135M-Instruct (kvcodec.engines.tokenizer.Tokenizer)"}
    files["meta"].write_text(json.dumps(meta, indent=2) + "\n")
    return {**meta, "files": {k: str(v) for k, v in files.items()}}


def load_tokenizer(model_cache: Optional[Path] = None):
    from kvcodec.engines.gguf import ensure_model
    from kvcodec.engines.tokenizer import Tokenizer

    return Tokenizer(ensure_model(model_cache or REPO_ROOT / ".cache" / "models"))


def default_context(tokenizer, tokens: int = 1300) -> tuple:
    """(text, source): the demo's context, cut to just over ``tokens`` tokens."""
    from kvcodec_tools.demo import CONTEXT_SOURCE

    text = CONTEXT_SOURCE.read_text(encoding="utf-8")
    return cut_to_tokens(tokenizer, text, tokens), f"{CONTEXT_SOURCE.parent.name}/{CONTEXT_SOURCE.name}"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text-file", help="context text (default: the demo's json/decoder.py context)")
    p.add_argument("--context-tokens", type=int, default=None,
                   help="cut the text to just over this many tokens, at a line end (default: all of "
                        "--text-file; 1300 for the default context)")
    p.add_argument("--name", default=DEFAULT_NAME)
    p.add_argument("--out-dir", type=Path, default=INPUTS_DIR)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--model-cache", type=Path, default=None)
    args = p.parse_args(argv)
    tokenizer = load_tokenizer(args.model_cache)
    if args.text_file:
        try:
            text = Path(args.text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            p.error(f"cannot read --text-file {args.text_file}: {exc}")
        if args.context_tokens:
            text = cut_to_tokens(tokenizer, text, args.context_tokens)
        source = Path(args.text_file).name
    else:
        text, source = default_context(tokenizer, args.context_tokens or 1300)
    try:
        meta = make_inputs(tokenizer, text, args.name, args.out_dir, args.question, args.max_tokens, source)
    except ValueError as exc:
        p.error(str(exc))
    print(f"{meta['name']}: context {meta['context_tokens']} tokens, prompt {meta['prompt_tokens']} tokens, "
          f"max_tokens {meta['max_tokens']} -> {', '.join(meta['files'].values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
