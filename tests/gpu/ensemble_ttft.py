"""The ensemble on the GPU: TTFT of prefill vs reuse per rung through a shaped link (issue 21, item 4).

Run by ``tests/gpu/run.sh`` after ``gpu_checks`` (there), and by ``run.sh --dry-run`` (here, on the
CPU: ``--dry-run``). What it does, in order, under one time budget (``--budget-s``):

1. unpacks the carried tiny model (``.gpu-carry/tiny-model.tar.xz``: SmolLM2-135M's KV geometry;
   the only model that fits a carry) and, there, the carried tritonserver
   (``.gpu-carry-triton/tritonserver.tar.xz``, named to ``kvcodec_tools.tritonserver`` by
   ``KVCODEC_TRITON_ROOT``; here, the ``.venv``'s nvidia-pytriton wheel);
2. lays the carried chunks (``.gpu-carry/chunks``: the video rungs; ``.gpu-carry-nvcomp/chunks``:
   the entropy rungs stored as today) into a file store's folder under their keys, signed with the
   carry's test key (``KVCODEC_CHUNK_KEY``), and serves it read-only over HTTP
   (``kvcodec_tools.http_store_server``: the GPU machine has no nginx);
3. starts tritonserver on the repository variant (there: ``.gpu-carry-triton/repository-gpu``,
   rendered here by ``kvcodec_tools.repository`` since the machine lacks tritonclient's protobufs:
   kv_fetch, kv_decode (NVDEC) and kv_restore and the transformers engine on the GPU; here: the
   committed CPU repository with PyAV);
4. for each link rate, puts the userspace shaper (``kvcodec_tools.shaping.open_link(...,
   "userspace")``) between kv_fetch and the store, points the server's store setting at it
   (one server per rate, as ``kvcodec bench ttft`` does) and measures prefill, each rung forced,
   and the adaptive ladder with ``kvcodec_tools.bench._measure`` (the CPU benchmark's own code),
   driving the ensemble through ``kvcodec_client``'s HTTP protocol (``generate_stream``; the
   standard library only, nothing carried);
5. writes the JSON (``kvcodec-gpu-ttft/1``: the CPU benchmark's rows plus ``device``, ``rates``,
   the per-stage seconds the responses report, a note) and a PNG.

The prompt is the carry's (``manifest.prompt``: 528 tokens); one 256-token chunk per rung is
carried, so a reuse request reuses 256 tokens and prefills the rest. The model is the tiny stand-in:
its prefill takes milliseconds on an H200, so reuse is expected to lose there; the table is about
the ensemble running on the GPU and what each stage costs, not about reuse paying off.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Sequence

from . import carry as carry_mod
from . import triton_carry

SCHEMA = "kvcodec-gpu-ttft/1"
RATES_GBIT = (1.0, 10.0, 40.0)
DRY_RATES_GBIT = (0.1,)
VIDEO = ("lossless8", "video-q8", "video", "video-tiled")
ENTROPY = ("int8-zstd", "kvtc-w")  # the stage's labels stored as today (no frame_kb: the server's specs)
DRY_RUNGS = ("lossless8", "video")
BUDGET_S = 180
DRY_BUDGET_S = 240
NOTE = ("The model is the tiny stand-in (tests/gpu/tiny_model.py: SmolLM2-135M's KV geometry, random weights): "
        "its prefill takes milliseconds on a GPU, so reuse is expected to lose to prefill there. The table is "
        "about the ensemble (kv_fetch -> kv_decode -> kv_restore -> llm) running on the device and what each "
        "stage costs (stage_s: transfer, decode, restore seconds from the responses' stats).")


def store_layout(entries: Sequence[Dict[str, Any]], folders: Sequence[Path], root: Path) -> Dict[str, str]:
    """Copy each manifest chunk to ``root/<key>.kvc`` (``kvcodec.store.fs``'s layout); label -> key."""
    keys: Dict[str, str] = {}
    for entry, folder in zip(entries, folders, strict=True):
        target = root / (entry["key"] + ".kvc")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / entry["file"], target)
        keys[entry["rung"]] = entry["key"]
    return keys


