"""The folder the GPU check run carries to the lent machine (``.gpu-carry/``): made and checked here.

The lent machine (``/work/.library/device/README.md``) has Python 3.12, torch, transformers and
numpy, but no PyAV (so no encoder), no registry and at most 64 MiB carried per call, the repo's
own files included. So everything it needs that it lacks is made here, by ``prepare``:

- ``wheels/``: the PyNvVideoCodec 2.2.4 cp312 wheel, fetched with the device README's own
  ``pip download`` line and checked against its pinned SHA-256 (no other wheel is needed: the
  decode and restore path of the video rungs imports numpy and torch only; zstandard,
  constriction and av are imported lazily by other rungs and the encoder);
- ``tiny-model.tar.xz``: a tiny Llama with SmolLM2-135M's KV geometry and tokenizer
  (``tiny_model``), since the real model does not fit;
- ``chunks/<rung>/<index>.kvc``: the tiny model's KV of a fixed prompt (the committed
  ``perf/inputs/default.context.txt``, first ``PROMPT_TOKENS`` tokens), computed on this CPU and
  stored through ``kvcodec.ingest.ingest`` with the model's card: ``raw`` and the video rungs
  ``lossless8``, ``video-q8``, ``video`` and ``video-tiled`` (``CHUNKS`` says how many, how long), signed with a
  fixed test key (``AUTH_HEX``: these chunks are test data);
- ``manifest.json``: per chunk its rung, key, file digest, geometry, the planes digest taken at
  ingest (what NVDEC's output must hash to) and per-frame digests and sums (to say which frames
  differ when one does); the prompt's token ids; the CPU engine's reference tokens.

The video chunks come in both frame shapes (``OLD_FRAMES``: one 256x192 frame per plane;
``NEW_FRAMES``: the planes tiled into few large frames, ``kvcodec.bitstream.tiling``), so NVDEC's
throughput is measured on both in one run.

A second folder, ``.gpu-carry-nvcomp/`` (``STAGE``), is carried by an earlier call of its own (the
two would pass 64 MiB together; what a call carried stays on the warm machine for the next):
nvCOMP's two wheels (``NVCOMP_WHEELS``, pinned by SHA-256, ~34 MB) and chunks of the entropy-coded
rungs (``ENTROPY``: ``int8-zstd`` and ``kvtc-w`` as stored today, one zstd frame, and with
``frame_kb`` 64 framing) with their own manifest.

``verify`` checks the manifest against the files (digests, and a software decode of every chunk
compared with the planes digest); ``sizes`` checks the carried total against ``LIMIT``.
``run_call`` is the device call to make on a session with a GPU.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

REPO = Path(__file__).resolve().parents[2]
CARRY = ".gpu-carry"
MANIFEST = "manifest.json"
MODEL_ARCHIVE = "tiny-model.tar.xz"
FORMAT = "kvcodec-gpu-carry/1"
LIMIT = 64 * 1024 * 1024  # what one device call may carry, the repo's files included
WARN = 60 * 1024 * 1024  # leave room for files others add before the GPU session
WHEEL = "pynvvideocodec-2.2.4-cp312-cp312-manylinux_2_28_x86_64.whl"
WHEEL_SPEC = "pynvvideocodec==2.2.4"
WHEEL_SHA256 = "41ad2b4d010ed22eb46c849d3e792789ae06281f6b41767c1b25f76f130aee98"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
OLD_FRAMES, NEW_FRAMES = "video", "video-tiled"  # one small frame per plane; few large frames
RAW_RUNG, VIDEO_RUNGS = "raw", ("lossless8", "video-q8", OLD_FRAMES, NEW_FRAMES)
RUNGS = (RAW_RUNG,) + VIDEO_RUNGS
CHUNK_TOKENS = 256  # the deployment's default (NVDEC takes no picture side under 144)
# (chunks, tokens a chunk) per rung, sized to fit 64 MiB with room for the tree to grow: a raw chunk
# is float32 (47 KB a token) and this model's KV is noise to a video codec (a 256-token chunk is 1.8
# to 3.3 MB at every rung)
CHUNKS = {"raw": (1, 64), "lossless8": (1, CHUNK_TOKENS), "video-q8": (1, CHUNK_TOKENS),
          OLD_FRAMES: (1, CHUNK_TOKENS), NEW_FRAMES: (1, CHUNK_TOKENS)}
# the stage folder: nvCOMP's wheels and the entropy-coded rungs' chunks (label -> rung, codec params)
STAGE = ".gpu-carry-nvcomp"
STAGE_FORMAT = "kvcodec-gpu-stage/1"
ENTROPY: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "int8-zstd": ("int8-zstd", {}), "kvtc-w": ("kvtc-w", {}),
    "int8-zstd-f64": ("int8-zstd", {"frame_kb": 64}), "kvtc-w-f64": ("kvtc-w", {"frame_kb": 64})}
NVCOMP_SPECS = ("nvidia-nvcomp-cu13==6.0.0.12", "nvidia-libnvcomp-cu13==6.0.0.12")
NVCOMP_WHEELS = {  # py3-none: one wheel for every CPython (3.12 there, 3.11 here)
    "nvidia_nvcomp_cu13-6.0.0.12-py3-none-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl":
        "8386ba3ab6c968d001138eda0f66fe7b7a847e7241384a63232b1c2d50a79d74",
    "nvidia_libnvcomp_cu13-6.0.0.12-py3-none-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl":
        "d1cf156f7885b9b1ad17ac0059b678e04869466f81207e51fed330f8ffbfcd5a",
}
STAGE_TIMEOUT_S = 60
PROMPT_SOURCE = "perf/inputs/default.context.txt"
PROMPT_TOKENS = 2 * CHUNK_TOKENS + 16
MAX_TOKENS = 16
AUTH_HEX = hashlib.blake2b(b"kvcodec-gpu-checks test key", digest_size=32).hexdigest()
RUN_TIMEOUT_S = 600  # the run call's timeout_s (the most one call may run): gpu_checks (run.sh's LIMIT_S) and
# then tests/gpu/ensemble_ttft.py (run.sh's TTFT_LIMIT_S) end first
TRITON_STAGE = ".gpu-carry-triton"  # the third folder: tritonserver and the gpu repository (tests/gpu/triton_carry.py)
TRITON_TIMEOUT_S = 60
DEVICE_BUDGET_S = 15 * 60  # a session's device time, start-up, idle waits and transfers included
STARTUP_S = 120  # a machine's start, measured ~1-2 min; the calls' transfers and gaps come out of the rest


class CarryError(RuntimeError):
    """The carried folder cannot be made or does not check out."""


def auth():
    from kvcodec.format.auth import ChunkAuth

    return ChunkAuth(bytes.fromhex(AUTH_HEX))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- the wheel ------------------------------------------------------------------------------------
def pip_download_args(dest: Path, spec: str = WHEEL_SPEC) -> List[str]:
    """The device README's ``pip download`` line for a wheel (without the interpreter)."""
    args = ["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args + ["-d", str(dest), spec]


def _download(path: Path, spec: str, pinned: str, python: str, timeout_s: float) -> Path:
    if not path.is_file() or sha256(path) != pinned:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            proc = subprocess.run([python, *pip_download_args(path.parent, spec)], capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise CarryError(f"pip download {spec} took over {timeout_s:.0f} s") from None
        if proc.returncode or not path.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise CarryError(f"pip download {spec} failed (rc {proc.returncode}): {' | '.join(tail)}")
    got = sha256(path)
    if got != pinned:
        raise CarryError(f"{path.name}: SHA-256 {got}, pinned {pinned}")
    return path


def _only(folder: Path, names: Iterable[str]) -> None:
    """One version of each wheel: two stop the install there."""
    keep = set(names)
    for other in folder.iterdir():
        if other.name not in keep:
            other.unlink()


def fetch_wheel(carry: Path, python: str = sys.executable, timeout_s: float = 300) -> Path:
    """The wheel in ``carry/wheels``, downloaded if missing; its SHA-256 must be the pinned one."""
    path = _download(carry / "wheels" / WHEEL, WHEEL_SPEC, WHEEL_SHA256, python, timeout_s)
    _only(path.parent, [WHEEL])
    return path


def fetch_nvcomp_wheels(stage: Path, python: str = sys.executable, timeout_s: float = 300) -> List[Path]:
    """nvCOMP's two wheels in ``stage/wheels``, downloaded if missing, pinned by SHA-256."""
    out = [_download(stage / "wheels" / name, spec, pinned, python, timeout_s)
           for (name, pinned), spec in zip(NVCOMP_WHEELS.items(), NVCOMP_SPECS, strict=True)]
    _only(stage / "wheels", NVCOMP_WHEELS)
    return out


# -- chunks and the manifest ------------------------------------------------------------------------
def frame_stats(planes: np.ndarray) -> List[Dict[str, Any]]:
    """Per frame: BLAKE2b-64 of its samples, their sum, min and max."""
    out = []
    for frame in planes:
        f = np.ascontiguousarray(frame)
        out.append({"digest": hashlib.blake2b(memoryview(f).cast("B"), digest_size=8).hexdigest(),
                    "sum": int(f.sum(dtype=np.int64)), "min": int(f.min()), "max": int(f.max())})
    return out


def chunk_entry(rung: str, index: int, rel: str, data: bytes, chunk_auth, decoder: str = "pyav") -> Dict[str, Any]:
    """The manifest entry of one chunk: what its header says, and what a software decode of it
    gives (which must hash to the header's planes digest: ``ChunkDecoder`` checks it)."""
    from kvcodec.encode import planes_digest
    from kvcodec.serving.decode import ChunkDecoder

    header = _header(data, chunk_auth)
    dec = ChunkDecoder(header.model_id, auth=chunk_auth, decoder=decoder)
    try:
        planes = dec.decode(data, key=header.key).planes
    finally:
        dec.close()
    if planes_digest(planes) != header.planes_digest:
        raise CarryError(f"{rel}: decoded planes do not hash to the header's digest")
    return {
        "rung": rung, "index": int(index), "file": rel, "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "key": header.key, "model_id": header.model_id, "scheme_id": header.scheme_id,
        "token_start": header.token_start, "geometry": header.geometry.to_dict(),
        "fp16_bytes": int(header.geometry.fp16_bytes),
        "planes_shape": list(header.planes_shape), "planes_dtype": header.planes_dtype.name,
        "planes_digest": header.planes_digest, "frames": frame_stats(planes),
    }


def _header(data: bytes, chunk_auth):
    from kvcodec.format import container
    from kvcodec.format.header import ChunkHeader

    return ChunkHeader.from_dict(container.parse(data, chunk_auth).header)


def write_chunks(carry: Path, chunks: Iterable[Tuple[str, int, bytes]], chunk_auth,
                 decoder: str = "pyav") -> List[Dict[str, Any]]:
    """Write each (rung, index, bytes) as ``chunks/<rung>/<index>.kvc``; their manifest entries."""
    entries = []
    for rung, index, data in chunks:
        rel = f"chunks/{rung}/{index:04d}.kvc"
        (carry / rel).parent.mkdir(parents=True, exist_ok=True)
        (carry / rel).write_bytes(data)
        entries.append(chunk_entry(rung, index, rel, data, chunk_auth, decoder))
    return entries


def load_manifest(carry: Path, fmt: str = FORMAT) -> Dict[str, Any]:
    path = Path(carry) / MANIFEST
    if not path.is_file():
        raise CarryError(f"{path} is missing: run `bash tests/gpu/run.sh --dry-run` on a machine with the venv"
                         + (" (and carry it with the stage call first)" if fmt == STAGE_FORMAT else ""))
    manifest = json.loads(path.read_text())
    if manifest.get("format") != fmt:
        raise CarryError(f"{path}: format {manifest.get('format')!r}, this build reads {fmt}")
    return manifest


def verify(carry: Path, manifest: Dict[str, Any], decoder: Optional[str] = "pyav") -> List[str]:
    """What does not match between the manifest and the files (empty: all of it does). With a
    ``decoder``, every chunk is decoded again and its planes compared with the manifest."""
    from kvcodec.encode import planes_digest
    from kvcodec.errors import KVCodecError
    from kvcodec.serving.decode import ChunkDecoder

    carry = Path(carry)
    problems: List[str] = []
    files = [manifest["model"]] if "model" in manifest else []
    files += list(manifest.get("wheels", [])) + list(manifest["chunks"])
    for item in files:
        path = carry / item["file"]
        if not path.is_file():
            problems.append(f"{item['file']}: missing")
        elif path.stat().st_size != item["bytes"] or sha256(path) != item["sha256"]:
            problems.append(f"{item['file']}: size or SHA-256 differs from the manifest")
    chunk_auth = auth()
    decoders: Dict[str, Any] = {}
    try:
        for entry in manifest["chunks"]:
            path = carry / entry["file"]
            if not path.is_file():
                continue
            data = path.read_bytes()
            try:
                header = _header(data, chunk_auth)
                for name in ("key", "scheme_id", "planes_digest", "model_id"):
                    if getattr(header, name) != entry[name]:
                        problems.append(f"{entry['file']}: header {name} differs from the manifest")
                if decoder is None:
                    continue
                dec = decoders.setdefault(entry["model_id"], ChunkDecoder(entry["model_id"], auth=chunk_auth,
                                                                          decoder=decoder))
                planes = dec.decode(data, key=entry["key"]).planes
                if planes_digest(planes) != entry["planes_digest"] or frame_stats(planes) != entry["frames"]:
                    problems.append(f"{entry['file']}: decoded planes differ from the manifest")
            except (KVCodecError, ValueError) as exc:
                problems.append(f"{entry['file']}: {type(exc).__name__}: {exc}")
    finally:
        for dec in decoders.values():
            dec.close()
    return problems


# -- sizes ------------------------------------------------------------------------------------------
def tree_files(repo: Path, skip: Sequence[str] = ()) -> Dict[str, int]:
    """What a device call sends besides the carried paths: tracked files and untracked files git
    does not ignore (and a ``shared/`` folder in the checkout), with their sizes."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout.decode()
    names = set(filter(None, out.split("\0")))
    if (repo / "shared").is_dir():
        names |= {str(p.relative_to(repo)) for p in (repo / "shared").rglob("*") if p.is_file()}
    sizes = {}
    for name in sorted(names):
        if any(name == s or name.startswith(s.rstrip("/") + "/") for s in skip):
            continue
        path = repo / name
        if path.is_symlink() or path.is_file():
            sizes[name] = path.lstat().st_size
    return sizes


def folder_files(folder: Path) -> Dict[str, int]:
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.lstat().st_size for p in sorted(folder.rglob("*"))
            if p.is_file() or p.is_symlink()}


def sizes(repo: Path, carry: Path, limit: int = LIMIT, warn: int = WARN) -> Dict[str, Any]:
    """The bytes one device call would carry: the tree's and the carried folder's, against ``limit``."""
    carry = Path(carry)
    try:
        rel = str(carry.resolve().relative_to(Path(repo).resolve()))
    except ValueError:
        rel = ""
    tree = tree_files(Path(repo), skip=[rel] if rel else [])
    carried = folder_files(carry)
    groups: Dict[str, int] = {}
    for name, n in carried.items():
        top = name.split("/", 1)[0]
        groups[top] = groups.get(top, 0) + n
    total = sum(tree.values()) + sum(carried.values())
    return {"tree_bytes": sum(tree.values()), "tree_files": len(tree), "carry_bytes": sum(carried.values()),
            "carry": groups, "total_bytes": total, "limit_bytes": int(limit), "total_MiB": round(total / 2**20, 2),
            "ok": total <= limit, "warning": (f"over {warn / 2**20:.0f} MiB: little room for files added before "
                                              f"the GPU session") if warn < total <= limit else None}


def check_sizes(report: Dict[str, Any]) -> None:
    if not report["ok"]:
        raise CarryError(f"a device call would carry {report['total_MiB']} MiB (tree {report['tree_bytes']} B + "
                         f"carry {report['carry_bytes']} B), over {report['limit_bytes'] / 2**20:.0f} MiB")


def run_call(carry: str = CARRY) -> Dict[str, Any]:
    """The arguments of the device tool's ``run`` call that runs every GPU check (its command, at
    most 2000 characters; the carried folder, a path relative to the repo root)."""
    command = "bash tests/gpu/run.sh" if carry == CARRY else f"GPU_CARRY={carry} bash tests/gpu/run.sh"
    return {"command": command, "carry": [carry], "timeout_s": RUN_TIMEOUT_S}


def stage_call(stage: str = STAGE) -> Dict[str, Any]:
    """The ``run`` call to make first, back to back with ``run_call``'s: it carries the stage folder
    (nvCOMP's wheels, the entropy chunks), which stays on the warm machine for the checks' call."""
    command = "bash tests/gpu/run.sh --stage" if stage == STAGE else f"GPU_STAGE={stage} bash tests/gpu/run.sh --stage"
    return {"command": command, "carry": [stage], "timeout_s": STAGE_TIMEOUT_S}


def triton_call(triton: str = TRITON_STAGE) -> Dict[str, Any]:
    """The second ``run`` call: carries the tritonserver archive and the gpu repository (which stay on
    the warm machine for the run call) and checks the archive against its manifest."""
    command = ("bash tests/gpu/run.sh --stage-triton" if triton == TRITON_STAGE
               else f"GPU_TRITON={triton} bash tests/gpu/run.sh --stage-triton")
    return {"command": command, "carry": [triton], "timeout_s": TRITON_TIMEOUT_S}


def run_calls(carry: str = CARRY, stage: str = STAGE, triton: str = TRITON_STAGE) -> List[Dict[str, Any]]:
    """Every device call of the prepared run, in order, each within ~30 s of the one before: stage
    nvCOMP, stage tritonserver, then the run (checks, then the ensemble TTFT)."""
    checks = run_call(carry)
    if stage != STAGE:
        checks["command"] = f"GPU_STAGE={stage} " + checks["command"]
    if triton != TRITON_STAGE:
        checks["command"] = f"GPU_TRITON={triton} " + checks["command"]
    return [stage_call(stage), triton_call(triton), checks]


def plan_seconds(calls: Sequence[Dict[str, Any]], startup_s: int = STARTUP_S) -> int:
    """The device time the plan may take at most: the start and every call's timeout."""
    return int(startup_s + sum(c["timeout_s"] for c in calls))


def check_plan(calls: Sequence[Dict[str, Any]], budget_s: int = DEVICE_BUDGET_S) -> None:
    total = plan_seconds(calls)
    if total > budget_s:
        raise CarryError(f"the device calls may take {total} s with the start, over the {budget_s} s of device time")
    for c in calls:
        if len(c["command"]) > 2000 or not 1 <= c["timeout_s"] <= 600 or len(c["carry"]) > 8:
            raise CarryError(f"device call {c['command']!r}: over the run tool's limits")


# -- prepare ------------------------------------------------------------------------------------------
def _versions() -> Dict[str, str]:
    import platform

    out = {"python": platform.python_version(), "numpy": np.__version__}
    for name in ("torch", "transformers", "av"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out


def prompt_ids(tokenizer_encode) -> List[int]:
    ids = tokenizer_encode((REPO / PROMPT_SOURCE).read_text(encoding="utf-8"))
    if len(ids) < PROMPT_TOKENS:
        raise CarryError(f"{PROMPT_SOURCE} holds {len(ids)} tokens, fewer than {PROMPT_TOKENS}")
    return list(ids[:PROMPT_TOKENS])


def schemes(card) -> Dict[str, Any]:
    """Label -> scheme (bound to ``card``) of every chunk carried: the rungs, then the stage's entropy ones."""
    from dataclasses import replace

    from kvcodec.format.ladder import parse_rung

    out = {rung: parse_rung(rung, card) for rung in RUNGS}
    for label, (rung, params) in ENTROPY.items():
        base = parse_rung(rung, card)
        out[label] = replace(base, codec_params=dict(base.codec_params, **params))
    return out


def make_chunks(engine, ids: Sequence[int], chunk_auth, threads: int = 2,
                labels: Sequence[str] = RUNGS) -> List[Tuple[str, int, bytes]]:
    """The engine's KV of ``ids`` through ``kvcodec.ingest.ingest`` at every rung (bound to its card)."""
    from kvcodec.format.keys import chunk_keys
    from kvcodec.ingest import ingest
    from kvcodec.store.memory import MemoryStore

    store = MemoryStore(f"gpu-carry-{os.getpid()}")
    out = []
    bound = schemes(engine.card)
    for rung in labels:
        n_chunks, tokens = CHUNKS.get(rung, (1, CHUNK_TOKENS))
        scheme = bound[rung]
        head = list(ids[:n_chunks * tokens])
        ingest(engine, store, head, [scheme], tokens, auth=chunk_auth, threads=threads)
        for i, key in enumerate(chunk_keys(head, engine.model_id, scheme.identity, tokens)):
            data = store.get(key)
            if data is None:
                raise CarryError(f"ingest stored no {rung} chunk {i}")
            store.delete(key)
            out.append((rung, i, data))
    return out


def reference_tokens(engine, ids: Sequence[int], raw_kv: np.ndarray) -> Dict[str, Any]:
    """The CPU engine's greedy tokens: its own prefill, from the ``raw`` chunk's KV, from zero KV."""
    return {"device": "cpu", "max_tokens": MAX_TOKENS,
            "own": list(engine.stream(ids, MAX_TOKENS)),
            "from_raw": list(engine.stream(ids, MAX_TOKENS, past_kv=raw_kv)),
            "from_zero_kv": list(engine.stream(ids, MAX_TOKENS, past_kv=np.zeros_like(raw_kv)))}


def prepare(carry: Path, tokenizer_dir: Optional[Path] = None, log=print, stage: Optional[Path] = None) -> Dict[str, Any]:
    """Make ``carry`` whole: wheel, tiny model, chunks, manifest; and ``stage`` (nvCOMP's wheels, the
    entropy chunks, its manifest). Returns the carry's manifest."""
    from kvcodec.engines.model_files import ModelFiles
    from kvcodec.engines.transformers_engine import TransformersEngine
    from kvcodec.serving.restore import restore

    from . import tiny_model

    carry = Path(carry)
    carry.mkdir(parents=True, exist_ok=True)
    log(f"wheel: {WHEEL_SPEC} (pip download, the device README's line)")
    wheel = fetch_wheel(carry)
    if tokenizer_dir is None:
        from kvcodec.engines import gguf
        from kvcodec.settings import Settings

        tokenizer_dir = gguf.ensure_model(Settings.load().model_cache).path
    work = Path(tempfile.mkdtemp(prefix="kvcodec-gpu-carry-"))
    try:
        log("tiny model: build and pack")
        folder = tiny_model.build(work, Path(tokenizer_dir))
        tiny_model.pack(folder, carry / MODEL_ARCHIVE)
        engine = TransformersEngine(ModelFiles(folder, tiny_model.model_id(folder)), threads=2)
        ids = prompt_ids(engine.tokenize)
        log(f"chunks: {PROMPT_TOKENS} tokens of {PROMPT_SOURCE}, rungs {', '.join(RUNGS)}")
        shutil.rmtree(carry / "chunks", ignore_errors=True)
        chunk_auth = auth()
        entries = write_chunks(carry, make_chunks(engine, ids, chunk_auth), chunk_auth)
        if stage is not None:
            prepare_stage(Path(stage), engine, ids, chunk_auth, log)
        from .gpu_checks import decode_entry

        raw = [e for e in entries if e["rung"] == RAW_RUNG and e["index"] == 0][0]
        log("reference tokens (CPU)")
        reference = reference_tokens(engine, ids, restore(decode_entry(carry, raw, "pyav")))
        manifest = {
            "format": FORMAT, "made": {"by": "tests/gpu/carry.py", **_versions()}, "auth_key_hex": AUTH_HEX,
            "model": {"file": MODEL_ARCHIVE, "bytes": (carry / MODEL_ARCHIVE).stat().st_size,
                      "sha256": sha256(carry / MODEL_ARCHIVE), "model_id": engine.model_id,
                      "folder": tiny_model.FOLDER, "config": tiny_model.CONFIG, "seed": tiny_model.SEED},
            "wheels": [{"file": str(wheel.relative_to(carry)), "bytes": wheel.stat().st_size, "sha256": WHEEL_SHA256}],
            "prompt": {"source": PROMPT_SOURCE, "ids": ids, "chunk_tokens": CHUNK_TOKENS, "max_tokens": MAX_TOKENS},
            "reference": reference,
            "chunks": entries,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tmp = carry / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(carry / MANIFEST)
    return manifest


def prepare_stage(stage: Path, engine, ids: Sequence[int], chunk_auth, log=print) -> Dict[str, Any]:
    """The stage folder: nvCOMP's wheels, the entropy-coded rungs' chunks, its manifest."""
    stage.mkdir(parents=True, exist_ok=True)
    log(f"stage: {', '.join(NVCOMP_SPECS)} (pip download), entropy chunks {', '.join(ENTROPY)}")
    wheels = fetch_nvcomp_wheels(stage)
    shutil.rmtree(stage / "chunks", ignore_errors=True)
    entries = write_chunks(stage, make_chunks(engine, ids, chunk_auth, labels=tuple(ENTROPY)), chunk_auth)
    manifest = {"format": STAGE_FORMAT, "made": {"by": "tests/gpu/carry.py", **_versions()},
                "model_id": engine.model_id,
                "wheels": [{"file": str(w.relative_to(stage)), "bytes": w.stat().st_size, "sha256": sha256(w)}
                           for w in wheels],
                "entropy": {label: {"rung": rung, "codec_params": params} for label, (rung, params) in ENTROPY.items()},
                "chunks": entries}
    tmp = stage / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.replace(stage / MANIFEST)
    return manifest


NAMESPACE_SHIM = "__path__ = __import__('pkgutil').extend_path(__path__, __name__)\n"


def nvidia_namespace(site: Path) -> str:
    """Make ``site``'s ``nvidia`` folder (nvCOMP's wheels, installed there with ``--target``)
    importable beside another ``nvidia`` package on the path: nvCOMP's wheels make ``nvidia`` a
    namespace package (no ``__init__.py``), but where an earlier ``nvidia`` wheel (torch's CUDA
    libraries, on some builds) ships an ``nvidia/__init__.py``, that regular package wins and
    ``nvidia.nvcomp`` is not found. Then ``site``'s folder gets a pkgutil ``__init__.py`` that spans
    every ``nvidia`` folder on the path. Run with ``site`` first on ``PYTHONPATH``; says what it did."""
    check = "import importlib, sys; importlib.import_module('nvidia.nvcomp')"
    env = dict(os.environ)
    if subprocess.run([sys.executable, "-c", check], env=env, capture_output=True).returncode == 0:
        return "nvidia.nvcomp imports"
    init = Path(site) / "nvidia" / "__init__.py"
    if not init.parent.is_dir() or init.exists():
        return f"nvidia.nvcomp does not import and {init} cannot help"
    init.write_text(NAMESPACE_SHIM)
    ok = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True).returncode == 0
    return f"nvidia.nvcomp {'imports' if ok else 'still does not import'} with a pkgutil {init}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.carry", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("prepare", "verify", "sizes", "run-call", "verify-stage", "nvidia-namespace"))
    ap.add_argument("--site", default="/tmp/site", help="nvidia-namespace: where the wheels were installed")
    ap.add_argument("--carry", default=str(REPO / CARRY))
    ap.add_argument("--stage", default=str(REPO / STAGE), help="the folder the stage call carries")
    ap.add_argument("--triton", default=str(REPO / TRITON_STAGE), help="the folder the triton stage call carries")
    args = ap.parse_args(argv)
    carry, stage = Path(args.carry), Path(args.stage)
    try:
        if args.action == "prepare":
            prepare(carry, stage=stage)
        if args.action in ("prepare", "verify"):
            for folder, fmt in ((carry, FORMAT), (stage, STAGE_FORMAT)):
                problems = verify(folder, load_manifest(folder, fmt))
                if problems:
                    raise CarryError(f"{folder.name}: manifest and files differ:\n  " + "\n  ".join(problems))
                print(f"{folder.name}: {len(load_manifest(folder, fmt)['chunks'])} chunks decode (on the CPU) "
                      f"to their planes digests")
        if args.action == "verify-stage":  # there, on the GPU machine: the files only (no decoder there)
            problems = verify(stage, load_manifest(stage, STAGE_FORMAT), decoder=None)
            if problems:
                raise CarryError(f"{stage.name}: manifest and files differ:\n  " + "\n  ".join(problems))
            print(f"{stage.name}: staged, {len(load_manifest(stage, STAGE_FORMAT)['chunks'])} chunks and the wheels "
                  f"as the manifest says")
        if args.action in ("prepare", "sizes"):
            calls = ((stage, "stage call"), (carry, "checks call"))
            if (Path(args.triton) / MANIFEST).is_file():
                calls = ((stage, "stage call"), (Path(args.triton), "triton stage call"), (carry, "checks call"))
            for folder, what in calls:
                report = sizes(REPO, folder)
                print(f"sizes ({what}):", json.dumps(report))
                check_sizes(report)
        if args.action == "nvidia-namespace":
            print(nvidia_namespace(Path(args.site)))
        if args.action == "run-call":
            calls = run_calls(os.path.relpath(carry, REPO), os.path.relpath(stage, REPO),
                              os.path.relpath(Path(args.triton), REPO))
            check_plan(calls)
            for call in calls:
                print(json.dumps(call))
            print(f"device time: at most {plan_seconds(calls)} s of {DEVICE_BUDGET_S} s (start ~{STARTUP_S} s "
                  f"+ the timeouts)")
    except CarryError as exc:
        print(f"carry: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
