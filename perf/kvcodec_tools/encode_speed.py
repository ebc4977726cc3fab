"""``make bench-encode``: what x265 settings cost and save on the ``video`` rung's planes.

Real KV chunks (``--chunks`` chunks of one eval text) become the ``pca10`` planes once, with the
``video`` scheme's layout as it is; then each candidate (an x265 preset, coding tools in
``Hevc``'s ``x265`` parameter, x265 frame threads) encodes them, the candidates interleaved
within each of ``--rounds`` rounds, and per candidate the JSON holds:

- ``s_per_chunk`` (the median over rounds, mean over chunks, wall clock) and ``cpu_s_per_chunk``
  (the process's CPU time over the same encodes: x265's threads included; on a shared machine
  the steadier of the two for comparing tools, the wall clock says what threads buy);
- ``bytes`` (the chunks' bitstreams) and ``bytes_vs_base`` against the baseline (``medium``, the
  ``video`` scheme's settings, at the same QP);
- ``kv_mse`` (restored KV against the engine's, over every element) and ``mse_vs_base``;
- for the candidates named in ``--kl`` (and the baseline): the mean KL and top-1 of
  ``kvcodec_tools.quality.evaluate.compare`` on ``--kl-texts`` texts of the eval set, at the same QP.

Then the ingest rate per rung (the default ladder and the baselines, ``kvtc`` where
``SCHEMES`` has it, and ``video`` with the ``COMPARED`` candidate's tools): tokens per second of ``ChunkEncoder``
as ingest uses it (one encoder, ``threads=1``), prefill's own rate beside them, and whole
ingests of the default ladder into a memory store with ``workers`` chunk encoders (``ingest``'s
pool) against one, interleaved.

``--device`` (for a quiet many-core machine, no model there): loads planes saved with
``--save-planes`` and times each candidate in its own process pinned to its own core (x265's
pool of one thread), then the threading options on two pinned cores; no distortion.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

QP = 7


@dataclass(frozen=True)
class Candidate:
    name: str
    preset: str = "medium"
    x265: str = ""  # Hevc's x265 parameter (coding tools)
    threads: int = 1  # x265 frame threads (Hevc's threads: ctx.thread_count)
    note: str = ""


BASE = "medium"
# The candidate timed beside the rung in the ingest rates and on two cores: the fastest at the
# rung's KV error (rejected on KL: perf/results/README.md, "Encode speed").
COMPARED = "ctu16-info0"
CANDIDATES = (
    Candidate(BASE, note="the video scheme as it is (ingest's threads=1)"),
    Candidate("medium-ft2", threads=2, note="2 x265 frame threads (ingest threads=2)"),
    Candidate("medium-info0", x265="info=0", note="no x265 version/options SEI"),
    Candidate("fast", preset="fast"),
    Candidate("ultrafast", preset="ultrafast"),
    Candidate("rd2", x265="rd=2"),
    Candidate("rd1", x265="rd=1"),
    Candidate("rd2-rdoq1", x265="rd=2:rdoq-level=1"),
    Candidate("mincu16", x265="min-cu-size=16", note="no 8x8 CUs, no 4x4 intra PUs"),
    Candidate("mincu16-rdoq1", x265="min-cu-size=16:rdoq-level=1"),
    Candidate("ctu32", x265="ctu=32"),
    Candidate("ctu16", x265="ctu=16:max-tu-size=16"),
    Candidate("ctu16-info0", x265="ctu=16:max-tu-size=16:info=0", note="16x16 CTUs, no SEI"),
    Candidate("ctu16-nosao-info0", x265="ctu=16:max-tu-size=16:sao=0:info=0"),
    Candidate("maxtu16-nosis", x265="max-tu-size=16:strong-intra-smoothing=0"),
    Candidate("nosao", x265="sao=0"),
    Candidate("nosao-info0", x265="sao=0:info=0", note="no SAO, no SEI"),
    Candidate("rskip2", x265="rskip=2"),
)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _coder(c: Candidate, qp: int = QP, pools: int = 0):
    from kvcodec.bitstream.hevc import Hevc

    coder = Hevc(lossless=False, qp=qp, preset=c.preset, bit_depth=10, tune="mse", x265=c.x265,
                 threads=c.threads)
    if pools:  # x265's thread pool (not a coding tool: only where the cores are pinned)
        base = coder.x265_params
        coder.x265_params = lambda: f"{base()}:pools={pools}"
    return coder


def codec_params(c: Candidate, qp: int = QP) -> Dict[str, Any]:
    """The ``video`` scheme's codec_params with this candidate's settings (threads are runtime)."""
    params: Dict[str, Any] = {"lossless": False, "qp": qp, "preset": c.preset, "bit_depth": 10, "tune": "mse"}
    if c.x265:
        from kvcodec.bitstream.hevc import x265_tools

        params["x265"] = x265_tools(c.x265)
    return params


def _summary(rows: Dict[str, List[List[float]]]) -> Dict[str, float]:
    """``rows[chunk] = [value per round]`` -> mean over chunks of the median over rounds."""
    return float(np.mean([statistics.median(v) for v in rows.values()]))


def time_candidates(planes: Sequence[np.ndarray], candidates: Sequence[Candidate], rounds: int,
                    pools: int = 0) -> Dict[str, Dict[str, Any]]:
    """Each candidate encodes each chunk's planes once a round, candidates interleaved."""
    wall: Dict[str, Dict[int, List[float]]] = {c.name: {} for c in candidates}
    cpu: Dict[str, Dict[int, List[float]]] = {c.name: {} for c in candidates}
    streams: Dict[str, List[bytes]] = {}
    for r in range(rounds):
        for i, p in enumerate(planes):
            for c in candidates:
                coder = _coder(c, pools=pools)
                c0, t0 = _cpu(), time.perf_counter()
                data = coder.encode(p)
                wall[c.name].setdefault(i, []).append(time.perf_counter() - t0)
                cpu[c.name].setdefault(i, []).append(_cpu() - c0)
                if r == 0:
                    streams.setdefault(c.name, []).append(data)
        print(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{c.name} {_summary(wall[c.name]):.2f}s" for c in candidates), flush=True)
    return {c.name: {"s_per_chunk": round(_summary(wall[c.name]), 3),
                     "cpu_s_per_chunk": round(_summary(cpu[c.name]), 3),
                     "bytes": sum(len(d) for d in streams[c.name]), "_streams": streams[c.name]}
            for c in candidates}


def kv_mse(layout, chunks, streams: Sequence[bytes]) -> float:
    """Mean squared error of the restored KV against the engine's, over every chunk's elements."""
    from kvcodec.bitstream.hevc import PyAVDecoder
    from kvcodec.format.geometry import Geometry

    dec = PyAVDecoder(threads=1)
    total, n = 0.0, 0
    for (kv, planes, side, start), data in zip(chunks, streams, strict=True):
        f, h, w = planes.shape
        decoded = np.stack(dec.decode(data, w, h, 10))
        restored = layout.from_planes(decoded, side, Geometry.of(kv), token_start=start).astype(np.float64)
        total += float(np.sum((restored - kv.astype(np.float64)) ** 2))
        n += kv.size
    return total / n


def kl_rows(engine, scheme, candidates: Sequence[Candidate], texts: Sequence[int], prefix: int) -> Dict[str, Any]:
    """Mean KL and top-1 (``kvcodec_tools.quality.evaluate.compare``) per candidate, means over ``texts``."""
    from dataclasses import replace

    from kvcodec_tools.quality import evalset
    from kvcodec_tools.quality.evaluate import compare, reference

    out: Dict[str, Dict[str, Any]] = {c.name: {"per_text": {}} for c in candidates}
    for t in texts:
        text = evalset.EVAL_SET[t]
        (_, ids), = evalset.load([text], engine.tokenize, prefix + 64)
        ref = reference(engine, ids, prefix, 64)
        for c in candidates:
            r = compare(engine, ref, replace(scheme, codec_params=codec_params(c)))
            out[c.name]["per_text"][text.name] = {"mean_kl": r.mean_kl, "top1": r.top1_agreement,
                                                  "ratio_vs_fp16": r.ratio_vs_fp16, "greedy": r.greedy_match_tokens}
            print(f"  KL {text.name} {c.name}: {r.mean_kl:.6f} top-1 {r.top1_agreement:.3f} "
                  f"ratio {r.ratio_vs_fp16:.3f}", flush=True)
    for row in out.values():
        per = list(row["per_text"].values())
        row["mean_kl"] = round(float(np.mean([p["mean_kl"] for p in per])), 6)
        row["top1"] = round(float(np.mean([p["top1"] for p in per])), 4)
    return out


def ingest_rates(engine, kv_chunks, chosen: Candidate, rounds: int, chunk_tokens: int) -> Dict[str, Any]:
    """Tokens/s of ChunkEncoder per rung (threads=1, as ingest's default), rungs interleaved."""
    from dataclasses import replace

    from kvcodec.encode import ChunkEncoder
    from kvcodec.format.auth import ChunkAuth
    from kvcodec.format.codecs import SCHEMES
    from kvcodec.format.ladder import DEFAULT_LADDER, parse_rung

    names = list(dict.fromkeys(list(DEFAULT_LADDER) + ["raw", "int8-zstd", "lossless8", "cachegen",
                                                       "transform-zstd", "video"]
                               + (["kvtc"] if "kvtc" in SCHEMES else [])))
    schemes = {n: parse_rung(n, engine.card) for n in names}
    schemes[f"video+{chosen.name}"] = replace(schemes["video"], codec_params=codec_params(chosen))
    auth = ChunkAuth.random()
    encoders = {n: ChunkEncoder(s, engine.model_id, auth=auth, threads=1) for n, s in schemes.items()}
    secs: Dict[str, Dict[int, List[float]]] = {n: {} for n in schemes}
    size: Dict[str, int] = {n: 0 for n in schemes}
    for r in range(rounds):
        for i, kv in enumerate(kv_chunks):
            for n, enc in encoders.items():
                t0 = time.perf_counter()
                data = enc.encode(kv, f"k{i}", i, i * chunk_tokens)
                secs[n].setdefault(i, []).append(time.perf_counter() - t0)
                if r == 0:
                    size[n] += len(data)
    fp16 = sum(kv.size * 2 for kv in kv_chunks)
    rows = {}
    for n in schemes:
        s = _summary(secs[n])
        rows[n] = {"s_per_chunk": round(s, 3), "tokens_per_s": round(chunk_tokens / s, 1),
                   "ratio_vs_fp16": round(fp16 / size[n], 3), "in_default_ladder": n in DEFAULT_LADDER}
        print(f"  ingest {n}: {s:.3f} s/chunk, {chunk_tokens / s:.0f} tokens/s", flush=True)
    return rows


def ingest_pool(engine, ids: Sequence[int], chunk_tokens: int, workers: Sequence[int], rounds: int,
                threads: int = 1) -> Dict[str, Any]:
    """Whole ingests (prefill + every rung of the default ladder) into a fresh memory store, with
    each number of chunk workers of ``kvcodec.ingest.ingest``, interleaved over ``rounds``."""
    from kvcodec.format.auth import ChunkAuth
    from kvcodec.format.ladder import DEFAULT_LADDER, parse_ladder
    from kvcodec.ingest import ingest
    from kvcodec.store.memory import MemoryStore

    schemes = parse_ladder(list(DEFAULT_LADDER), engine.card)
    auth = ChunkAuth.random()
    secs: Dict[int, List[float]] = {w: [] for w in workers}
    encode_s: Dict[int, List[float]] = {w: [] for w in workers}
    for _ in range(rounds):
        for w in workers:
            store = MemoryStore(f"encode-speed-{uuid.uuid4().hex}")  # a fresh, empty store each run
            t0 = time.perf_counter()
            rep = ingest(engine, store, ids, schemes, chunk_tokens, auth=auth, threads=threads, workers=w)
            secs[w].append(time.perf_counter() - t0)
            assert rep.written == len(schemes) * (len(ids) // chunk_tokens), rep
            for key in list(store._data):
                store.delete(key)
            encode_s[w].append(rep.encode_s)
            print(f"  ingest of the default ladder, workers={w}: {secs[w][-1]:.1f} s", flush=True)
    n = len(ids) // chunk_tokens * chunk_tokens
    return {str(w): {"s": round(statistics.median(secs[w]), 2), "tokens_per_s": round(n / statistics.median(secs[w]), 1),
                     "runs_s": [round(x, 2) for x in secs[w]]} for w in workers}


def video_ingest(engine, ids: Sequence[int], chunk_tokens: int, configs: Sequence[tuple], rounds: int,
                 threads: int = 1) -> Dict[str, Any]:
    """Whole ingests of one rung each (``configs``: ``(rung spec, workers)``) into a fresh memory
    store, interleaved over ``rounds``: the wall clock of the encodes (the ingest's wall clock less
    its prefill, the same work for every config), tokens per second of the whole ingest, and the
    bytes stored. ``speedup`` and ``bytes_vs_first`` are against the first config (the rung as
    ingest ran it before: ``video``, one chunk at a time)."""
    from kvcodec.format.auth import ChunkAuth
    from kvcodec.format.ladder import parse_rung
    from kvcodec.ingest import ingest
    from kvcodec.store.memory import MemoryStore

    auth = ChunkAuth.random()
    name = lambda spec, w: f"{spec} x{w}"  # noqa: E731
    encode: Dict[str, List[float]] = {name(*c): [] for c in configs}
    total: Dict[str, List[float]] = {name(*c): [] for c in configs}
    size: Dict[str, int] = {}
    for _ in range(rounds):
        for spec, w in configs:
            store = MemoryStore(f"video-ingest-{uuid.uuid4().hex}")
            t0 = time.perf_counter()
            rep = ingest(engine, store, ids, [parse_rung(spec, engine.card)], chunk_tokens, auth=auth,
                         threads=threads, workers=w)
            wall = time.perf_counter() - t0
            for key in list(store._data):
                store.delete(key)
            n = name(spec, w)
            total[n].append(wall)
            encode[n].append(wall - rep.prefill_s)
            size[n] = rep.bytes_written
            print(f"  ingest {n}: {wall:.1f} s, of which encode {wall - rep.prefill_s:.1f} s", flush=True)
    first = name(*configs[0])
    tokens = len(ids) // chunk_tokens * chunk_tokens
    e0 = statistics.median(encode[first])
    return {n: {"encode_wall_s": round(statistics.median(encode[n]), 2),
                "speedup": round(e0 / statistics.median(encode[n]), 3),
                "ingest_tokens_per_s": round(tokens / statistics.median(total[n]), 1),
                "bytes": size[n], "bytes_vs_first": round(size[n] / size[first] - 1, 5),
                "encode_runs_s": [round(x, 2) for x in encode[n]]} for n in encode}


def make_chunks(engine, text_index: int, n_chunks: int, chunk_tokens: int):
    """(kv, planes, side, token_start) per chunk of the eval text, the video scheme's layout, and
    the seconds prefill took."""
    from kvcodec.format.ladder import parse_rung
    from kvcodec.layout import get_layout
    from kvcodec_tools.quality import evalset

    (_, ids), = evalset.load([evalset.EVAL_SET[text_index]], engine.tokenize, n_chunks * chunk_tokens)
    t0 = time.perf_counter()
    kvs = list(engine.prefill_chunks(ids, chunk_tokens))
    prefill_s = time.perf_counter() - t0
    scheme = parse_rung("video", engine.card)
    layout = get_layout(scheme.layout, **scheme.layout_params)
    chunks = []
    for i, kv in enumerate(kvs):
        planes, side = layout.to_planes(kv, token_start=i * chunk_tokens)
        chunks.append((kv, planes, side, i * chunk_tokens))
    return ids, chunks, layout, scheme, prefill_s


# -- the device mode: a quiet many-core machine, planes carried in a .npz ---------------------------

def _pinned(args) -> Dict[str, Any]:
    core, cand, path, rounds = args
    os.sched_setaffinity(0, {core})
    planes = list(np.load(path).values())
    res = time_candidates(planes, [cand], rounds, pools=1)[cand.name]
    res.pop("_streams")
    return res


def physical_cores() -> List[List[int]]:
    """The logical CPUs this process may use, grouped by physical core (SMT siblings together)."""
    groups: Dict[str, List[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        try:
            key = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            key = str(cpu)
        groups.setdefault(key, []).append(cpu)
    return list(groups.values())


def device_main(a) -> Dict[str, Any]:
    import multiprocessing as mp

    planes = list(np.load(a.planes).values())
    phys = physical_cores()
    cores = [g[0] for g in phys]  # one logical CPU per physical core
    out: Dict[str, Any] = {"logical_cpus": sum(len(g) for g in phys), "physical_cores": len(phys),
                           "chunks": len(planes)}
    # 1. each candidate alone on its own physical core (x265's pool of one thread): its CPU cost
    wanted = [n for n in a.candidates.split(",") if n]
    cands = [c for c in CANDIDATES if c.threads == 1 and (not wanted or c.name in wanted or c.name == BASE)]
    spare = cores[2:] or cores  # the first two physical cores are for part 2
    jobs = [(spare[k % len(spare)], c, a.planes, a.rounds) for k, c in enumerate(cands)]
    with mp.get_context("spawn").Pool(min(len(jobs), len(spare))) as pool:
        out["one_core"] = dict(zip([c.name for c in cands], pool.map(_pinned, jobs), strict=True))
    for n, r in out["one_core"].items():
        print(f"one core: {n} {r['s_per_chunk']:.2f} s/chunk", flush=True)
    # 2. the threading options on two cores, pinned: x265 frame threads, two chunks at once
    os.sched_setaffinity(0, set(cores[:2]))  # two physical cores, one logical CPU of each
    out["two_cores"] = two_cores(planes, a.rounds, cands)
    out["two_cores_cpus"] = cores[:2]
    return out


def two_cores(planes: Sequence[np.ndarray], rounds: int, cands: Sequence[Candidate], pools: int = 2) -> Dict[str, Any]:
    """Seconds per chunk over all chunks: one encoder with 1 or 2 frame threads, and a pool of two
    encoders (1 frame thread each) over the chunks, interleaved over ``rounds``."""
    ways: Dict[str, Any] = {}
    for cand in cands:
        for ft in (1, 2):
            c = Candidate(cand.name, cand.preset, cand.x265, ft)
            ways[f"{cand.name} frame-threads={ft}"] = (c, 1)
        ways[f"{cand.name} 2 chunk workers"] = (cand, 2)
    secs: Dict[str, List[float]] = {k: [] for k in ways}
    for _ in range(rounds):
        for k, (c, workers) in ways.items():
            t0 = time.perf_counter()
            with ThreadPoolExecutor(workers) as ex:
                list(ex.map(lambda p, c=c: _coder(c, pools=pools).encode(p), planes))
            secs[k].append((time.perf_counter() - t0) / len(planes))
            print(f"two cores: {k} {secs[k][-1]:.2f} s/chunk", flush=True)
    return {k: round(statistics.median(v), 3) for k, v in secs.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", type=int, default=0, help="eval text whose chunks are encoded (index)")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--candidates", default="", help="comma list of candidate names (default: all)")
    ap.add_argument("--kl", default="nosao-info0,ctu16-info0", help="comma list of candidates whose KL to measure ('' for none)")
    ap.add_argument("--kl-texts", default="0,5", help="eval set indices for the KL (argparse.py, http/client.py)")
    ap.add_argument("--ingest-rounds", type=int, default=2, help="0: no ingest rates")
    ap.add_argument("--workers", default="1,2", help="chunk workers of the whole-ingest runs")
    ap.add_argument("--save-planes", default="", help="write the planes to this .npz (for --device)")
    ap.add_argument("--device", action="store_true", help="the pinned-core timing of planes from --planes")
    ap.add_argument("--planes", default="")
    ap.add_argument("--json", default="perf/results/encode_speed.json")
    ap.add_argument("--video-ingest", default="",
                    help="only whole ingests of these RUNG@WORKERS (video@1,video-fast@2), text --text, "
                         "--chunks chunks, --rounds rounds: encode wall clock and bytes, to --json")
    a = ap.parse_args(argv)
    if a.device:
        result = device_main(a)
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
        return 0

    import torch

    torch.set_num_threads(2)
    from kvcodec.engines import open_engine
    from kvcodec.settings import Settings

    engine = open_engine(Settings.load({"model_cache": ".cache/models"}))
    chunk_tokens = 256
    if a.video_ingest:
        return _video_ingest_main(a, engine, chunk_tokens)
    ids, chunks, layout, scheme, prefill_s = make_chunks(engine, a.text, a.chunks, chunk_tokens)
    if a.save_planes:
        np.savez_compressed(a.save_planes, **{f"c{i}": c[1] for i, c in enumerate(chunks)})
    wanted = [n for n in a.candidates.split(",") if n]
    cands = [c for c in CANDIDATES if not wanted or c.name in wanted or c.name == BASE]
    print(f"{len(cands)} candidates x {len(chunks)} chunks x {a.rounds} rounds", flush=True)
    timed = time_candidates([c[1] for c in chunks], cands, a.rounds)
    base = timed[BASE]
    base_mse = kv_mse(layout, chunks, base["_streams"])
    rows = {}
    for c in cands:
        t = timed[c.name]
        mse = base_mse if c.name == BASE else kv_mse(layout, chunks, t.pop("_streams"))
        rows[c.name] = {"preset": c.preset, "x265": c.x265, "threads": c.threads, "note": c.note,
                        "s_per_chunk": t["s_per_chunk"], "cpu_s_per_chunk": t["cpu_s_per_chunk"],
                        "speedup_wall": round(base["s_per_chunk"] / t["s_per_chunk"], 3),
                        "speedup_cpu": round(base["cpu_s_per_chunk"] / t["cpu_s_per_chunk"], 3),
                        "bytes": t["bytes"], "bytes_vs_base": round(t["bytes"] / base["bytes"] - 1, 5),
                        "kv_mse": mse, "mse_vs_base": round(mse / base_mse - 1, 5),
                        "codec_params": codec_params(c)}
        print(f"{c.name:16s} {t['s_per_chunk']:6.2f} s {t['cpu_s_per_chunk']:6.2f} cpu-s "
              f"bytes {rows[c.name]['bytes_vs_base']:+.2%} mse {rows[c.name]['mse_vs_base']:+.2%}", flush=True)
    base.pop("_streams", None)
    result: Dict[str, Any] = {
        "what": "x265 settings on the video rung's pca10 planes at QP 7 (perf/kvcodec_tools/encode_speed.py)",
        "text": a.text, "chunks": len(chunks), "rounds": a.rounds, "qp": QP, "base": BASE, "compared": COMPARED,
        "prefill_s_per_chunk": round(prefill_s / len(chunks), 3), "candidates": rows,
    }
    kl_names = [n for n in a.kl.split(",") if n]
    if kl_names:
        kl_cands = [c for c in CANDIDATES if c.name == BASE or c.name in kl_names]
        texts = [int(t) for t in a.kl_texts.split(",") if t]
        kl = kl_rows(engine, scheme, kl_cands, texts, a.chunks * chunk_tokens)
        for n, r in kl.items():
            rows.setdefault(n, {})["kl"] = r
        result["kl_texts"] = texts
    if a.ingest_rounds:
        chosen = next(c for c in CANDIDATES if c.name == COMPARED)
        result["ingest_tokens_per_s"] = ingest_rates(engine, [c[0] for c in chunks], chosen, a.ingest_rounds,
                                                     chunk_tokens)
        result["prefill_tokens_per_s"] = round(chunk_tokens / result["prefill_s_per_chunk"], 1)
        workers = [int(w) for w in a.workers.split(",") if w]
        result["ingest_default_ladder"] = ingest_pool(engine, ids, chunk_tokens, workers, a.ingest_rounds)
    Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


def _video_ingest_main(a, engine, chunk_tokens: int) -> int:
    from kvcodec_tools.quality import evalset

    configs = []
    for item in filter(None, a.video_ingest.split(",")):
        spec, _, w = item.partition("@")
        configs.append((spec, int(w or 1)))
    text = evalset.EVAL_SET[a.text]
    (_, ids), = evalset.load([text], engine.tokenize, a.chunks * chunk_tokens)
    t0 = time.perf_counter()
    rows = video_ingest(engine, ids, chunk_tokens, configs, a.rounds)
    result = {"what": "whole ingests of one rung each into a memory store (perf/kvcodec_tools/encode_speed.py --video-ingest): "
                      "encode wall clock = ingest less its prefill; medians over rounds",
              "text": text.name, "chunks": a.chunks, "rounds": a.rounds, "cores": os.cpu_count(),
              "load_avg_1m": round(os.getloadavg()[0], 2), "wall_s": round(time.perf_counter() - t0, 1),
              "configs": rows}
    Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