def pick_chunks(carry: Path, stage: Optional[Path], rungs: Sequence[str]):
    """The manifest entries (chunk 0) of ``rungs`` from the carry and the stage, with their folders."""
    entries, folders = [], []
    sources = [(carry, carry_mod.load_manifest(carry))]
    if stage is not None and (stage / carry_mod.MANIFEST).is_file():
        sources.append((stage, carry_mod.load_manifest(stage, carry_mod.STAGE_FORMAT)))
    for rung in rungs:
        for folder, manifest in sources:
            found = [e for e in manifest["chunks"] if e["rung"] == rung and e["index"] == 0]
            if found:
                entries.append(found[0])
                folders.append(folder)
                break
    return entries, folders


def result_json(rows: List[dict], *, device: str, rates_gbit: Sequence[float], dry_run: bool,
                extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The file's content: the CPU benchmark's rows, with the GPU run's fields around them."""
    from kvcodec_tools.bench import checks

    return {"schema": SCHEMA, "dry_run": bool(dry_run), "device": device, "rates_gbit": list(rates_gbit),
            "note": NOTE, "rows": rows, "checks": checks(rows) if rows else {},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(extra or {})}


def write_json(path: Path, data: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def missing_libs(root: Path, library_path: str) -> List[str]:
    """The libraries ``ldd`` cannot find for the server, its python backend and the stub, with
    ``library_path`` as the server's ``LD_LIBRARY_PATH`` (say a missing ``libpython3.12.so.1.0``
    in seconds rather than after the server's start timeout)."""
    import subprocess

    stub = root / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" / "triton_python_backend_stub"
    binaries = [root / "bin" / "tritonserver", root / "backends" / "python" / "libtriton_python.so", stub]
    env = dict(os.environ, LD_LIBRARY_PATH=library_path)
    missing = set()
    for binary in binaries:
        if not binary.is_file():
            missing.add(f"{binary.name} (the file itself)")
            continue
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env).stdout
        missing |= {line.split("=>")[0].strip() for line in out.splitlines() if "not found" in line}
    return sorted(missing)


def adaptive_recompute(row: Dict[str, Any]) -> bool:
    """The adaptive row chose to recompute (its cost model found prefill faster than fetching):
    a choice, not a miss; the static rows are what show the keys match."""
    return row["method"] == "kvcodec" and not row["reused_tokens"] and \
        re.match(r"(chunk \d+: )?recompute\b", str(row.get("miss_reason") or "")) is not None


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"cuda: {torch.cuda.get_device_name(0)}"
    except Exception:
        pass
    return "cpu"


def run(args) -> int:
    from kvcodec.settings import Settings
    from kvcodec_client.client import KVCodecClient
    from kvcodec_tools.bench import _measure, plot
    from kvcodec_tools.http_store_server import PREFIX, serve
    from kvcodec_tools.ports import free_ports
    from kvcodec_tools.shaping import open_link
    from kvcodec_tools.tritonserver import Ports, TritonServer

    from . import tiny_model

    t0 = time.monotonic()
    carry, stage = Path(args.carry), Path(args.stage) if args.stage else None
    manifest = carry_mod.load_manifest(carry)
    dry = args.dry_run
    rates = DRY_RATES_GBIT if dry else RATES_GBIT
    rungs = list(DRY_RUNGS if dry else VIDEO + ENTROPY)
    work = Path(tempfile.mkdtemp(prefix="kvcodec-gpu-ttft-"))
    json_path, png_path = Path(args.json), Path(args.json).with_suffix(".png")
    rows: List[dict] = []
    extra: Dict[str, Any] = {"budget_s": args.budget_s, "prompt_tokens": len(manifest["prompt"]["ids"])}
    device = "cpu (dry run)" if dry else _device()
    store = None
    try:
        folder = tiny_model.unpack(carry / manifest["model"]["file"], work / "model")
        if not dry:
            root = triton_carry.unpack(Path(args.triton), work / "triton")
            os.environ["KVCODEC_TRITON_ROOT"] = str(root)
            repository = Path(args.triton) / "repository-gpu"
        else:
            repository = carry_mod.REPO / "model_repository"
        entries, folders = pick_chunks(carry, stage, rungs)
        keys = store_layout(entries, folders, work / "store")
        rungs = [e["rung"] for e in entries]  # the ones carried (the stage's only where it was staged)
        extra.update(rungs=rungs, keys=keys, repository=str(repository))
        os.environ["KVCODEC_CHUNK_KEY"] = manifest["auth_key_hex"]
        if not dry:
            env = TritonServer(repository, Settings.load({"home": str(work / "home")}), Ports()).environment()
            extra["missing_libs"] = missing_libs(Path(os.environ["KVCODEC_TRITON_ROOT"]), env["LD_LIBRARY_PATH"])
            if extra["missing_libs"]:
                write_json(json_path, result_json(rows, device=device, rates_gbit=rates, dry_run=dry, extra=extra))
                print("tritonserver cannot start, libraries not found: " + ", ".join(extra["missing_libs"]))
                return 1
        store = serve(work / "store")
        store_port = store.server_address[1]
        ids = manifest["prompt"]["ids"]
        base = Settings.load({"home": str(work / "home"), "model": str(folder), "engine": "transformers",
                              "decoder": "pyav" if dry else "nvdec", "threads": "2", "chunk_tokens": "256",
                              "ladder": ",".join(rungs), "writeback": "off", "decoder_process": "1" if dry else "0"})
        config = SimpleNamespace(runs=args.runs, prefill_runs=args.runs, max_tokens=4)
        methods = ["prefill"] + rungs + ["kvcodec"]
        links = []
        for rate in rates:
            if time.monotonic() - t0 > args.budget_s * 0.6:
                extra.setdefault("skipped_rates_gbit", []).append(rate)
                continue
            with open_link(rate * 1000.0, args.delay_ms, "userspace") as link:
                host, port = link.expose(store_port)
                url = f"http://{host}:{port}{PREFIX}"
                links.append(dict(link.describe(), rate_gbit=rate, store_url=url))
                server = TritonServer(repository, replace(base, store=url, adaptive=True), Ports(*free_ports(3)),
                                      log_path=Path(args.json).with_name("gpu_ttft.server.log"))
                server.start(timeout_s=min(180.0, max(30.0, args.budget_s - (time.monotonic() - t0))))
                try:
                    client = KVCodecClient(server.http_url, "http", timeout_s=60.0)
                    client.generate(ids[:32], 1, reuse=False)  # one-time costs (CUDA context, kernels)
                    prefill_tokens = None
                    for method in methods:
                        row = _measure(client, method, ids, config)
                        tokens = row.pop("_tokens")
                        if method == "prefill":
                            prefill_tokens = tokens
                        row.update(rate_gbit=rate, bandwidth_mbps=rate * 1000.0, context_tokens=len(ids),
                                   link=link.kind, tokens_match=tokens == prefill_tokens)
                        rows.append(row)
                        print(f"{rate:g} Gbit/s {method:<12} TTFT p50 {row['ttft_p50_s']:.4f} s, reused "
                              f"{row['reused_tokens']}, {row['bytes_fetched']} B, stages {row['stage_s']}", flush=True)
                        write_json(json_path, result_json(rows, device=device, rates_gbit=rates, dry_run=dry,
                                                          extra=dict(extra, links=links)))
                finally:
                    server.stop()
        extra["links"] = links
    finally:
        if store is not None:
            store.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    extra["wall_s"] = round(time.monotonic() - t0, 1)
    missed = [f"{r['method']} at {r['rate_gbit']:g} Gbit/s ({r['miss_reason'] or 'no reuse'})" for r in rows
              if r["method"] != "prefill" and not r["reused_tokens"] and not adaptive_recompute(r)]
    extra["missed"] = missed
    extra["adaptive_recomputed"] = [f"{r['rate_gbit']:g} Gbit/s: {r['miss_reason']}" for r in rows if adaptive_recompute(r)]
    write_json(json_path, result_json(rows, device=device, rates_gbit=rates, dry_run=dry, extra=extra))
    if rows:
        try:
            plot(rows, png_path)
        except Exception as exc:  # matplotlib missing or broken: the JSON is the result
            print(f"no plot: {exc!r}")
    print(f"wrote {json_path} ({len(rows)} rows, {extra['wall_s']} s)")
    if missed:
        print("NO REUSE: " + "; ".join(missed))
    return 1 if missed or not rows else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.ensemble_ttft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--carry", default=str(carry_mod.REPO / carry_mod.CARRY))
    ap.add_argument("--stage", default=str(carry_mod.REPO / carry_mod.STAGE))
    ap.add_argument("--triton", default=str(carry_mod.REPO / triton_carry.TRITON_STAGE))
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT") or ".", "gpu_ttft.json"))
    ap.add_argument("--dry-run", action="store_true", help="here: the CPU repository, PyAV, 0.1 Gbit/s, two rungs")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--delay-ms", type=float, default=0.5)
    ap.add_argument("--budget-s", type=float, default=None)
    args = ap.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = DRY_BUDGET_S if args.dry_run else BUDGET_S
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
