"""What the model modules share, below them all: ``ModelFiles`` (a model's folder and identity), the
embedded model's names and its conversion record, and a file's SHA-256. ``gguf`` (the embedded
model's conversion), ``tokenizer`` and ``model_files`` (cards, identities) import this module; it
imports none of them, so the three form no circle.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import ModelCard

MODEL_NAME = "SmolLM2-135M-Instruct"
FOLDER = "smollm2-135m-instruct"  # the embedded model's converted folder, under the model cache
READY = "kvcodec-model.json"  # the conversion's record in that folder: {"model_id", "source"}


@dataclass(frozen=True)
class ModelFiles:
    path: Path
    model_id: str
    card: Optional[ModelCard] = None  # a model folder's card (None: the embedded model's)

    def geometry(self, tokens: int):
        """The KV geometry of this model (from its config.json), without loading the weights."""
        from ..format.geometry import Geometry

        cfg = json.loads((self.path / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        return Geometry(layers=int(cfg["num_hidden_layers"]), kv_heads=int(cfg.get("num_key_value_heads", heads)),
                        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads), tokens=tokens)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
