"""The third staged carry (``.gpu-carry-triton/``): a tritonserver for the GPU machine, made here.

The lent machine has no registry and no tritonserver. The ``nvidia-pytriton==0.7.0`` wheel in
``.venv`` holds one (server 2.51.0, FINDINGS): ``prepare`` packs the binary, the python backend,
the CPython 3.12 stub and the shared libraries that ``ldd`` names from ``nvidia_pytriton.libs/``
into ``tritonserver.tar.xz`` (members ``pytriton/tritonserver/...`` and ``nvidia_pytriton.libs/...``:
the wheel's own layout, so ``KVCODEC_TRITON_ROOT=<unpacked>/pytriton/tritonserver`` makes
``kvcodec_tools.tritonserver`` use it), with a manifest (file digest, members); and
``repository-gpu/``, the gpu variant of the model repository (``kvcodec_tools.repository``). No client wheels:
the ensemble TTFT run drives the server with ``kvcodec_client``'s HTTP protocol (the standard
library's ``http.client`` against Triton's ``generate_stream``), which needs nothing carried.

``verify`` checks the archive against the manifest; ``unpack`` puts it under a folder and returns
the root to name in ``KVCODEC_TRITON_ROOT``. Sizes and the call plan are ``tests.gpu.carry``'s.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .carry import MANIFEST, REPO, CarryError, sha256

TRITON_STAGE = ".gpu-carry-triton"
TRITON_FORMAT = "kvcodec-gpu-triton/1"
ARCHIVE = "tritonserver.tar.xz"
STUB_PYTHON = "3.12"  # the GPU machine's interpreter
ROOT_IN_ARCHIVE = "pytriton/tritonserver"
LIBS_IN_ARCHIVE = "nvidia_pytriton.libs"
REPOSITORY = "repository-gpu"  # the gpu variant, rendered beside the archive


def wheel_root(python: str = str(REPO / ".venv" / "bin" / "python")) -> Path:
    """The installed wheel's ``pytriton/tritonserver`` folder (from the interpreter that has it)."""
    out = subprocess.run([python, "-c", "import pytriton, pathlib; print(pathlib.Path(pytriton.__file__).parent)"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise CarryError(f"nvidia-pytriton is not importable from {python} (make setup installs it)")
    return Path(out.stdout.strip()) / "tritonserver"


def needed_libs(binaries: Sequence[Path], libs_dir: Path) -> List[Path]:
    """The libraries in ``libs_dir`` that ``ldd`` names for ``binaries`` (ldd lists transitive ones)."""
    env = {"LD_LIBRARY_PATH": str(libs_dir), "PATH": "/usr/bin:/bin"}
    found = set()
    for binary in binaries:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, env=env).stdout
        for line in out.splitlines():
            parts = line.split("=>")
            if len(parts) == 2:
                path = parts[1].strip().split(" (")[0].strip()
                if path and Path(path).parent.resolve() == libs_dir.resolve():
                    found.add(Path(path).resolve())
    return sorted(found)


def members(root: Path) -> Dict[str, Path]:
    """Archive name -> file: the binary, the python backend, the 3.12 stub, the libraries."""
    libs_dir = root.parent.parent / LIBS_IN_ARCHIVE
    binary = root / "bin" / "tritonserver"
    backend = sorted((root / "backends" / "python").glob("*.*"))
    stub = root / "python_backend_stubs" / STUB_PYTHON / "triton_python_backend_stub"
    for path in [binary, stub] + backend:
        if not path.is_file():
            raise CarryError(f"{path} is missing from the nvidia-pytriton wheel")
    out = {f"{ROOT_IN_ARCHIVE}/{p.relative_to(root)}": p for p in [binary, stub] + backend}
    for lib in needed_libs([binary, stub] + [p for p in backend if p.suffix == ".so"], libs_dir):
        out[f"{LIBS_IN_ARCHIVE}/{lib.name}"] = lib
    return out


def render_repository(stage: Path) -> Path:
    """``stage``/repository-gpu: the gpu variant of ``model_repository/`` (rendered here: it needs
    tritonclient's protobufs, which the GPU machine lacks)."""
    from kvcodec_tools.repository import render

    return render(REPO / "model_repository", Path(stage) / REPOSITORY, "gpu")


def prepare(stage: Path, root: Optional[Path] = None, log=print) -> Dict[str, Any]:
    """``stage``/tritonserver.tar.xz and its manifest; kept when the manifest matches the files."""
    stage = Path(stage)
    stage.mkdir(parents=True, exist_ok=True)
    render_repository(stage)
    files = members(root or wheel_root())
    listing = {name: path.stat().st_size for name, path in files.items()}
    archive = stage / ARCHIVE
    try:
        old = load(stage)
        if old["members"] == listing and not verify(stage, old):
            log(f"{stage.name}: {ARCHIVE} is up to date")
            return old
    except CarryError:
        pass
    log(f"{stage.name}: packing {len(files)} files, {sum(listing.values()) / 2**20:.1f} MiB, as tar.xz")
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        for name in sorted(files):
            info = tar.gettarinfo(str(files[name]), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with open(files[name], "rb") as f:
                tar.addfile(info, f)
    tmp.replace(archive)
    manifest = {"format": TRITON_FORMAT, "made": {"by": "tests/gpu/triton_carry.py", "server": "nvidia-pytriton 0.7.0"},
                "archive": {"file": ARCHIVE, "bytes": archive.stat().st_size, "sha256": sha256(archive)},
                "stub_python": STUB_PYTHON, "root": ROOT_IN_ARCHIVE, "members": listing}
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def load(stage: Path) -> Dict[str, Any]:
    path = Path(stage) / MANIFEST
    if not path.is_file():
        raise CarryError(f"no {path} (bash tests/gpu/run.sh --dry-run makes it)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != TRITON_FORMAT:
        raise CarryError(f"{path}: format {manifest.get('format')!r}, expected {TRITON_FORMAT}")
    return manifest


def verify(stage: Path, manifest: Dict[str, Any]) -> List[str]:
    """What differs between the manifest and the archive ([] when they agree)."""
    archive = Path(stage) / manifest["archive"]["file"]
    if not archive.is_file():
        return [f"{archive.name} is missing"]
    if archive.stat().st_size != manifest["archive"]["bytes"] or sha256(archive) != manifest["archive"]["sha256"]:
        return [f"{archive.name}: size or SHA-256 differs from the manifest"]
    return []


def unpack(stage: Path, dest: Path) -> Path:
    """Unpack the archive under ``dest``; returns the root for ``KVCODEC_TRITON_ROOT``."""
    manifest = load(stage)
    problems = verify(stage, manifest)
    if problems:
        raise CarryError("; ".join(problems))
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(Path(stage) / manifest["archive"]["file"], "r:xz") as tar:
        names = tar.getnames()
        if any(n.startswith("/") or ".." in n.split("/") for n in names):
            raise CarryError(f"{manifest['archive']['file']}: a member leaves the folder")
        tar.extractall(dest, filter="data") if sys.version_info >= (3, 12) else tar.extractall(dest)
    for name in names:  # tar's data filter keeps the owner's execute bits; make sure of the binaries
        if "/bin/" in name or name.endswith("_stub"):
            (dest / name).chmod(0o755)
    return dest / manifest["root"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu.triton_carry", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("prepare", "verify"))
    ap.add_argument("--stage", default=str(REPO / TRITON_STAGE))
    args = ap.parse_args(argv)
    stage = Path(args.stage)
    try:
        manifest = prepare(stage) if args.action == "prepare" else load(stage)
        problems = verify(stage, manifest)
        if problems:
            raise CarryError(f"{stage.name}: " + "; ".join(problems))
        print(f"{stage.name}: {ARCHIVE} {manifest['archive']['bytes'] / 2**20:.1f} MiB "
              f"({len(manifest['members'])} files, {sum(manifest['members'].values()) / 2**20:.1f} MiB unpacked) "
              f"as the manifest says")
    except CarryError as exc:
        print(f"triton carry: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
