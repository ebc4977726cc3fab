"""The servers of ``kvcodec bench peers`` (``kvcodec_tools.peers``) that are not a plain ``vllm
serve``: the Triton ensemble behind ``VllmServe``'s calls (``EnsembleServer``, ``ensemble_server``),
LMCache's ``lmcache server`` with the store as its L2 (``lmcache_server``), and what they share (the
venvs, the adaptive rows' ladder, a chunk key per run, the environment a child inherits).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

from .peers_stores import PeersStore

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
LMCACHE_VENV = REPO / ".venv-lmcache"
# the adaptive rows' ladder: stored at every rung by write-back, chosen per chunk over the measured link
ADAPTIVE_LADDER = "kvtc-w,int8-zstd,raw"
# the vLLM OpenAI servers answer the gate's top-k log-probabilities
LOGPROBS_ARGS = ["--max-logprobs", "5000"]


def one_port() -> int:
    from kvcodec_tools.ports import free_ports

    return free_ports(1)[0]


class EnsembleServer:
    """The Triton ensemble (``kvcodec serve`` on the vLLM engine) behind ``VllmServe``'s calls, over
    gRPC streaming (``KVCodecClient``): ``cached_tokens`` is the response's ``reused_tokens``;
    ``http_url``: its HTTP endpoint (the workload bench sends to ``generate_stream`` there)."""

    def __init__(self, server) -> None:
        from kvcodec_client.client import KVCodecClient

        self.server, self.pid = server, server.pid
        self.http_url = f"http://{server.http_url}"
        self.client = KVCodecClient(server.grpc_url, "grpc")

    def completion(self, prompt: str, max_tokens: int) -> dict:
        return self.streamed(prompt, max_tokens)

    def metrics_text(self) -> str:
        """Triton's ``/metrics`` (the kvcodec families are brought up to date at each request's end)."""
        import urllib.request

        with urllib.request.urlopen(f"http://{self.server.host}:{self.server.ports.metrics}/metrics", timeout=10) as r:
            return r.read().decode()

    def streamed(self, prompt: str, max_tokens: int) -> dict:
        r = self.client.generate(prompt, max_tokens)
        return {"ttft_s": r.ttft_s, "text": r.text, "cached_tokens": r.reused_tokens, "elapsed_s": r.total_s,
                "local_tokens": (r.stats.get("engine") or {}).get("local_tokens")}


@contextlib.contextmanager
def ensemble_server(root: Path, store: PeersStore, rung: Optional[str], prefix_cache: bool) -> Iterator[EnsembleServer]:
    """A real tritonserver on the model repository, vLLM engine, the store behind the link; one
    home across the populating and measuring servers (its cost model), as ``kvcodec-vllm-serve``."""
    from kvcodec.settings import Settings
    from kvcodec_tools.cli import DEFAULT_REPOSITORY
    from kvcodec_tools.ports import free_ports
    from kvcodec_tools.tritonserver import Ports, TritonServer

    key_file = root.parent / "chunk.key"
    if not key_file.exists():
        key_file.write_text(run_chunk_key(root.parent) + "\n")
        key_file.chmod(0o600)
    ladder = rung or ADAPTIVE_LADDER
    settings = Settings.load({"home": str(root.parent / "home"), "store": store.url, "engine": "vllm",
                              "model_cache": str(REPO / ".cache" / "models"), "threads": "1", "ladder": ladder,
                              "writeback": ladder, "adaptive": "0" if rung else "1", "key_file": str(key_file),
                              "writeback_pending": "4096", "prefix_cache": "1" if prefix_cache else "0"}, env={})
    server = TritonServer(DEFAULT_REPOSITORY, settings, Ports(*free_ports(3)), log_path=root / "tritonserver.log")
    with patched_environ(store.env):  # the store's variables (S3's endpoint and keys) for the server to inherit
        server.start(timeout_s=600)
    try:
        yield EnsembleServer(server)
    finally:
        server.stop()


@contextlib.contextmanager
def patched_environ(values: Dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_chunk_key(root: Path) -> str:
    path = root / "chunk.key.hex"
    if not path.exists():
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip()


@contextlib.contextmanager
def lmcache_server(root: Path, store: PeersStore, fp8: bool) -> Iterator[Tuple[int, int]]:
    """``lmcache server`` with the store as its L2 (``resp`` for Redis, as measured to work on this CPU
    build, ``../shared/FINDINGS.md``; ``s3``); (its port, its pid)."""
    from kvcodec_tools.procs import Process

    port, http_port, prom_port = one_port(), one_port(), one_port()
    adapter = dict(store.adapter)
    if fp8:
        adapter["serde"] = {"type": "fp8"}
    cmd = [str(LMCACHE_VENV / "bin" / "lmcache"), "server", "--port", str(port), "--http-port", str(http_port),
           "--prometheus-port", str(prom_port), "--l1-size-gb", "1", "--l1-init-size-gb", "1",
           "--eviction-policy", "LRU", "--chunk-size", "256", "--supported-transfer-mode", "auto",
           "--l2-adapter", json.dumps(adapter)]
    log = root / f"lmcache-server-{port}.log"
    proc = Process("lmcache-server", cmd, log, append=False, env=dict(os.environ)).start()
    try:
        proc.wait_ready(lambda: _listening(port), 120, logs=[log])
        yield port, proc.pid
    finally:
        proc.stop()


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
