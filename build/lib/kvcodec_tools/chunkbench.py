"""chunkbench: per-chunk CPU cost of the serving path kv_decode -> kv_restore -> llm gather, without Triton.

Why: the Triton ensemble spends, for every stored chunk of a request, one ``kv_decode`` call (bytes ->
typed planes), one ``kv_restore`` call (planes -> KV: float16, or the engine's float32 for ``raw``) and
one ``Assembler.add`` in ``llm``. This
tool times exactly those calls on real KV (the engine's model, SmolLM2-135M; the first ``chunks`` x 256
tokens of a text), per rung, so that the cost of the adapters and steps around the codec cores can be
compared across versions of the code (``--before`` embeds an earlier run's figures and the ratios).

What is timed, per chunk, mirrors ``model_repository/{kv_decode,kv_restore,llm}/1/model.py``; the
``pb_utils`` tensor conversions of ``kvcodec.triton`` are emulated in plain numpy (``as_numpy`` returns
the array, ``tensor`` is ``np.ascontiguousarray``, ``text_tensor`` a one-element object array of bytes):

- ``decode``:   the input chunk as a uint8 array (no copy) + ``DecodeStep.run(info, array)`` +
                ``descriptor(decoded)`` + the output tensors (planes8 / planes16, side, chunk_header);
- ``restore``:  picking planes16 or planes8 + ``RestoreStep(device).run_described(info, header, side, planes)``
                (which parses the descriptor), on the CPU as a CPU instance of kv_restore runs it: the
                planes arrive as numpy, the KV leaves as a CPU torch tensor (restore is torch);
- ``assemble``: ``Assembler.add(info, kv)`` for each chunk of the request (each copies its chunk into
                the request's preallocated array; the last also builds the result). Reported per chunk.
- ``kv_tensor``: kv_restore's ``kv`` / ``kv32`` output tensors (the KV in the one of its dtype, the other
                empty; a CPU tensor as its numpy view, as ``kvcodec.triton.tensor`` does), timed apart and
                left out of ``total_ms``: the restored KV of ``native``, ``q8``, ``qn`` and ``cg`` is not
                C-contiguous, so ``np.ascontiguousarray`` copies it; ``total_ms`` leaves this copy out.

Not emulated: ``ChunkInfo`` JSON in/out, the copies of ``pb_utils.Tensor`` into shared memory, and the
generation that follows the gather. Also timed, inside the very same calls (by wrapping them), are the
library cores alone: ``ChunkDecoder.decode`` (inside ``DecodeStep.run``) and ``serving.restore.restore``
(inside ``RestoreStep.run``), so ``decode_ms - inner_decode_ms`` is the step + adapter overhead.

Statistic: every repetition is one request of ``chunks`` chunks; each figure is that request's mean
per chunk; the value reported is the median over the repetitions after the first (a warm-up, discarded).
Times are wall-clock (``perf_counter``), with ``cpu_*`` twins from ``process_time`` (whole process: a
CPU figure well above the wall figure means a stage used more than one thread). One torch thread, one
decoder thread, ``OMP_NUM_THREADS=1`` (set before numpy loads).

Per rung the JSON holds those medians (``*_ms``), ``mb_s`` (a chunk's float16 bytes / ``total_ms``, the
same yardstick for every rung, also ``raw`` in float32),
``bytes_per_chunk``, the spread of the request's per-chunk total over the kept repetitions
(``total_ms_min`` / ``_max``) and ``assemble_ms_by_chunk`` (median per chunk index).

Run:  python -m kvcodec_tools.chunkbench --json perf/results/chunk_path.json [--before OLD.json]
"""
from __future__ import annotations

import os

# One thread everywhere (as tests/conftest.py does), set before numpy and torch start their pools.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence  # noqa: E402

import numpy as np  # noqa: E402

from kvcodec.format.auth import ChunkAuth  # noqa: E402
from kvcodec.serving import restore as restore_module  # noqa: E402
from kvcodec.serving.assemble import Assembled, Assembler  # noqa: E402
from kvcodec.serving.chunkinfo import ChunkInfo  # noqa: E402
from kvcodec.serving.decode import DecodeStep  # noqa: E402
from kvcodec.serving.restore import RestoreStep, descriptor  # noqa: E402

