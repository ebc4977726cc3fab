"""What the serving steps and the chunk format know of a model without loading it: ``ModelCard``
(its name, its identity bound into every chunk key and header, its KV geometry, the dtype the
``raw`` rung stores, its RoPE). Each engine makes its own (``Engine.model_card``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from .geometry import Geometry

KV_DTYPES = ("float16", "float32")  # what a card's ``kv_dtype`` may say (the ``native`` layout's dtypes)


@dataclass(frozen=True)
class ModelCard:
    """What the serving steps need to know of a model without loading it."""

    name: str  # e.g. SmolLM2-135M-Instruct
    model_id: str  # name + a digest of the weights: bound into every chunk key and header
    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int  # token ids must be below this
    max_context: int  # prompt + generated tokens
    codec_profile: Optional[str] = None  # the PCA profile of the transform layouts (``kvcodec.profiles``)
    # The dtype the engine computes and keeps its KV in: "float32" (CPU engines) or "float16" (GPU).
    # The ``raw`` rung stores exactly these bytes (``Scheme.for_card``), so it is part of raw's identity.
    kv_dtype: str = "float16"
    # RoPE as the model's config says: the profile fit and the transform layouts undo it on keys
    rope_theta: Optional[float] = None
    rope_type: str = "default"

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"model card {self.name}: kv_dtype {self.kv_dtype!r} is not one of "
                              f"{', '.join(KV_DTYPES)}")

    def geometry(self, tokens: int) -> Geometry:
        return Geometry(layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim, tokens=tokens)
