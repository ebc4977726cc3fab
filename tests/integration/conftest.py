"""A real tritonserver on our model repository, shared by the integration tests of a session.

The converted model is cached in the repository's ``.cache/models`` (converted once, ~1 min);
the store and logs live in a temporary folder. Texts come from the Python standard library.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from kvcodec.engines import model_card
from kvcodec.engines.gguf import ensure_model
from kvcodec.engines.tokenizer import Tokenizer
from kvcodec.format.codecs import get_scheme
from kvcodec.format.keys import chunk_keys
from kvcodec.settings import Settings
from kvcodec_tools.ports import free_ports  # noqa: F401  (test_serve imports it from here)
from kvcodec_tools.texts import cut_to_tokens, stdlib_text
from kvcodec_tools.tritonserver import Ports, TritonServer

REPO = Path(__file__).resolve().parents[2]
KVCODEC = str(Path(sys.executable).parent / "kvcodec")
TEST_LADDER = "lossless8,video,int8-zstd,raw,nlevel-zstd,transform-zstd,cachegen"




@pytest.fixture(scope="session")
def settings(tmp_path_factory) -> Settings:
    home = tmp_path_factory.mktemp("kvcodec-home")
    # The tests ingest every codec, lossless8 and the baselines too: the server's ladder names them all.
    s = Settings.load({"home": str(home), "model_cache": str(REPO / ".cache" / "models"), "threads": "1",
                       "ladder": TEST_LADDER}, env={})
    ensure_model(s.model_cache)
    return s


@pytest.fixture(scope="session")
def tokenizer(settings) -> Tokenizer:
    return Tokenizer(ensure_model(settings.model_cache))


@pytest.fixture(scope="session")
def server(settings):
    http, grpc, metrics = free_ports(3)
    srv = TritonServer(REPO / "model_repository", settings, Ports(http, grpc, metrics))
    srv.start(timeout_s=300)
    pid = srv.pid
    yield srv
    srv.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # nothing of the server's process group is left


def cli(settings, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the ``kvcodec`` console script with this session's settings."""
    common = ["--home", str(settings.home), "--store", settings.store, "--model-cache", str(settings.model_cache),
              "--threads", "1"]
    proc = subprocess.run([KVCODEC, args[0], *common, *args[1:]], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"kvcodec {args[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc


def chunk_path(settings, ids, index, codec="lossless8") -> Path:
    """Where the file store holds chunk ``index`` of ``ids`` at ``codec`` for the settings' engine."""
    card = model_card(settings)
    key = chunk_keys(ids, card.model_id, get_scheme(codec).for_card(card).identity, settings.chunk_tokens)[index]
    return Path(settings.store.removeprefix("file://")) / f"{key}.kvc"


@contextlib.contextmanager
def replaced(path: Path, data: bytes):
    """The stored chunk at ``path`` holds ``data`` inside the block, its own bytes after it."""
    original = path.read_bytes()
    path.write_bytes(data)
    try:
        yield
    finally:
        path.write_bytes(original)


def text_of(tokenizer, source: str, tokens: int) -> str:
    """Whole lines of a standard-library module, just over ``tokens`` tokens (a multiple of 5 lines)."""
    return cut_to_tokens(tokenizer, stdlib_text(source), tokens, step=5)


def ingest_text(settings, tmp_path: Path, text: str, codec: str = "lossless8") -> dict:
    path = tmp_path / f"context-{codec}.txt"
    path.write_text(text)
    return json.loads(cli(settings, "ingest", "--text-file", str(path), "--codec", codec, "--json", "--quiet").stdout)


def ingested_home(settings, tokenizer, home: Path, source: str = "calendar.py", tokens: int = 800,
                  codec: str = "int8-zstd"):
    """Settings of a home of its own (chunk key, file store, costs) whose ladder is ``codec``, with
    ``tokens`` tokens of ``source`` ingested at it; and that text."""
    local = replace(settings, home=home, store=f"file://{home / 'store'}", key_file=home / "chunk.key",
                    ladder=(codec,), adaptive=False)
    text = text_of(tokenizer, source, tokens)
    (home / "context.txt").write_text(text)
    cli(local, "ingest", "--text-file", str(home / "context.txt"), "--codec", codec, "--json", "--quiet")
    return local, text


def metric_values(url: str, prefix: str) -> dict:
    """The samples of a Prometheus endpoint whose name (with labels) starts with ``prefix``."""
    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in lines)
            if name.startswith(prefix)}


def post(server, endpoint: str, body: dict):
    """(HTTP status, the JSON answer, or the server-sent events' JSON objects for generate_stream)."""
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/kvcodec/{endpoint}",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode() or "{}")
    if endpoint == "generate":
        return status, json.loads(raw)
    return status, [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:")]


def key_file(path: Path, secret: bytes) -> Path:
    """A chunk key file holding ``secret`` (hex, mode 0600, as ``format.auth`` requires)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(secret.hex() + "\n")
    os.chmod(path, 0o600)
    return path


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a ``kvcodec serve`` that is still running, and the process groups it leads
    (tritonserver leads one of its own)."""
    if proc.poll() is not None:
        return
    from kvcodec_tools.tritonserver import children

    for child in children(proc.pid):
        try:
            os.killpg(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def start_serve(settings, home: Path, *flags: str) -> "tuple[subprocess.Popen, str]":
    """``kvcodec serve`` on ``home`` (a file store there, the session's model cache) with ``flags``
    (ports, ...), in a session of its own; (the process, its ready line, or the last line it printed
    if it did not get ready within 300 s)."""
    import time

    proc = subprocess.Popen(
        [KVCODEC, "serve", "--home", str(home), "--model-cache", str(settings.model_cache),
         "--store", f"file://{home}/store", "--threads", "1", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    line, deadline = "", time.monotonic() + 300
    while "ready" not in line and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
    return proc, line
