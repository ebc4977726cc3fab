"""Shared fixtures of the unit tests: synthetic KV that looks like a model's, and stores.

The KV is numpy (no torch): ``[layers, 2, kv_heads, tokens, head_dim]`` float32 with a per-channel
offset and scale, a few outlier channels (as real keys have), and structure along the tokens, so
that quantization and video coding see something like real data rather than standard normal.
"""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from kvcodec.store.memory import MemoryStore

LAYERS, KV_HEADS, TOKENS, HEAD_DIM = 4, 3, 256, 64


def synthetic_kv(seed: int = 0, layers: int = LAYERS, kv_heads: int = KV_HEADS, tokens: int = TOKENS,
                 head_dim: int = HEAD_DIM) -> np.ndarray:
    rng = np.random.default_rng(seed)
    chan = (layers, 2, kv_heads, 1, head_dim)
    offset = rng.normal(0.0, 1.5, chan)
    scale = rng.lognormal(-0.5, 0.6, chan)
    outliers = rng.random(chan) < 0.05
    scale = np.where(outliers, scale * 12.0, scale)
    t = np.arange(tokens, dtype=np.float64)[None, None, None, :, None]
    freq = rng.uniform(0.005, 0.1, chan)
    phase = rng.uniform(0, 2 * np.pi, chan)
    smooth = np.sin(freq * t + phase)
    noise = rng.standard_normal((layers, 2, kv_heads, tokens, head_dim))
    return (offset + scale * (0.6 * smooth + 0.4 * noise)).astype(np.float32)


@pytest.fixture(scope="session")
def make_kv():
    return synthetic_kv


@pytest.fixture
def kv():
    return synthetic_kv(0)


@pytest.fixture
def memory_store():
    name = f"unit-{uuid.uuid4().hex}"
    store = MemoryStore(name)
    yield store
    store.close()
