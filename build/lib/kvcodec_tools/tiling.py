"""``python -m kvcodec_tools.tiling``: the video rung's planes in few large frames against one small
frame per plane (``kvcodec.bitstream.tiling``), side by side in one run: ``perf/results/tiling.json``.

Two parts, then the gate:

- ``--bench``: real KV chunks (``--texts`` eval texts x ``--chunks`` 256-token chunks, SmolLM2)
  encoded once per frame shape (the video rung's settings with ``tile`` = 0, one frame per plane,
  labelled "old frames" in the results, and
  each of ``--tiles`` Mpixel), the shapes interleaved: bitstream bytes, x265 encode seconds, and
  PyAV decode MB/s of fp16 KV (frames decoded and untiled, no restore) at 1 and 2 decoder
  threads, best of ``--repeats`` rounds;
- ``--rd-json`` / ``--task-json``: the quality harness's results on the same two rungs in one run
  each (``kvcodec rd --settings video:13,<tiled>:13`` over the eval set, ``kvcodec eval-task
  --task passkey --codec video,<tiled>``), read and summarised;
- ``--probe``: on the same chunks, x265's coding tools on the tiled frames (``--tools``, each a
  ``hevc`` ``x265`` string) against one frame per plane at one QP: bytes and the squared error of
  the decoded planes, each relative to those of one frame per plane (what chose the tiled rung's tools);
- the gate: the tiled rung's ratio vs fp16 at least 97% of the untiled video rung's, its task
  accuracy at least 97% of theirs, and it passes rd's own quality gate (mean KL, top-1).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

GATE = 0.97  # within 3% of today's video:13


def _chunks(texts: int, chunks: int, chunk_tokens: int = 256):
    import torch

    from kvcodec.engines import open_engine
    from kvcodec.settings import Settings
    from kvcodec_tools.quality import evalset

    torch.set_num_threads(2)
    engine = open_engine(Settings.load())
    out = []
    for _, ids in evalset.load(evalset.EVAL_SET[:texts], engine.tokenize, chunks * chunk_tokens):
        out += [(kv, i * chunk_tokens) for i, kv in enumerate(engine.prefill_chunks(ids[:chunks * chunk_tokens],
                                                                                     chunk_tokens))]
    return engine.card, out


def _planes(texts: int, chunks: int, base: str):
    """(card, chunks, ``base``'s scheme, its hevc parameters without tiling or x265 tools, each
    chunk's planes in ``base``'s layout)."""
    from kvcodec.format.ladder import parse_rung
    from kvcodec.layout import get_layout

    card, kvs = _chunks(texts, chunks)
    scheme = parse_rung(base, card)
    untiled = {k: v for k, v in scheme.codec_params.items() if k not in ("tile", "x265")}
    layout = get_layout(scheme.layout, **scheme.layout_params)
    return card, kvs, scheme, untiled, [layout.to_planes(kv, token_start=start)[0] for kv, start in kvs]


def bench(tiles: Sequence[int], texts: int, chunks: int, repeats: int, base: str = "video", log=print,
          tools: str = "") -> Dict[str, Any]:
    """``tools``: the x265 options of the tiled frames (the tiled rung's), none on the old frames."""
    import numpy as np

    from kvcodec.bitstream.hevc import Hevc, PyAVDecoder

    card, kvs, _, untiled, planes = _planes(texts, chunks, base)
    fp16 = sum(kv.size * 2 for kv, _ in kvs)
    shapes = [0] + [int(t) for t in tiles]
    tiled = {"x265": tools} if tools else {}
    coders = {t: Hevc(**dict(untiled, **({"tile": t, **tiled} if t else {}))) for t in shapes}
    rows: Dict[int, Dict[str, Any]] = {t: {"tile_mpx": t, "encode_s": 0.0, "bytes": 0} for t in shapes}
    streams: Dict[int, List[bytes]] = {t: [] for t in shapes}
    for p in planes:
        for t in shapes:  # interleaved: the machine's noise falls on every shape alike
            t0 = time.perf_counter()
            streams[t].append(coders[t].encode(p))
            rows[t]["encode_s"] += time.perf_counter() - t0
            rows[t]["bytes"] += len(streams[t][-1])
        log(f"encoded chunk {len(streams[0])}/{len(planes)}")
    for t in shapes:
        rows[t]["frames"] = [list(coders[t].stream_shape(p.shape)) for p in planes[:1]][0]
        decoded = [coders[t].decode(s, p.shape) for s, p in zip(streams[t], planes, strict=True)]
        if t:
            same = [coders[0].decode(s, p.shape) for s, p in zip(streams[0], planes, strict=True)]
            rows[t]["mean_abs_sample_change_vs_old_frames"] = float(np.mean(
                [np.abs(a.astype(np.int32) - b.astype(np.int32)).mean() for a, b in zip(decoded, same, strict=True)]))
        rows[t]["ratio_vs_fp16"] = round(fp16 / rows[t]["bytes"], 4)
        rows[t]["encode_s_per_chunk"] = round(rows[t].pop("encode_s") / len(planes), 3)
    for threads in (1, 2):
        best = {t: float("inf") for t in shapes}
        decoder = PyAVDecoder(threads=threads)
        for _ in range(repeats):
            for t in shapes:
                t0 = time.perf_counter()
                for s, p in zip(streams[t], planes, strict=True):
                    coders[t].decode_with(decoder, s, p.shape)
                best[t] = min(best[t], time.perf_counter() - t0)
        for t in shapes:
            rows[t][f"pyav_decode_mb_s_{threads}t"] = round(fp16 / best[t] / 1e6, 1)
        log(f"decode at {threads} thread(s): " + ", ".join(f"tile {t}: {rows[t][f'pyav_decode_mb_s_{threads}t']} MB/s"
                                                           for t in shapes))
    for t in shapes[1:]:
        for key in ("ratio_vs_fp16", "pyav_decode_mb_s_1t", "pyav_decode_mb_s_2t"):
            rows[t][f"{key}_vs_old"] = round(rows[t][key] / rows[0][key], 3)
    return {"base": base, "tiled_x265": tools, "model": card.model_id, "chunks": len(planes), "texts": texts,
            "planes_shape": list(planes[0].shape), "fp16_bytes": fp16, "repeats": repeats,
            "rows": [rows[t] for t in shapes]}


def probe(tools: Sequence[str], texts: int, chunks: int, base: str = "video", tile: int = 4,
          log=print) -> Dict[str, Any]:
    """Bytes and planes squared error of the tiled frames with each of ``tools`` (x265 options, ""
    for none) against the old frames, at ``base``'s QP, on real chunks."""
    import numpy as np

    from kvcodec.bitstream.hevc import Hevc

    _, _, scheme, untiled, planes = _planes(texts, chunks, base)
    arrangements = [("old frames", dict(untiled))] + [
        (f"tiled {tile} Mpixel" + (f", {t}" if t else ""), dict(untiled, tile=tile, **({"x265": t} if t else {})))
        for t in tools]
    rows = []
    for name, params in arrangements:
        coder, size, err, seconds = Hevc(**params), 0, 0.0, 0.0
        for p in planes:
            t0 = time.perf_counter()
            data = coder.encode(p)
            seconds += time.perf_counter() - t0
            size += len(data)
            err += float(((coder.decode(data, p.shape).astype(np.float64) - p) ** 2).sum())
        row = {"arrangement": name, "x265": params.get("x265", ""), "bytes": size,
               "planes_mse": round(err / sum(p.size for p in planes), 4),
               "encode_s_per_chunk": round(seconds / len(planes), 2)}
        if rows:
            row["bytes_vs_old"] = round(size / rows[0]["bytes"], 4)
            row["planes_mse_vs_old"] = round(row["planes_mse"] / rows[0]["planes_mse"], 4)
        rows.append(row)
        log(json.dumps(row))
    return {"base": base, "qp": scheme.codec_params.get("qp"), "chunks": len(planes), "texts": texts,
            "planes_shape": list(planes[0].shape), "rows": rows}


def _rd(path: Path, old: str, new: str) -> Dict[str, Any]:
    rd = json.loads(Path(path).read_text())
    keep = ("setting", "ratio_vs_fp16", "mean_kl", "top1_agreement", "greedy_min", "greedy_mean", "decode_mb_s",
            "gate", "gate_kind")
    by = {s["setting"]: {k: s.get(k) for k in keep} for s in rd["summary"]}
    return {"source": str(path), "texts": rd["config"]["texts"], "wall_s": rd["config"].get("wall_s"),
            "old": by[old], "new": by[new]}


def _task(path: Path, old: str, new: str) -> Dict[str, Any]:
    task = json.loads(Path(path).read_text())
    pick = ("accuracy_codec", "ratio_vs_fp16", "lossless_in_accuracy", "codec_id")
    codecs = task["codecs"]
    return {"source": str(path), "task": task["task"], "samples": task["samples"],
            "context_tokens": task["context_tokens"], "accuracy_prefill": task["accuracy_prefill"],
            "prefill_interval95": task["prefill_interval95"],
            "old": {k: codecs[old].get(k) for k in pick}, "new": {k: codecs[new].get(k) for k in pick}}


def gate(rd: Optional[Dict[str, Any]], task: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"rule": f"tiled ratio >= {GATE} x old, tiled task accuracy >= {GATE} x old, rd gate passes"}
    checks = []
    if rd:
        out["ratio_new_over_old"] = round(rd["new"]["ratio_vs_fp16"] / rd["old"]["ratio_vs_fp16"], 4)
        checks += [out["ratio_new_over_old"] >= GATE, bool(rd["new"]["gate"])]
    if task:
        old, new = task["old"]["accuracy_codec"], task["new"]["accuracy_codec"]
        out["accuracy_new_over_old"] = round(new / old, 4) if old else None
        checks.append(new >= GATE * old)
    out["measured"] = {"rd": rd is not None, "task": task is not None}
    out["pass"] = bool(checks) and all(checks) and rd is not None and task is not None
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcodec_tools.tiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", action="store_true", help="encode real chunks per frame shape; PyAV decode MB/s")
    ap.add_argument("--base", default="video", help="the rung whose settings the bench takes (its tile replaced)")
    ap.add_argument("--tiles", default="1,2,4", help="Mpixel per frame to compare with the old frames (tile 0)")
    ap.add_argument("--texts", type=int, default=1)
    ap.add_argument("--chunks", type=int, default=4, help="256-token chunks per text")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--probe", action="store_true", help="x265 tools on the tiled frames: bytes, planes error")
    ap.add_argument("--tools", default=",rdoq-level=1,rdoq-level=2,tskip=1,rdoq-level=1:tskip=1,rdoq-level=2:tskip=1",
                    help="comma-separated x265 strings for --probe (an empty one: no tools)")
    ap.add_argument("--rd-json", type=Path, help="kvcodec rd's result on the old and the tiled rung")
    ap.add_argument("--task-json", type=Path, help="kvcodec eval-task's result on the old and the tiled rung")
    ap.add_argument("--old", default="video", help="the old frames' rung as rd and eval-task name it")
    ap.add_argument("--new", default="video-tiled", help="the tiled rung as rd and eval-task name it")
    ap.add_argument("--qp", type=int, default=13, help="the QP rd's settings name (NAME:QP)")
    ap.add_argument("--note", default="", help="how and where it ran, kept in the JSON")
    ap.add_argument("--json", type=Path, default=Path("perf/results/tiling.json"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    result: Dict[str, Any] = {"schema": "kvcodec-tiling/1", "note": args.note}
    if args.json.is_file():  # a later part keeps the earlier parts of the same run
        result.update({k: v for k, v in json.loads(args.json.read_text()).items() if k in ("bench", "rd", "task", "tools_probe", "planes_probe")})
    if args.bench:
        from kvcodec.format.codecs import SCHEMES

        result["bench"] = bench([int(t) for t in args.tiles.split(",") if t], args.texts, args.chunks, args.repeats,
                                args.base, log=lambda m: print(m, file=sys.stderr, flush=True),
                                tools=SCHEMES[args.new].codec_params.get("x265", ""))
    if args.probe:
        result["tools_probe"] = probe(args.tools.split(","), args.texts, args.chunks, args.base,
                                      log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.rd_json:
        result["rd"] = _rd(args.rd_json, f"{args.old}:{args.qp}", f"{args.new}:{args.qp}")
    if args.task_json:
        result["task"] = _task(args.task_json, args.old, args.new)
    result["gate"] = gate(result.get("rd"), result.get("task"))
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result.get("gate"), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
