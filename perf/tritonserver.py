"""Start and stop a real Triton Inference Server (the ``nvidia-pytriton`` wheel's binary) on
our model repository, with the python backend.

``TritonServer(repo, settings, ports).start()`` prepares a backend folder (the wheel's python
backend plus the stub for this Python), sets ``LD_LIBRARY_PATH`` (the wheel's bundled libraries
and this interpreter's ``libpython``), puts this venv's ``bin/`` first on ``PATH`` (the stub finds
its interpreter through it), passes the ``KVCODEC_*`` settings through the environment, waits
until the server is ready and every model is loaded, and raises with the log's tail if it is not.
``stop()`` sends SIGTERM to the server, then SIGKILL to its process group after a grace period.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvcodec.errors import Unsupported
from kvcodec.settings import Settings

MODELS = ("kvcodec", "kv_fetch", "kv_decode", "kv_restore", "llm")


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def _pytriton_root() -> Path:
    try:
        import pytriton
    except ImportError:
        raise Unsupported("nvidia-pytriton is not installed (it carries the tritonserver binary)") from None
    root = Path(pytriton.__file__).parent / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise Unsupported(f"no tritonserver binary under {root}")
    return root


def prepare_backends(target: Path) -> Path:
    """A backend folder holding the python backend and the stub for this interpreter."""
    root = _pytriton_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise Unsupported(f"no python backend stub for Python {version} in nvidia-pytriton")
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in list((root / "backends" / "python").glob("*.*")) + [stub]:
        dst = python_dir / src.name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size:
            shutil.copy2(src, dst)
    return target


class TritonServer:
    def __init__(self, repo: Path, settings: Settings, ports: Ports = Ports(), log_path: Optional[Path] = None,
                 host: str = "127.0.0.1") -> None:
        self.repo = Path(repo).resolve()
        self.settings = settings
        self.ports = ports
        self.host = host
        self.log_path = log_path or settings.home / "logs" / "tritonserver.log"
        self.proc: Optional[subprocess.Popen] = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports.grpc}"

    def command(self) -> list:
        root = _pytriton_root()
        backends = prepare_backends(self.settings.home / "triton-backends")
        return [
            str(root / "bin" / "tritonserver"),
            f"--model-repository={self.repo}",
            f"--backend-directory={backends}",
            f"--http-address={self.host}", f"--http-port={self.ports.http}",
            f"--grpc-address={self.host}", f"--grpc-port={self.ports.grpc}",
            f"--metrics-address={self.host}", f"--metrics-port={self.ports.metrics}",
            "--allow-metrics=true", "--allow-gpu-metrics=false",
            "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0",
            "--exit-timeout-secs=15", "--log-verbose=0",
        ]

    def environment(self) -> dict:
        root = _pytriton_root()
        env = dict(os.environ)
        libs = [str(root.parent.parent / "nvidia_pytriton.libs"), str(sysconfig.get_config_var("LIBDIR"))]
        if env.get("LD_LIBRARY_PATH"):
            libs.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(libs)
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.settings.environ())
        return env

    def start(self, timeout_s: float = 180.0) -> "TritonServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                if r.status != 200:
                    return False
            for model in MODELS:
                with urllib.request.urlopen(f"http://{self.http_url}/v2/models/{model}/ready", timeout=2) as r:
                    if r.status != 200:
                        return False
            return True
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def terminate(self) -> None:
        """Ask the server to stop (SIGTERM) without waiting: safe inside a signal handler."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self) -> int:
        return self.proc.wait() if self.proc else 0

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server (it stops its model stubs), SIGKILL to its process group after
        ``grace_s``, and SIGKILL to any straggler of the group once it has exited."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
