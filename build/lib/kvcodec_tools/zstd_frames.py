"""``python -m kvcodec_tools.zstd_frames``: what independent zstd frames cost in bytes on the
entropy-coded rungs (``zstd``'s ``frame_kb``, the form a GPU decodes side by side: nvCOMP's batched
zstd), on real KV, side by side with the one-frame payloads stored today: ``perf/results/zstd_frames.json``.

Real KV chunks (``--texts`` eval texts x ``--chunks`` 256-token chunks, SmolLM2) become each rung's
planes once (``int8-zstd``, ``kvtc-w``; their layouts as the rungs set them); each framing
(``--frames-kb``, 0 = one frame) compresses them at the rung's level: bytes, ratio vs fp16, the
bytes against one frame, and the CPU decode MB/s of fp16 KV (python-zstandard, one thread, best of
``--repeats``; the GPU figure is the prepared GPU run's ``nvcomp`` check).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence


def run(rungs: Sequence[str], frames_kb: Sequence[int], texts: int, chunks: int, repeats: int) -> Dict[str, Any]:
    from kvcodec.bitstream.simple import Zstd
    from kvcodec.format.ladder import parse_rung
    from kvcodec.layout import get_layout
    from kvcodec_tools.tiling import _chunks

    card, kvs = _chunks(texts, chunks)
    fp16 = sum(kv.size * 2 for kv, _ in kvs)
    out: Dict[str, Any] = {"model": card.model_id, "chunks": len(kvs), "fp16_bytes": fp16, "rungs": {}}
    for rung in rungs:
        scheme = parse_rung(rung, card)
        layout = get_layout(scheme.layout, **scheme.layout_params)
        at = (lambda start: {"token_start": start}) if layout.needs_positions else (lambda start: {})
        planes = [layout.to_planes(kv, **at(start))[0] for kv, start in kvs]
        rows = []
        for kb in frames_kb:
            coder = Zstd(level=scheme.codec_params["level"], frame_kb=int(kb))
            t0 = time.perf_counter()
            payloads = [coder.encode(p) for p in planes]
            encode_s = time.perf_counter() - t0
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                for p, data in zip(planes, payloads, strict=True):
                    coder.decode(data, p.shape)
                best = min(best, time.perf_counter() - t0)
            size = sum(len(d) for d in payloads)
            rows.append({"frame_kb": int(kb), "frames_per_chunk": len(coder.frames(payloads[0])), "bytes": size,
                         "ratio_vs_fp16": round(fp16 / size, 4), "encode_s_per_chunk": round(encode_s / len(planes), 3),
                         "cpu_decode_mb_s_1t": round(fp16 / best / 1e6, 1)})
        for row in rows:
            row["bytes_vs_one_frame"] = round(row["bytes"] / rows[0]["bytes"], 4)
        out["rungs"][rung] = {"level": scheme.codec_params["level"], "planes_shape": list(planes[0].shape), "rows": rows}
        print(f"{rung}: " + ", ".join(f"{r['frame_kb']} KiB: {r['ratio_vs_fp16']}x ({r['bytes_vs_one_frame']})"
                                      for r in rows), file=sys.stderr, flush=True)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcodec_tools.zstd_frames", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rungs", default="int8-zstd,kvtc-w")
    ap.add_argument("--frames-kb", default="0,64,256,1024")
    ap.add_argument("--texts", type=int, default=1)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--note", default="")
    ap.add_argument("--json", type=Path, default=Path("perf/results/zstd_frames.json"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    result = {"schema": "kvcodec-zstd-frames/1", "note": args.note,
              **run(args.rungs.split(","), [int(k) for k in args.frames_kb.split(",")], args.texts, args.chunks,
                    args.repeats)}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
