"""A second model end to end (``--model DIR``): a small random Llama of another KV geometry
(4 layers, 2 KV heads, head_dim 32; ``tests.other_model``), its codec profile fitted by
``kvcodec profile fit --model``, ingested, served by a real tritonserver, reused over gRPC and HTTP.
Raw reuse gives the tokens of the model's own prefill; the profile rungs (kvtc-w, video) restore
through the model's cached profile inside the server. Over the transformers engine here, over vLLM in
``.venv-vllm`` (``-m vllm``)."""
from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from kvcodec.engines import model_card
from kvcodec.engines.model_files import files_for
from kvcodec.engines.tokenizer import Tokenizer
from kvcodec.format import container
from kvcodec.format.auth import load_auth
from kvcodec.settings import Settings
from kvcodec_client import KVCodecClient
from kvcodec_tools.ports import free_ports
from kvcodec_tools.tritonserver import Ports, TritonServer
from tests.other_model import write_model

from .conftest import KVCODEC, REPO, chunk_path, cli, text_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

QUESTION = "\n\n# Question: what does this module do?\n# Answer:"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def other_model(tmp_path_factory, settings) -> Path:
    """The model folder (SmolLM2's tokenizer files from the session's converted model)."""
    return write_model(tmp_path_factory.mktemp("other-model") / "tiny-llama",
                       Path(settings.model_cache) / "smollm2-135m-instruct")


def _model_settings(home: Path, folder: Path, **more) -> Settings:
    return Settings.load({"home": str(home), "model_cache": str(home / "models"), "model": str(folder),
                          "threads": "1", "adaptive": "0", **more}, env={})


def _ingest(msettings, tmp_path: Path, text: str, codec: str, *engine: str) -> dict:
    path = tmp_path / "context.txt"
    path.write_text(text)
    return json.loads(cli(msettings, "ingest", "--model", str(msettings.model), *engine, "--text-file", str(path),
                          "--codec", codec, "--json", "--quiet").stdout)


def _start(msettings):
    http, grpc, metrics = free_ports(3)
    srv = TritonServer(REPO / "model_repository", msettings, Ports(http, grpc, metrics))
    srv.start(timeout_s=600)
    return srv


