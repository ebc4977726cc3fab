"""vLLM's own prefix cache as the first tier in the ensemble (setting ``prefix_cache``, on by
default): a stored prefix is loaded from the store the first time; asked again, vLLM holds it and
the connector loads nothing (``stats.engine.local_tokens``), the answer the same; ``reused_tokens``
counts both tiers. Ingest still computes and saves every chunk of a prompt vLLM holds."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is tested in its own venv: make test-vllm")

from kvcodec.settings import Settings  # noqa: E402
from kvcodec_client import KVCodecClient  # noqa: E402
from kvcodec_tools.ports import free_ports  # noqa: E402
from kvcodec_tools.tritonserver import Ports, TritonServer  # noqa: E402

from .conftest import REPO, cli, text_of  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(1200)]
QUESTION = "\n\n# Question: what does this module do?\n# Answer:"


def test_a_prefix_vllm_holds_is_not_loaded_again(tmp_path, tokenizer):
    settings = Settings.load({"home": str(tmp_path / "home"), "model_cache": str(REPO / ".cache" / "models"),
                              "threads": "1", "ladder": "raw", "engine": "vllm", "writeback": "off",
                              "adaptive": "0"}, env={})
    assert settings.prefix_cache  # the default
    text = text_of(tokenizer, "textwrap.py", 540)
    path = tmp_path / "context.txt"
    path.write_text(text)
    report = json.loads(cli(settings, "ingest", "--engine", "vllm", "--text-file", str(path), "--codec", "raw",
                            "--json", "--quiet").stdout)
    assert report["chunks"] == 2 and report["written"] == 2, report
    ids = tokenizer.encode(text + QUESTION)
    with TritonServer(REPO / "model_repository", settings, Ports(*free_ports(3))) as server:
        client = KVCodecClient(server.grpc_url, "grpc")
        first = client.generate(ids, 6)
        second = client.generate(ids, 6)
    assert first.reused_tokens == 512 and first.stats["engine"]["promised_tokens"] == 512
    assert not first.stats["engine"].get("local_tokens")  # nothing held yet: loaded from the store
    assert second.tokens == first.tokens and second.reused_tokens >= 512
    assert second.stats["engine"]["local_tokens"] >= 512  # held by vLLM: ...
    assert second.stats["engine"]["promised_tokens"] == 0  # ... so the connector loaded nothing
