"""``make fuzz``: hostile chunks against every parser and decoder boundary of the read path.

A reader takes a chunk's bytes from a store it does not control. Whatever those bytes are, the
read path (``ChunkDecoder.decode``: container, tag, header, section table, planes shape and dtype,
bitstream; then ``restore``: layout and codec parameters, side data, geometry) must end in one of
two ways: KV of the right shape, or one of the library's typed errors (``KVCodecError``: a
corrupt or foreign chunk), which the serving steps turn into a miss. Any other exception, or a
case that runs past its time limit, is a finding.

Cases are seeded and reproducible (``--seed``; case ``i`` is drawn from ``Random(seed * 1_000_003 + i)``).
They start from valid chunks of every codec (small synthetic KV, a codec profile fitted for its
geometry) and are mutated two ways:

- bytes: bit flips, random bytes, truncation, extension, insertion, deletion, splices of two
  chunks. Almost all stop at the digests or the tag; they test that layer.
- structure, re-signed with the deployment's key (a writer with the key but a bug, or the key
  stolen): a header field replaced with a hostile value (huge, negative, wrong type, NaN, deep
  nesting...), nested fields of the geometry and the parameters, a section flipped, cut, grown,
  dropped, added or swapped. These reach the header checks, the coders and the layouts.

Writes ``perf/results/fuzz.json``: cases, outcomes, the slowest case, and every finding with its
case number, mutation and traceback (none is the target).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

LAYERS, HEADS, DIM, TOKENS = 2, 1, 64, 64
PROFILE = "fuzz-v1"
THETA = 10000.0
HOSTILE: Tuple[Any, ...] = (
    None, True, -1, 0, 1, 7, 255, 256, 65536, 2 ** 31, 2 ** 63, -(2 ** 63), 10 ** 40, 1.5, -0.0, 1e308,
    math.inf, -math.inf, math.nan, "", "x", "uint16", "float64", "../..", "x" * 5000, [], [0], [1, 1, 1],
    [64, 65536, 65536], [-1, 8, 8], [2 ** 31, 2, 2], {}, {"a": 1}, [[[[[]]]]], {"layers": 2 ** 40},
)
RESULTS = Path(__file__).resolve().parents[1] / "results" / "fuzz.json"


class Hang(Exception):
    pass


@dataclass
class Report:
    cases: int = 0
    seconds: float = 0.0
    outcomes: Counter = field(default_factory=Counter)  # ok | typed:<ErrorClass> | untyped | hang
    mutations: Counter = field(default_factory=Counter)
    slowest: Tuple[float, int, str] = (0.0, -1, "")
    findings: List[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"cases": self.cases, "seconds": round(self.seconds, 1),
                "cases_per_s": round(self.cases / self.seconds, 1) if self.seconds else 0.0,
                "untyped": self.outcomes.get("untyped", 0), "hangs": self.outcomes.get("hang", 0),
                "outcomes": dict(sorted(self.outcomes.items())), "mutations": dict(sorted(self.mutations.items())),
                "slowest_case": {"seconds": round(self.slowest[0], 4), "case": self.slowest[1],
                                 "mutation": self.slowest[2]},
                "findings": self.findings[:50]}


def structured_kv(seed: int, layers: int, heads: int, tokens: int, dim: int, token_start: int = 0,
                  theta: float = THETA) -> np.ndarray:
    """KV whose vectors lie mostly in a few directions (as a model's do), keys rotated by RoPE at
    their positions (as a model caches them). The unit tests' synthetic KV too."""
    from kvcodec.profiles.rope import rope

    rng = np.random.default_rng(seed)
    c = heads * dim
    basis = np.linalg.qr(np.random.default_rng(99).standard_normal((layers, 2, c, c)))[0]
    coeff = rng.standard_normal((layers, 2, tokens, c)) * np.exp(-np.arange(c) / 12.0)
    x = np.einsum("lktj,lkcj->lktc", coeff, basis) + 0.3
    kv = x.reshape(layers, 2, tokens, heads, dim).transpose(0, 1, 3, 2, 4).copy()
    kv[:, 0] = rope(kv[:, 0], token_start, theta)
    return kv.astype(np.float32)


def _kv(seed: int) -> np.ndarray:
    return structured_kv(seed, LAYERS, HEADS, TOKENS, DIM)


def synthetic_profile(samples, theta: float) -> dict:
    """A codec profile's arrays fitted on ``samples`` (``(kv, token_start)`` pairs), with fixed
    sensitivity weights that vary over layers and components (geometric mean 1): what the weighted
    layouts need, for geometries no model has (fuzz, unit tests)."""
    from kvcodec.profiles import fit_profile

    arrays = fit_profile(iter(samples), theta)
    shape = arrays["variance"].shape
    weight = np.exp(0.7 * np.sin(np.arange(int(np.prod(shape)), dtype=np.float64) * 0.37)).reshape(shape)
    arrays["weight"] = (weight / np.exp(np.mean(np.log(weight)))).astype(np.float32)
    return arrays


def prepare_profile(folder: Path) -> None:
    """Fit the codec profile of the fuzz geometry and make it findable (``KVCODEC_PROFILE_DIR``)."""
    from kvcodec.profiles import save_profile

    save_profile(synthetic_profile([(_kv(s), 0) for s in range(4)], THETA), folder / f"{PROFILE}.npz")
    os.environ["KVCODEC_PROFILE_DIR"] = str(folder)


def seed_chunks(auth, model_id: str) -> List[Tuple[str, bytes]]:
    """One valid chunk of every codec (two for the video rungs: other settings, other streams; raw in
    float16 and in float32, the KV dtype of a CPU engine)."""
    from kvcodec.encode import ChunkEncoder
    from kvcodec.format.codecs import SCHEMES, get_scheme

    kv = _kv(7)
    specs = [(name, None, None) for name in SCHEMES] + [("video", 20, None), ("lossless8", None, None),
                                                       ("raw", None, "float32")]
    out = []
    for name, quality, kv_dtype in specs:
        scheme = get_scheme(name, quality, profile=PROFILE, kv_dtype=kv_dtype)
        out.append((f"{name}:{quality}" if quality else f"{name}/{kv_dtype}" if kv_dtype else name,
                    ChunkEncoder(scheme, model_id, auth=auth).encode(kv, f"fuzz/{name}", 0, 0)))
    return out


# -- mutations ---------------------------------------------------------------------------------------
def _bytes_mutation(rng: random.Random, data: bytes, other: bytes) -> Tuple[str, bytes]:
    b = bytearray(data)
    kind = rng.choice(["flip", "byte", "truncate", "extend", "insert", "delete", "splice"])
    at = rng.randrange(len(b))
    if kind == "flip":
        for _ in range(rng.choice([1, 1, 2, 8])):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == "byte":
        b[at] = rng.randrange(256)
    elif kind == "truncate":
        del b[at:]
    elif kind == "extend":
        b += bytes(rng.randrange(256) for _ in range(rng.choice([1, 7, 1000])))
    elif kind == "insert":
        b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    elif kind == "delete":
        del b[at:at + rng.randrange(1, 64)]
    else:
        b = b[:at] + bytearray(other[rng.randrange(len(other)):])
    return f"bytes:{kind}", bytes(b)


def _hostile(rng: random.Random, old: Any) -> Any:
    if isinstance(old, dict) and old and rng.random() < 0.6:  # reach into nested fields
        key = rng.choice(sorted(old))
        return dict(old, **{key: _hostile(rng, old[key])})
    if isinstance(old, list) and old and rng.random() < 0.5:
        out = list(old)
        out[rng.randrange(len(out))] = _hostile(rng, out[0])
        return out
    if isinstance(old, int) and not isinstance(old, bool) and rng.random() < 0.4:
        return old + rng.choice([-1, 1, old, -old, 2 ** 20])
    return rng.choice(HOSTILE)


def _structure_mutation(rng: random.Random, chunk, other) -> str:
    header, sections = chunk.header, chunk.sections
    kind = rng.choice(["field", "field", "field", "drop-field", "section", "section", "drop-section",
                       "add-section", "swap-section"])
    if kind == "field":
        name = rng.choice(sorted(header))
        header[name] = _hostile(rng, header[name])
        return f"field:{name}"
    if kind == "drop-field":
        name = rng.choice(sorted(header))
        del header[name]
        return f"drop-field:{name}"
    if kind == "add-section":
        sections[rng.choice(["payload2", "pca_step", "q8_min", "zz"])] = bytes(rng.randrange(256) for _ in range(16))
        return kind
    if not sections:
        return "none"
    name = rng.choice(sorted(sections))
    if kind == "drop-section":
        del sections[name]
    elif kind == "swap-section":
        sections[name] = bytes(other.sections.get(name, b"")) or bytes(rng.randrange(256) for _ in range(8))
    else:
        body = bytearray(sections[name])
        how = rng.choice(["flip", "cut", "grow", "zero", "ones"])
        if how == "flip" and body:
            for _ in range(rng.choice([1, 4, 64])):
                body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
        elif how == "cut":
            del body[rng.randrange(len(body) + 1):]
        elif how == "grow":
            body += bytes(rng.randrange(256) for _ in range(rng.choice([1, 2, 100])))
        elif how == "zero":
            body = bytearray(len(body))
        else:
            body = bytearray(b"\xff" * len(body))
        sections[name] = bytes(body)
        name = f"{name}:{how}"
    return f"{kind}:{name}"


def make_case(rng: random.Random, seeds: Sequence[Tuple[str, bytes]], auth) -> Tuple[str, bytes]:
    from kvcodec.format import container

    (name, data), (_, other) = rng.choice(seeds), rng.choice(seeds)
    if rng.random() < 0.3:
        kind, out = _bytes_mutation(rng, data, other)
        return f"{name} {kind}", out
    chunk, second = container.parse(data, auth), container.parse(other, auth)
    chunk = container.Container(dict(chunk.header), {k: bytes(v) for k, v in chunk.sections.items()})
    kinds = [_structure_mutation(rng, chunk, second) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
    return f"{name} " + "+".join(kinds), chunk.to_bytes(auth)


# -- running -------------------------------------------------------------------------------------------
def run_case(decoder, data: bytes) -> str:
    """'ok' or 'typed:<Error>'; anything else propagates (a finding)."""
    from kvcodec.errors import KVCodecError
    from kvcodec.serving.restore import restore

    try:
        with np.errstate(all="ignore"):  # hostile scales overflow; the result is checked below
            decoded = decoder.decode(data)
            kv = restore(decoded)
    except KVCodecError as exc:
        return f"typed:{type(exc).__name__}"
    # float16, but the engine's own float32 from a raw (``native``) chunk made for a float32 engine
    native32 = decoded.header.layout == "native" and decoded.header.layout_params.get("dtype") == "float32"
    if kv.dtype != (np.float32 if native32 else np.float16) or kv.shape != (LAYERS, 2, HEADS, TOKENS, DIM):
        raise AssertionError(f"restore returned {kv.dtype}{kv.shape}")
    if not np.isfinite(kv).all():
        raise AssertionError("restore returned KV that is not finite")
    return "ok"


def fuzz(cases: int, seed: int = 0, timeout_s: float = 10.0,
         progress: Optional[Callable[[int, Report], None]] = None) -> Report:
    from kvcodec.format.auth import ChunkAuth
    from kvcodec.format.geometry import Geometry
    from kvcodec.serving.decode import ChunkDecoder

    model_id = "fuzz-model@1"
    auth = ChunkAuth(bytes(range(32)))
    with tempfile.TemporaryDirectory(prefix="kvcodec-fuzz-") as folder:
        previous = os.environ.get("KVCODEC_PROFILE_DIR")
        prepare_profile(Path(folder))
        try:
            seeds = seed_chunks(auth, model_id)
            geometry = Geometry(layers=LAYERS, kv_heads=HEADS, head_dim=DIM, tokens=TOKENS)
            decoder = ChunkDecoder(model_id, auth=auth, geometry=geometry)
            return _loop(decoder, seeds, auth, cases, seed, timeout_s, progress)
        finally:
            if previous is None:
                os.environ.pop("KVCODEC_PROFILE_DIR", None)
            else:
                os.environ["KVCODEC_PROFILE_DIR"] = previous


def _loop(decoder, seeds, auth, cases: int, seed: int, timeout_s: float, progress) -> Report:
    report = Report()

    def on_alarm(_signum, _frame):
        raise Hang()

    old = signal.signal(signal.SIGALRM, on_alarm)
    t_start = time.perf_counter()
    try:
        for i in range(cases):
            rng = random.Random(seed * 1_000_003 + i)
            mutation, data = make_case(rng, seeds, auth)
            report.mutations[mutation.split(" ", 1)[1].split(":")[0]] += 1
            t0 = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            try:
                outcome = run_case(decoder, data)
            except Hang:
                outcome = "hang"
                report.findings.append({"case": i, "mutation": mutation, "error": f"ran past {timeout_s} s"})
            except Exception as exc:  # a finding: not one of the library's typed errors
                outcome = "untyped"
                report.findings.append({"case": i, "mutation": mutation, "error": f"{type(exc).__name__}: {exc}"[:300],
                                        "traceback": traceback.format_exc()[-1500:]})
                decoder.close()  # a coder in an unknown state: start the next case with fresh ones
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            seconds = time.perf_counter() - t0
            if seconds > report.slowest[0]:
                report.slowest = (seconds, i, mutation)
            report.outcomes[outcome] += 1
            report.cases = i + 1
            report.seconds = time.perf_counter() - t_start
            if progress:
                progress(i + 1, report)
    finally:
        signal.signal(signal.SIGALRM, old)
        decoder.close()
    return report


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvcodec_tools.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds one case may take before it is a hang")
    p.add_argument("--json", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    step = max(1, args.cases // 20)

    def progress(n: int, r: Report) -> None:
        if n % step == 0 or n == args.cases:
            print(f"[{n}/{args.cases}] {r.seconds:.0f} s, {dict(r.outcomes)}", flush=True)

    report = fuzz(args.cases, args.seed, args.timeout, progress)
    doc = dict(report.to_json(), seed=args.seed, timeout_s=args.timeout)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{report.cases} cases in {report.seconds:.0f} s: {doc['untyped']} untyped, {doc['hangs']} hangs "
          f"-> {args.json}")
    return 1 if doc["untyped"] or doc["hangs"] else 0


if __name__ == "__main__":
    sys.exit(main())
