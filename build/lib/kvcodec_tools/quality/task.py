"""``kvcodec eval-task``: task-level accuracy with and without a codec (the paper's "lossless accuracy").

A sample of a task is a prompt the model answers in a few greedy tokens, scored right or wrong.
The one task here, ``passkey``, is the passkey retrieval test: a 5-digit pass key hidden at a
random depth in ``context_tokens`` tokens of repeated filler ("The grass is green. The sky is
blue. ..."), inside the model's chat template, then the question; the answer is right when the
first number in the greedy answer is the pass key. Every sample is reproducible from
``(task, seed, index)``, and every sample shares the same filler, so the chunks before the needle
are the same tokens, hence the same KV.

Each sample's context (its first ``context_tokens // chunk_tokens`` whole chunks) is prefilled
once (``engine.prefill_chunks``); ``prefill`` answers on that KV as it is, each rung answers on the
KV passed through the codec chunk by chunk (``ChunkEncoder`` -> ``ChunkDecoder`` -> ``restore``,
the pieces ``kvcodec_tools.quality.evaluate.compare`` uses). The question (and any part of the context
after the last whole chunk) is prefilled by the engine on top, as a reusing request does.

A chunk is encoded once per rung: restored chunks are memoized by (rung, chunk index, position,
digest of the KV), so the filler chunks before the needle, byte-identical in every sample, are
encoded, decoded and restored once (``memo``: chunks, encodes, hits, the share of encodes saved).

The result: ``accuracy_prefill`` with its 95% Wilson interval, per rung ``accuracy_codec``,
``ratio_vs_fp16`` and ``lossless_in_accuracy`` (``accuracy_codec`` inside prefill's interval);
the top-level keys repeat the first rung's, ``codecs`` holds every rung's.
"""
from __future__ import annotations

import hashlib
import math
import random
import re
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from kvcodec.encode import ChunkEncoder
from kvcodec.errors import BadRequest, ConfigError
from kvcodec.format.auth import ChunkAuth
from kvcodec.format.codecs import Scheme
from kvcodec.format.ladder import parse_ladder, rung_name
from kvcodec.serving.decode import ChunkDecoder
from kvcodec.serving.restore import restore

Z95 = 1.959964  # the normal quantile of a two-sided 95% interval


@dataclass
class Sample:
    """One prompt of a task: ``context + question`` is what the model reads; ``answer`` is right."""
    task: str
    seed: int
    index: int
    context: List[int]  # exactly context_tokens ids
    question: List[int]
    answer: str
    needle_at: int  # the needle's first token in ``context``
    needle: List[int]
    depth: float  # the needle's place in the filler, 0 (first) .. 1 (last)

    @property
    def prompt(self) -> List[int]:
        return self.context + self.question


class PasskeyTask:
    """A 5-digit pass key at a seeded depth in repeated filler (Mohtashami & Jaggi's passkey test),
    in SmolLM2's chat template; the assistant turn starts "The pass key is"."""

    name = "passkey"
    answer_tokens = 8
    head = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nThere is an important pass key hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about the pass key.\n")
    filler = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    needle = " The pass key is {key}. Remember it. {key} is the pass key."
    question = "\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is"

    def sample(self, tokenize: Callable[[str], List[int]], context_tokens: int, seed: int, index: int) -> Sample:
        rng = random.Random(f"{self.name}:{seed}:{index}")  # str seeds are hashed with SHA-512: stable
        key = str(rng.randint(10000, 99999))
        head, unit, needle = tokenize(self.head), tokenize(self.filler), tokenize(self.needle.format(key=key))
        slots = (context_tokens - len(head) - len(needle)) // len(unit)  # whole filler sentences that fit
        if slots < 1:
            raise BadRequest(f"{self.name}: {context_tokens} context tokens leave no room for filler")
        k = rng.randint(0, slots)  # the needle goes after k filler units: the same tokens before it
        filler = unit * (slots + 2)
        context = head + filler[: k * len(unit)] + needle + filler[k * len(unit):]
        context = context[:context_tokens]
        return Sample(self.name, seed, index, context, tokenize(self.question), key, len(head) + k * len(unit),
                      needle, k / slots)

    @staticmethod
    def score(text: str, answer: str) -> bool:
        """Right when the first number in the answer is the pass key."""
        m = re.search(r"\d+", text)
        return m is not None and m.group() == answer


