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

This module makes the chunks, runs the benchmarks and writes the JSON; each benchmark is a module
of its own: ``encode_candidates`` (time, bytes and KV error per candidate), ``encode_kl``,
``encode_ingest`` (the ingest rates and the chunk workers), ``encode_video_ingest``
(``--video-ingest``) and ``encode_device`` (``--device``), the candidates they share in
``encode_common``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import numpy as np

from .encode_candidates import kv_mse, time_candidates
from .encode_common import BASE, CANDIDATES, COMPARED, QP, codec_params
from .encode_device import device_main
from .encode_ingest import ingest_pool, ingest_rates
from .encode_kl import kl_rows
from .encode_video_ingest import video_ingest


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