TEXT = "/usr/share/common-licenses/GPL-3"
RUNGS = ("video", "transform-zstd", "int8-zstd", "raw", "cachegen")
CHUNKS = 4
REPEATS = 7  # the first is a warm-up, discarded
TORCH_THREADS = 1
DECODER_THREADS = 1
RESTORE_DEVICE = "cpu"  # kv_restore's device on a CPU instance (KIND_GPU: cuda:<id>)
MACHINE = "2-core CPU, shared"
STAGES = ("decode", "restore", "assemble")  # total_ms is their sum
APART = ("kv_tensor", "inner_decode", "inner_restore")
EMPTY8 = np.zeros((0, 0, 0), np.uint8)
EMPTY16 = np.zeros((0, 0, 0), np.uint16)
EMPTY_KV16 = np.zeros((0, 2, 0, 0, 0), np.float16)
EMPTY_KV32 = np.zeros((0, 2, 0, 0, 0), np.float32)


# -- timing -------------------------------------------------------------------------------------------
class Probe:
    """Wraps a function and keeps the wall and CPU seconds of its latest call, so that a library core
    is timed inside the very step call that runs it (no second pass)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.wall = 0.0
        self.cpu = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        c0, t0 = time.process_time(), time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.wall = time.perf_counter() - t0
            self.cpu = time.process_time() - c0


def _timed(fn: Callable[..., Any], *args: Any) -> tuple:
    """(result, wall seconds, CPU seconds) of ``fn(*args)``."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0, time.process_time() - c0


# -- pb_utils, emulated as kvcodec.triton uses it -----------------------------------------------------
def _get_array(array: np.ndarray, dtype: Any) -> np.ndarray:
    """``get_array``: the input tensor's ``as_numpy()`` (the array itself), its dtype checked."""
    if array.dtype != np.dtype(dtype):
        raise TypeError(f"input must be {np.dtype(dtype).name}, got {array.dtype.name}")
    return array


def _get_text(array: np.ndarray) -> bytes:
    """``get_text``: the one string of a BYTES tensor."""
    value = array.reshape(-1)[0]
    return value if isinstance(value, bytes) else str(value).encode()


def _tensor(value: Any) -> np.ndarray:
    """``tensor``: ``pb_utils.Tensor(name, np.ascontiguousarray(value))`` (a CPU torch tensor: its numpy
    view), less the shared-memory copy."""
    return np.ascontiguousarray(value if isinstance(value, np.ndarray) else value.numpy())


def _text_tensor(text: str) -> np.ndarray:
    """``text_tensor``: a BYTES tensor of one UTF-8 string."""
    return np.array([text.encode("utf-8")], dtype=np.object_)


class Wire(NamedTuple):
    """The tensors kv_decode sends to kv_restore (besides chunk_info and the passed-through inputs)."""

    planes8: np.ndarray
    planes16: np.ndarray
    side: np.ndarray
    chunk_header: np.ndarray


class KVWire(NamedTuple):
    """The tensors kv_restore sends to llm: the KV as ``kv`` (float16) or ``kv32`` (float32), the other empty."""

    kv: np.ndarray
    kv32: np.ndarray


class ServingPath:
    """The three adapters' per-chunk calls into the library: one ``DecodeStep``, one ``RestoreStep`` and
    one ``Assembler``, as one server holds them. A context manager: inside it, ``ChunkDecoder.decode``
    and ``serving.restore.restore`` are wrapped in the probes ``inner_decode`` and ``inner_restore``."""

    def __init__(self, model_id: str, auth: ChunkAuth, decoder: str = "pyav", threads: int = DECODER_THREADS) -> None:
        self.decode_step = DecodeStep(model_id, auth=auth, decoder=decoder, threads=threads)
        self.restore_step = RestoreStep(RESTORE_DEVICE)
        self.assembler = Assembler()
        self.inner_decode = Probe(self.decode_step.decoder.decode)
        self.inner_restore = Probe(restore_module.restore)

    def __enter__(self) -> "ServingPath":
        self.decode_step.decoder.decode = self.inner_decode  # type: ignore[method-assign]  # shadows the method
        restore_module.restore = self.inner_restore  # RestoreStep.run looks it up in its module
        return self

    def __exit__(self, *exc: Any) -> None:
        restore_module.restore = self.inner_restore.fn
        self.decode_step.close()

    def decode(self, info: ChunkInfo, blob: bytes) -> Wire:
        """kv_decode's ``execute`` for one chunk."""
        decoded = self.decode_step.run(info, _get_array(np.frombuffer(blob, np.uint8), np.uint8))
        header, side = descriptor(decoded)
        wide = decoded.planes.dtype == np.uint16
        return Wire(_tensor(EMPTY8 if wide else decoded.planes), _tensor(decoded.planes if wide else EMPTY16),
                    _tensor(side), _text_tensor(header))

    def restore(self, info: ChunkInfo, wire: Wire) -> Any:
        """kv_restore's ``execute`` for one chunk, up to its output tensor: the step's KV (a CPU tensor,
        or the numpy ``EMPTY_KV`` of a failed chunk)."""
        planes16 = _get_array(wire.planes16, np.uint16)
        planes = planes16 if planes16.size else _get_array(wire.planes8, np.uint8)
        return self.restore_step.run_described(info, _get_text(wire.chunk_header), _get_array(wire.side, np.uint8),
                                               planes)

    @staticmethod
    def kv_tensor(kv: Any) -> KVWire:
        """kv_restore's ``kv`` and ``kv32`` output tensors (what llm receives)."""
        wide = kv.itemsize == 4
        return KVWire(_tensor(EMPTY_KV16 if wide else kv), _tensor(kv if wide else EMPTY_KV32))

    def assemble(self, info: ChunkInfo, wire: KVWire) -> Optional[Assembled]:
        """llm's gather (the non-empty one of ``kv`` / ``kv32``): ``None`` until the request's last chunk."""
        kv32 = _get_array(wire.kv32, np.float32)
        return self.assembler.add(info, kv32 if kv32.size else _get_array(wire.kv, np.float16))