TASKS = {PasskeyTask.name: PasskeyTask}


def get_task(name: str):
    if name not in TASKS:
        raise ConfigError(f"task {name!r} is unknown (known: {', '.join(sorted(TASKS))})")
    return TASKS[name]()


def wilson(k: int, n: int, z: float = Z95) -> Tuple[float, float]:
    """The Wilson score interval of a binomial proportion ``k / n`` (``(0, 1)`` for ``n == 0``)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, centre - half), min(1.0, centre + half)


def lossless_in_accuracy(accuracy_codec: float, interval: Sequence[float]) -> bool:
    """The codec is lossless in accuracy when its accuracy lies within prefill's 95% interval."""
    lo, hi = interval
    return lo - 1e-12 <= accuracy_codec <= hi + 1e-12


class ChunkMemo:
    """Restored chunks of each rung, keyed by (rung identity, chunk index, token start, KV digest),
    least recently used dropped beyond ``max_entries``; counts encodes and hits."""

    def __init__(self, model_id: str, auth: ChunkAuth, threads: int = 1, max_entries: int = 64) -> None:
        self.model_id, self.auth, self.threads, self.max_entries = model_id, auth, threads, max_entries
        self._coders: Dict[str, Tuple[ChunkEncoder, ChunkDecoder]] = {}
        self._restored: "OrderedDict[tuple, Tuple[np.ndarray, int]]" = OrderedDict()
        self.encodes: Dict[str, int] = {}
        self.hits: Dict[str, int] = {}
        self.encode_s: Dict[str, float] = {}
        self.decode_s: Dict[str, float] = {}

    def roundtrip(self, scheme: Scheme, kv: np.ndarray, index: int, token_start: int) -> Tuple[np.ndarray, int]:
        """``kv`` through ``scheme`` (encode, decode, restore): the restored KV and the stored bytes."""
        sid = scheme.identity
        digest = hashlib.blake2b(memoryview(np.ascontiguousarray(kv)).cast("B"), digest_size=16).hexdigest()
        key = (sid, index, token_start, digest)
        if key in self._restored:
            self._restored.move_to_end(key)
            self.hits[sid] = self.hits.get(sid, 0) + 1
            return self._restored[key]
        if sid not in self._coders:
            self._coders[sid] = (ChunkEncoder(scheme, self.model_id, auth=self.auth, threads=self.threads),
                                 ChunkDecoder(self.model_id, auth=self.auth, threads=self.threads))
        encoder, decoder = self._coders[sid]
        name = f"task{digest}"
        t0 = time.perf_counter()
        blob = encoder.encode(kv, name, index, token_start)
        t1 = time.perf_counter()
        restored = np.asarray(restore(decoder.decode(blob, key=name)))
        t2 = time.perf_counter()
        self.encodes[sid] = self.encodes.get(sid, 0) + 1
        self.encode_s[sid] = self.encode_s.get(sid, 0.0) + t1 - t0
        self.decode_s[sid] = self.decode_s.get(sid, 0.0) + t2 - t1
        self._restored[key] = (restored, len(blob))
        while len(self._restored) > self.max_entries:
            self._restored.popitem(last=False)
        return restored, len(blob)

    def close(self) -> None:
        for _, decoder in self._coders.values():
            decoder.close()
        self._coders.clear()
        self._restored.clear()


@dataclass
class TaskConfig:
    task: str = "passkey"
    codecs: Sequence[str] = ("video",)
    samples: int = 100
    context_tokens: int = 1024
    seed: int = 0
    chunk_tokens: int = 256
    threads: int = 1  # the codecs' threads (x265, the decoder)
    memo_entries: int = 64  # restored chunks kept per rung
    answer_tokens: Optional[int] = None  # default: the task's


@dataclass
class _Rung:
    spec: str
    scheme: Scheme
    correct: int = 0
    agree: int = 0  # samples whose answer text is prefill's
    fp16: int = 0
    stored: int = 0
    right: List[bool] = field(default_factory=list)


