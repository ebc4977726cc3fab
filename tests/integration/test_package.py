"""The package as a deployer installs it: the wheel built from this checkout, installed with its
``server`` extra into a fresh venv (versions held to requirements.txt's tested pins), then from that
install alone (not the checkout): ``kvcodec --version`` and ``--help``, an ingest, a real
tritonserver started by ``kvcodec serve`` on the repository the wheel carries, and a request that
reuses the ingested chunks with the tokens of the model's own prefill."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import REPO, free_ports, text_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

QUESTION = "\n\n# Question: what does this module do?\n# Answer:"


def _run(*cmd, timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{cmd[:3]} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the built wheel and its ``server`` extra; its ``bin``."""
    root = tmp_path_factory.mktemp("package")
    # built from a copy of the checkout: setuptools leaves a build/ folder beside the sources
    source = root / "source"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".cache", "build", "dist", "__pycache__", "*.egg-info"))
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", source, "-w", root / "dist")
    (wheel,) = (root / "dist").glob("kvcodec-*.whl")
    # pip takes no extras in a constraints file: the tested pins without them
    pins = re.sub(r"\[[^\]]*\]", "", (REPO / "requirements.txt").read_text())
    (root / "constraints.txt").write_text(pins)
    base = getattr(sys, "_base_executable", sys.executable)
    _run(base, "-m", "venv", root / "venv")
    bin_ = root / "venv" / "bin"
    _run(bin_ / "pip", "install", "-q", "-c", root / "constraints.txt", f"{wheel}[server]", timeout=1500)
    return bin_


def test_the_installed_package_ingests_serves_and_reuses(installed, tokenizer, tmp_path):
    bin_ = installed
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCODEC_", "PYTHONPATH", "VIRTUAL_ENV"))}
    env["PATH"] = f"{bin_}{os.pathsep}{env.get('PATH', '')}"
    where = _run(bin_ / "python", "-c", "import kvcodec, kvcodec_tools.cli as c; print(kvcodec.__file__); "
                 "print(c.DEFAULT_REPOSITORY)", env=env, cwd=tmp_path).stdout.split()
    assert all(str(bin_.parent) in p for p in where), where  # the install, not the checkout
    from kvcodec import __version__

    assert _run(bin_ / "kvcodec", "--version", env=env).stdout.strip() == f"kvcodec {__version__}"
    assert "serve" in _run(bin_ / "kvcodec", "--help", env=env).stdout

    home, models = tmp_path / "home", REPO / ".cache" / "models"  # the converted model, shared
    common = ["--home", home, "--model-cache", models, "--threads", "1"]
    text = text_of(tokenizer, "calendar.py", 540)
    (tmp_path / "context.txt").write_text(text)
    report = json.loads(_run(bin_ / "kvcodec", "ingest", *common, "--text-file", tmp_path / "context.txt",
                             "--codec", "raw", "--json", "--quiet", env=env, cwd=tmp_path).stdout)
    assert report["chunks"] == 2, report
    http, grpc, metrics = free_ports(3)
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen([str(bin_ / "kvcodec"), "serve", *map(str, common), "--ladder", "raw",
                               "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not _ready(http):
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        ask = [bin_ / "kvcodec", "generate", *common, "--url", f"127.0.0.1:{grpc}", "--text-file",
               tmp_path / "question.txt", "--max-tokens", "8", "--json"]
        (tmp_path / "question.txt").write_text(text + QUESTION)
        reuse = json.loads(_run(*ask, env=env, cwd=tmp_path).stdout)
        prefill = json.loads(_run(*ask, "--no-reuse", env=env, cwd=tmp_path).stdout)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(120)
        log.close()
    assert reuse["reused_tokens"] == 512 and prefill["reused_tokens"] == 0
    assert reuse["tokens"] == prefill["tokens"]


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