# -- the measurement core -----------------------------------------------------------------------------
@dataclass
class Measurement:
    figures: Dict[str, float]  # milliseconds per chunk (see the module's docstring), and the spread
    assemble_ms_by_chunk: List[float]  # median per chunk index: where in the request the gather's copies fall
    past_kv: np.ndarray  # the last repetition's assembled KV, float16|float32 [layers, 2, kv_heads, tokens, head_dim]


def _check(stage: str, info: ChunkInfo, value: Any, last: bool) -> None:
    """Raises if a step failed: a benchmark of the failure path would be meaningless."""
    if not info.ok:
        raise RuntimeError(f"{stage} failed on chunk {info.index}: {info.status}: {info.reason}")
    if stage == "restore" and (str(value.dtype).replace("torch.", "") not in ("float16", "float32")
                               or value.shape[3] != info.tokens):
        raise RuntimeError(f"restore returned {value.dtype}{list(value.shape)} for {info.tokens} tokens")
    if stage == "assemble" and (value is None) == last:
        raise RuntimeError(f"assembler {'did not complete' if last else 'completed'} the request at chunk "
                           f"{info.index} of {info.count}")
    if stage == "assemble" and last and value.reused_tokens != info.count * info.tokens:
        raise RuntimeError(f"assembled request is short: {value.reason}")