def run_task(engine, config: TaskConfig, log: Optional[Callable[[str], None]] = None) -> dict:
    """Score ``config.samples`` samples of the task with prefill's KV and with every rung's."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    task = get_task(config.task)
    c = config.chunk_tokens
    prefix = config.context_tokens // c * c
    if prefix <= 0:
        raise BadRequest(f"context_tokens must be at least one chunk ({c}), got {config.context_tokens}")
    if config.samples < 1:
        raise BadRequest(f"samples must be at least 1, got {config.samples}")
    specs = [x.strip() for x in (config.codecs.split(",") if isinstance(config.codecs, str) else config.codecs)
             if x.strip()]
    rungs = [_Rung(spec, scheme) for spec, scheme in zip(specs, parse_ladder(specs, engine.card), strict=True)]
    n_answer = config.answer_tokens or task.answer_tokens
    memo = ChunkMemo(engine.model_id, ChunkAuth.random(), config.threads,  # the chunks never leave here
                     config.memo_entries * len(rungs))
    rows: List[dict] = []
    prefill_correct = 0
    t0 = time.perf_counter()
    try:
        for i in range(config.samples):
            s = task.sample(engine.tokenize, config.context_tokens, config.seed, i)
            chunks = list(engine.prefill_chunks(s.context[:prefix], c))
            ref = engine.detokenize(list(engine.stream(s.prompt, n_answer, np.concatenate(chunks, axis=3))))
            ok = task.score(ref, s.answer)
            prefill_correct += ok
            row = {"index": i, "answer": s.answer, "needle_at": s.needle_at, "depth": round(s.depth, 4),
                   "prefill": ok, "prefill_text": ref}
            for r in rungs:
                restored = []
                for j, kv in enumerate(chunks):
                    kv_r, nbytes = memo.roundtrip(r.scheme, kv, j, j * c)
                    restored.append(kv_r)
                    r.fp16 += kv.size * 2
                    r.stored += nbytes
                text = engine.detokenize(list(engine.stream(s.prompt, n_answer, np.concatenate(restored, axis=3))))
                good = task.score(text, s.answer)
                r.correct += good
                r.agree += text == ref
                r.right.append(good)
                row[r.spec] = good
                if text != ref:
                    row[f"{r.spec}_text"] = text
            rows.append(row)
            log(f"[{i + 1}/{config.samples} {time.perf_counter() - t0:.0f} s] key {s.answer} at depth "
                f"{s.depth:.2f}: prefill {'right' if ok else 'wrong'}"
                + "".join(f", {r.spec} {'right' if r.right[-1] else 'wrong'}" for r in rungs))
    finally:
        memo.close()
    n = config.samples
    interval = wilson(prefill_correct, n)
    accuracy_prefill = prefill_correct / n
    codecs: Dict[str, dict] = {}
    for r in rungs:
        sid = r.scheme.identity
        encodes, hits = memo.encodes.get(sid, 0), memo.hits.get(sid, 0)
        acc = r.correct / n
        codecs[r.spec] = {
            "codec": r.spec,
            "codec_name": rung_name(r.scheme),
            "codec_id": sid,
            "accuracy_codec": round(acc, 4),
            "correct": r.correct,
            "interval95": [round(x, 4) for x in wilson(r.correct, n)],
            "agree_with_prefill": round(r.agree / n, 4),
            "lossless_in_accuracy": lossless_in_accuracy(acc, interval),
            "ratio_vs_fp16": round(r.fp16 / r.stored, 4),
            "encodes": encodes,
            "memo_hits": hits,
            "encodes_saved_share": round(hits / (encodes + hits), 4) if encodes + hits else 0.0,
            "encode_s": round(memo.encode_s.get(sid, 0.0), 3),
            "decode_s": round(memo.decode_s.get(sid, 0.0), 3),
        }
    encodes, hits = sum(memo.encodes.values()), sum(memo.hits.values())
    first = codecs[rungs[0].spec]
    return {
        "task": task.name,
        "seed": config.seed,
        "samples": n,
        "context_tokens": config.context_tokens,
        "codec_prefix_tokens": prefix,
        "chunk_tokens": c,
        "answer_tokens": n_answer,
        "model_id": engine.model_id,
        "accuracy_prefill": round(accuracy_prefill, 4),
        "prefill_correct": prefill_correct,
        "prefill_interval95": [round(x, 4) for x in interval],
        **{k: first[k] for k in ("codec", "codec_id", "accuracy_codec", "ratio_vs_fp16", "lossless_in_accuracy")},
        "codecs": codecs,
        "memo": {"chunks": encodes + hits, "encodes": encodes, "hits": hits,
                 "encodes_saved_share": round(hits / (encodes + hits), 4) if encodes + hits else 0.0},
        "seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
    }
