"""The TensorRT-LLM image's ``trtllm-llmapi`` variant, run through the containers' entrypoint in a
temporary root (as tests/unit/test_deploy.py does for the other variants): NVIDIA's LLM-API
``model.py`` and ``helpers.py`` (an NGC image keeps them in /app/all_models; here a stand-in folder
named by ``KVCODEC_TRTLLM_LLMAPI_DIR``) are copied into the repository, and ``kvcodec serve`` is
started with ``TRTLLM_KVCODEC_CONFIG`` naming the connector's settings and the chunk key under the
name TensorRT-LLM's workers receive; without the files it stops before writing anything. And the
Dockerfile does what docs/deploy-trtllm.md asks of the container."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
BIN = Path(sys.executable).parent
KEY = "ab" * 32

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_attention_heads": 9,
          "num_key_value_heads": 3, "hidden_size": 576, "num_hidden_layers": 30, "head_dim": 64,
          "max_position_embeddings": 8192, "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000}


def _model(root: Path) -> Path:
    model = root / "models" / "llm"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(CONFIG))
    (model / "model.safetensors").write_bytes(b"weights")
    for path in (model / "config.json", model / "model.safetensors", model, model.parent):
        path.chmod(0o555 if path.is_dir() else 0o444)
    return model


def _llmapi(root: Path) -> Path:
    folder = root / "app" / "all_models" / "llmapi" / "tensorrt_llm" / "1"
    folder.mkdir(parents=True)
    (folder / "model.py").write_text("# NVIDIA's TritonPythonModel\n")
    (folder / "helpers.py").write_text("# NVIDIA's helpers\n")
    return folder


def _entrypoint(tmp_path: Path, **env):
    """The entrypoint with ``kvcodec serve`` replaced by a recorder of its argv and environment."""
    shims = tmp_path / "shims"
    shims.mkdir(exist_ok=True)
    record = tmp_path / "served.json"
    (shims / "recorder").write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                                    f"open({str(record)!r}, 'w').write(json.dumps([sys.argv, dict(os.environ)]))\n")
    (shims / "kvcodec").write_text(f"#!/bin/sh\nif [ \"$1\" = serve ]; then exec {shims / 'recorder'} \"$@\"; fi\n"
                                   f"exec {BIN / 'kvcodec'} \"$@\"\n")
    for shim in shims.iterdir():
        shim.chmod(0o755)
    environ = {"PATH": f"{shims}:{BIN}:/usr/bin:/bin", "HOME": str(tmp_path), "KVCODEC_VARIANT": "trtllm-llmapi",
               "KVCODEC_HOME": str(tmp_path / "home"), **env}
    run = subprocess.run(["sh", DOCKER / "entrypoint.sh"], env=environ, capture_output=True, text=True, timeout=120)
    return run, (json.loads(record.read_text()) if record.exists() else (None, None))


def test_the_llmapi_variant_gets_nvidias_model_and_the_connectors_variables(tmp_path):
    model, llmapi = _model(tmp_path), _llmapi(tmp_path)
    run, (argv, env) = _entrypoint(tmp_path, KVCODEC_MODEL=str(model), KVCODEC_TRTLLM_LLMAPI_DIR=str(llmapi),
                                   KVCODEC_CHUNK_KEY=KEY, KVCODEC_STORE="file:///srv/kv")
    assert run.returncode == 0, run.stdout + run.stderr
    repository = tmp_path / "home" / "repository"
    step = repository / "tensorrt_llm" / "1"
    assert (step / "model.py").read_text() == (llmapi / "model.py").read_text()
    assert (step / "helpers.py").read_text() == (llmapi / "helpers.py").read_text()
    assert (step / "model.yaml").is_file()
    assert argv[1] == "serve" and argv[argv.index("--model-repository") + 1] == str(repository)
    assert env["TRTLLM_KVCODEC_CONFIG"] == str(step / "kvcodec-trtllm.json")
    settings = json.loads(Path(env["TRTLLM_KVCODEC_CONFIG"]).read_text())
    assert settings["store"] == "file:///srv/kv"
    assert env["TRTLLM_KVCODEC_CHUNK_KEY"] == KEY  # what TensorRT-LLM's workers receive
    from kvcodec.engines.trtllm_config import CHUNK_KEY_ENV, CONFIG_ENV

    assert {CONFIG_ENV, CHUNK_KEY_ENV} <= set(env)  # the names the connector reads


def test_the_llmapi_variant_without_nvidias_model_stops_before_writing(tmp_path):
    model = _model(tmp_path)
    run, (argv, _) = _entrypoint(tmp_path, KVCODEC_MODEL=str(model),
                                 KVCODEC_TRTLLM_LLMAPI_DIR=str(tmp_path / "nowhere"))
    assert run.returncode == 2 and argv is None
    assert "model.py is missing" in run.stderr and "KVCODEC_TRTLLM_LLMAPI_DIR" in run.stderr
    assert not (tmp_path / "home" / "repository").exists()


def test_the_image_and_its_doc_install_the_same():
    dockerfile = (DOCKER / "Dockerfile.trtllm").read_text()
    doc = (REPO / "docs" / "deploy-trtllm.md").read_text()
    section = doc[doc.index("## 2. This project"):doc.index("## 3. ")]
    assert "pip install --no-cache-dir --upgrade openai" in dockerfile  # section 1's fix for 26.03
    assert "pip install -U openai" in doc
    assert "cryptography" in dockerfile and "cryptography" in section
    assert "smollm2" not in section.lower() and "gguf" not in section  # no demo model in the image or there
    assert "/app/all_models/llmapi/tensorrt_llm/1" in (DOCKER / "entrypoint.sh").read_text()