def measure_chunks(blobs: Sequence[bytes], model_id: str, keys: Sequence[str], chunk_tokens: int, auth: ChunkAuth,
                   repeats: int = REPEATS, decoder: str = "pyav", threads: int = DECODER_THREADS,
                   session: str = "chunkbench") -> Measurement:
    """Times decode -> restore -> assemble of every chunk of one request (``blobs``, the chunks of one
    context in order, stored under ``keys``), ``repeats`` times, through a fresh ``ServingPath``."""
    if repeats < 2:
        raise ValueError(f"repeats must be at least 2 (the first is a warm-up), got {repeats}")
    n = len(blobs)
    names = STAGES + APART
    # samples[kind][name][rep][chunk], seconds; kind "wall" or "cpu"
    samples = {kind: {s: np.zeros((repeats, n)) for s in names} for kind in ("wall", "cpu")}
    assembled: Optional[Assembled] = None
    with ServingPath(model_id, auth, decoder=decoder, threads=threads) as path:
        probes = {"inner_decode": path.inner_decode, "inner_restore": path.inner_restore}
        for rep in range(repeats):
            gc.collect()  # no collection of the previous request's garbage inside the timed calls
            for i, blob in enumerate(blobs):
                info = ChunkInfo(f"{session}-{rep}", i, n, token_start=i * chunk_tokens, tokens=chunk_tokens,
                                 key=keys[i])
                wire, wall, cpu = _timed(path.decode, info, blob)
                _check("decode", info, wire, i == n - 1)
                samples["wall"]["decode"][rep, i], samples["cpu"]["decode"][rep, i] = wall, cpu
                kv, wall, cpu = _timed(path.restore, info, wire)
                _check("restore", info, kv, i == n - 1)
                samples["wall"]["restore"][rep, i], samples["cpu"]["restore"][rep, i] = wall, cpu
                kv_wire, wall, cpu = _timed(path.kv_tensor, kv)
                samples["wall"]["kv_tensor"][rep, i], samples["cpu"]["kv_tensor"][rep, i] = wall, cpu
                result, wall, cpu = _timed(path.assemble, info, kv_wire)
                _check("assemble", info, result, i == n - 1)
                samples["wall"]["assemble"][rep, i], samples["cpu"]["assemble"][rep, i] = wall, cpu
                for name, probe in probes.items():
                    samples["wall"][name][rep, i], samples["cpu"][name][rep, i] = probe.wall, probe.cpu
            assembled = result
    figures: Dict[str, float] = {}
    for kind, prefix in (("wall", ""), ("cpu", "cpu_")):
        per_rep = {s: 1e3 * samples[kind][s][1:].mean(axis=1) for s in names}  # warm-up dropped
        for s in names:
            figures[f"{prefix}{s}_ms"] = float(np.median(per_rep[s]))
        totals = sum(per_rep[s] for s in STAGES)
        figures[f"{prefix}total_ms"] = float(np.median(totals))
        if kind == "wall":
            figures["total_ms_min"], figures["total_ms_max"] = float(totals.min()), float(totals.max())
    by_chunk = [float(v) for v in 1e3 * np.median(samples["wall"]["assemble"][1:], axis=0)]
    assert assembled is not None and assembled.past_kv is not None  # _check saw every request complete
    return Measurement(figures, by_chunk, assembled.past_kv)


# -- the benchmark ------------------------------------------------------------------------------------
ROW_FIELDS = ("decode_ms", "restore_ms", "assemble_ms", "total_ms", "mb_s", "inner_decode_ms", "inner_restore_ms",
              "kv_tensor_ms", "bytes_per_chunk", "cpu_decode_ms", "cpu_restore_ms", "cpu_assemble_ms", "cpu_total_ms",
              "total_ms_min", "total_ms_max")