@pytest.fixture(scope="module")
def served(tmp_path_factory, other_model):
    """The model's own home: its profile fitted, one text ingested at raw and kvtc-w, a server on it.
    Yields (settings, prompt ids, server)."""
    home = tmp_path_factory.mktemp("other-home")
    msettings = _model_settings(home, other_model, ladder="raw,kvtc-w,video")
    proc = subprocess.run([KVCODEC, "profile", "fit", "--model", str(other_model), "--home", str(home),
                           "--model-cache", str(msettings.model_cache), "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fit = json.loads(proc.stdout)
    assert fit["weighted"] and fit["profile"].startswith(str(home / "models" / "profiles")), fit
    tok = Tokenizer(files_for(msettings))
    text = text_of(tok, "textwrap.py", 540)
    report = _ingest(msettings, home, text, "raw,kvtc-w,video")
    assert report["chunks"] == 2 and report["written"] == 6, report
    srv = _start(msettings)
    try:
        yield msettings, tok.encode(text + QUESTION), srv
    finally:
        srv.stop()


def _client(srv, protocol: str) -> KVCodecClient:
    return KVCodecClient(srv.grpc_url if protocol == "grpc" else srv.http_url, protocol)


def test_the_chunks_are_the_models_own(served, settings):
    msettings, ids, _ = served
    card = model_card(msettings)
    assert card.model_id != model_card(settings).model_id and card.geometry(256).shape == (4, 2, 2, 256, 32)
    chunk = container.parse(chunk_path(msettings, ids, 0, "raw").read_bytes(), load_auth(msettings.key_file))
    assert chunk.header["model_id"] == card.model_id and chunk.header["layout_params"] == {"dtype": "float32"}
    # the same text under the embedded model's card is not stored: two models never mix
    assert not chunk_path(replace(msettings, model=None, model_cache=settings.model_cache), ids, 0, "raw").exists()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_raw_reuse_gives_the_models_own_prefill_tokens(served, protocol):
    _, ids, srv = served
    client = _client(srv, protocol)
    own = client.generate(ids, MAX_TOKENS, reuse=False)
    assert own.reused_tokens == 0 and len(own.tokens) == MAX_TOKENS
    result = client.generate(ids, MAX_TOKENS, reuse=True)
    assert result.reused_tokens == 512 and result.stats["scheme"] == "raw", result.stats
    assert result.tokens == own.tokens and result.text == own.text


@pytest.mark.parametrize("rung", ["kvtc-w", "video"])
def test_a_profile_rung_restores_through_the_models_cached_profile(served, rung):
    """The random model's tokens are too sensitive to compare after a lossy rung; what is checked is
    that the server decodes and restores this geometry through the model's profile (a failure
    would be a miss: 0 tokens reused)."""
    _, ids, srv = served
    result = _client(srv, "grpc").generate(ids, MAX_TOKENS, reuse=True, codecs=rung)
    assert result.reused_tokens == 512 and result.stats["scheme"] == rung, result.stats
    assert len(result.tokens) == MAX_TOKENS


def test_a_replica_with_the_model_at_another_path_shares_chunks_and_profile(served, tmp_path):
    """A second server on the same store and model cache, its model mounted at another path under
    another name (the files linked): the model's identity is what it is, not where it is, so the
    second server reuses the first one's chunks, raw and through the shared fitted profile."""
    import os
    import shutil

    msettings, ids, srv = served
    mounted = Path(shutil.copytree(msettings.model, tmp_path / "mnt" / "llm", copy_function=os.symlink))
    # a home of its own (logs, costs); the store, key and model cache (fitted profiles) shared
    replica = replace(msettings, model=mounted.resolve(), home=tmp_path / "replica-home")
    assert model_card(replica).model_id == model_card(msettings).model_id
    own = _client(srv, "grpc").generate(ids, MAX_TOKENS, reuse=False)
    second = _start(replica)
    try:
        client = _client(second, "grpc")
        raw = client.generate(ids, MAX_TOKENS, reuse=True, codecs="raw")
        assert raw.reused_tokens == 512 and raw.tokens == own.tokens, raw.stats
        lossy = client.generate(ids, MAX_TOKENS, reuse=True, codecs="kvtc-w")
        assert lossy.reused_tokens == 512 and lossy.stats["scheme"] == "kvtc-w", lossy.stats
    finally:
        second.stop()


@pytest.mark.vllm
def test_vllm_raw_reuse_gives_the_models_own_prefill_tokens(other_model, tmp_path):
    """The same model in vLLM's paged cache (its own identity, ``/vllm-float32``): ingest, serve,
    raw reuse through the KV connector equals vLLM's own prefill."""
    pytest.importorskip("vllm", reason="vLLM is tested in its own venv: make test-vllm")
    # vLLM's own prefix cache off: the reuse after the prefill must come through the connector
    msettings = _model_settings(tmp_path, other_model, ladder="raw", engine="vllm", writeback="off", prefix_cache="0")
    tok = Tokenizer(files_for(msettings))
    text = text_of(tok, "textwrap.py", 540)
    report = _ingest(msettings, tmp_path, text, "raw", "--engine", "vllm")
    assert report["chunks"] == 2 and report["written"] == 2, report
    ids = tok.encode(text + QUESTION)
    header = container.parse(chunk_path(msettings, ids, 0, "raw").read_bytes(), load_auth(msettings.key_file)).header
    assert header["model_id"].endswith("/vllm-float32") and header["model_id"].startswith("llama@hf-sha256:")
    srv = _start(msettings)
    try:
        client = _client(srv, "grpc")
        own = client.generate(ids, MAX_TOKENS, reuse=False)
        result = client.generate(ids, MAX_TOKENS, reuse=True)
    finally:
        srv.stop()
    assert own.reused_tokens == 0 and len(own.tokens) == MAX_TOKENS
    assert result.reused_tokens == 512 and result.stats["scheme"] == "raw", result.stats
    assert result.stats["engine"]["load_s"] > 0  # the connector wrote the blocks
    assert result.tokens == own.tokens and result.text == own.text