def run_chunkbench(settings: Any, rungs: Sequence[str], text_path: str | Path, chunks: int = CHUNKS,
                   repeats: int = REPEATS, json_path: Optional[str | Path] = None,
                   before: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Measures every rung on the KV of the first ``chunks`` chunks of ``text_path``; returns the result
    (and writes it as JSON to ``json_path`` if given). ``before``: an earlier run's JSON, whose rungs are
    embedded with the ratio of its total to this run's, per rung measured in both."""
    import torch

    from kvcodec.encode import ChunkEncoder
    from kvcodec.engines import open_engine
    from kvcodec.format.keys import chunk_keys
    from kvcodec.format.ladder import parse_rung

    engine = open_engine(settings)
    torch.set_num_threads(TORCH_THREADS)  # after the engine, which sets its own from settings.threads
    chunk_tokens = settings.chunk_tokens
    decoder_threads = max(1, settings.threads)
    ids = engine.tokenize(Path(text_path).read_text())[: chunk_tokens * chunks]
    if len(ids) < chunk_tokens * chunks:
        raise ValueError(f"{text_path} has only {len(ids)} tokens, {chunk_tokens * chunks} needed")
    kvs = list(engine.prefill_chunks(ids, chunk_tokens))  # float32 [layers, 2, kv_heads, tokens, head_dim]
    card = engine.card
    del engine
    gc.collect()
    fp16_bytes = int(np.prod(kvs[0].shape)) * 2

    result: Dict[str, Any] = {"rungs": {}}
    auth = ChunkAuth.random()  # the chunks never leave this process
    for spec in rungs:
        scheme = parse_rung(spec, card)  # bound as the server binds it: codec profile, KV dtype
        keys = chunk_keys(ids, card.model_id, scheme.identity, chunk_tokens)
        encoder = ChunkEncoder(scheme, card.model_id, auth=auth, threads=decoder_threads)
        blobs = [encoder.encode(kv, keys[i], i, i * chunk_tokens) for i, kv in enumerate(kvs)]
        measured = measure_chunks(blobs, card.model_id, keys, chunk_tokens, auth, repeats, decoder=settings.decoder,
                                  threads=decoder_threads, session=spec)
        m = measured.figures
        m["mb_s"] = fp16_bytes / (m["total_ms"] / 1e3) / 1e6
        m["bytes_per_chunk"] = sum(len(b) for b in blobs) / len(blobs)
        row: Dict[str, Any] = {k: round(m[k], 4) for k in ROW_FIELDS}
        row["assemble_ms_by_chunk"] = [round(v, 4) for v in measured.assemble_ms_by_chunk]
        result["rungs"][spec] = row
        print(_row(spec, result["rungs"][spec]), file=sys.stderr, flush=True)
    if before is not None:
        result["before"] = before["rungs"]
        result["before_commit"] = before.get("commit", "")
        result["ratio_total_before_over_after"] = {
            r: round(before["rungs"][r]["total_ms"] / after["total_ms"], 3)
            for r, after in result["rungs"].items() if r in before["rungs"]}
    result.update({
        "text": str(text_path),
        "chunks": chunks,
        "chunk_tokens": chunk_tokens,
        "kv_shape": list(kvs[0].shape),
        "fp16_bytes_per_chunk": fp16_bytes,
        "repeats": repeats,
        "warmup_discarded": 1,
        "statistic": "median over repetitions (warm-up excluded) of the request's per-chunk mean; wall-clock "
                     "perf_counter, cpu_* from process_time",
        "torch_threads": torch.get_num_threads(),
        "restore_device": RESTORE_DEVICE,
        "decoder_threads": decoder_threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "machine": MACHINE,
    })
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
    return result


def _row(rung: str, r: Mapping[str, float]) -> str:
    """One rung's figures on one line (progress, as each rung finishes)."""
    return (f"{rung:>15}: decode {r['decode_ms']:8.3f} (inner {r['inner_decode_ms']:8.3f})  "
            f"restore {r['restore_ms']:7.3f} (inner {r['inner_restore_ms']:7.3f})  "
            f"assemble {r['assemble_ms']:6.3f}  total {r['total_ms']:8.3f} ms  {r['mb_s']:7.1f} MB/s  "
            f"(kv tensor {r['kv_tensor_ms']:6.3f} ms apart)  {r['bytes_per_chunk']:10.0f} B/chunk")


def _cell(row: Mapping[str, float], before: Optional[Mapping[str, float]], name: str, width: int,
          fmt: str = ".2f") -> str:
    """``row[name]``, as ``before -> after`` when there is a before row."""
    text = f"{row[name]:{fmt}}" if before is None else f"{before[name]:{fmt}} -> {row[name]:{fmt}}"
    return f"{text:>{width}}"


def table(result: Mapping[str, Any]) -> str:
    """ms per chunk per stage and MB/s per rung; before -> after when the result embeds a before run."""
    before = result.get("before", {})
    ratios = result.get("ratio_total_before_over_after", {})
    lines = [f"{'rung':<15} {'decode ms':>17} {'restore ms':>17} {'assemble ms':>15} {'total ms':>17} "
             f"{'MB/s':>13} {'before/after':>12}"]
    for rung, r in result["rungs"].items():
        b = before.get(rung)
        ratio = f"{ratios[rung]:.2f}x" if rung in ratios else ""
        lines.append(f"{rung:<15} {_cell(r, b, 'decode_ms', 17)} {_cell(r, b, 'restore_ms', 17)} "
                     f"{_cell(r, b, 'assemble_ms', 15)} {_cell(r, b, 'total_ms', 17)} "
                     f"{_cell(r, b, 'mb_s', 13, '.0f')} {ratio:>12}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    from kvcodec.settings import Settings

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    p.add_argument("--before", type=Path, default=None, help="an earlier run's JSON, to embed and compare with")
    p.add_argument("--text", default=TEXT, help=f"the context text (default {TEXT})")
    p.add_argument("--rungs", default=",".join(RUNGS), help="comma list of rung specs")
    p.add_argument("--chunks", type=int, default=CHUNKS)
    p.add_argument("--repeats", type=int, default=REPEATS, help="requests per rung, the first a warm-up")
    p.add_argument("--model-cache", type=Path, default=None, help="default: the model_cache setting")
    args = p.parse_args(argv)
    explicit = {"threads": str(DECODER_THREADS)}
    if args.model_cache:
        explicit["model_cache"] = str(args.model_cache)
    before = json.loads(args.before.read_text()) if args.before else None
    result = run_chunkbench(Settings.load(explicit), [r.strip() for r in args.rungs.split(",") if r.strip()],
                            args.text, args.chunks, args.repeats, args.json, before)
    print(table(result))
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
