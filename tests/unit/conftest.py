"""Shared fixtures of the unit tests: synthetic KV that looks like a model's, and stores.

The KV is numpy (no torch): ``[layers, 2, kv_heads, tokens, head_dim]`` float32 with a per-channel
offset and scale, a few outlier channels (as real keys have), and structure along the tokens, so
that quantization and video coding see something like real data rather than standard normal.
"""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from kvcodec.format.auth import ChunkAuth
from kvcodec.format.codecs import Scheme
from kvcodec.profiles import _CACHE as PROFILE_CACHE
from kvcodec.profiles import save_profile
from kvcodec.store.memory import MemoryStore

LAYERS, KV_HEADS, TOKENS, HEAD_DIM = 4, 3, 256, 64
AUTH = ChunkAuth(bytes(range(32)))  # the tests' chunk signing key


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


TINY_PROFILE = "tiny-v1"
THETA = 100000.0


def structured_kv(seed: int, layers: int = LAYERS, heads: int = KV_HEADS, tokens: int = TOKENS,
                  dim: int = HEAD_DIM, token_start: int = 0) -> np.ndarray:
    """KV whose vectors lie mostly in a few directions (``kvcodec_tools.fuzz.structured_kv``)."""
    from kvcodec_tools.fuzz import structured_kv as make

    return make(seed, layers, heads, tokens, dim, token_start, THETA)


@pytest.fixture(scope="session")
def tiny_profile(tmp_path_factory):
    """A codec profile ``tiny-v1`` for the synthetic geometry, fitted on structured KV, found
    through ``KVCODEC_PROFILE_DIR`` for the whole session. Yields its directory."""
    d = tmp_path_factory.mktemp("profiles")
    from kvcodec_tools.fuzz import synthetic_profile

    samples = [(structured_kv(s, token_start=s * 256), s * 256) for s in range(4)]
    save_profile(synthetic_profile(samples, THETA), d / f"{TINY_PROFILE}.npz")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVCODEC_PROFILE_DIR", str(d))
        PROFILE_CACHE.pop(TINY_PROFILE, None)
        yield d
    PROFILE_CACHE.pop(TINY_PROFILE, None)


def on_tiny_profile(scheme: Scheme) -> Scheme:
    """``scheme`` with the tiny profile in place of the model's (for layouts that need one)."""
    return scheme.with_profile(TINY_PROFILE)


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


def register_engine(monkeypatch, name: str, cls) -> str:
    """``cls`` registered as engine ``name`` for one test (the registry restored after it)."""
    import sys
    import types

    from kvcodec.engines import ENGINES

    module = types.ModuleType(f"kvcodec_test_{name}_engine")
    setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(ENGINES, "_targets", dict(ENGINES._targets))
    monkeypatch.setattr(ENGINES, "_loaded", dict(ENGINES._loaded))
    ENGINES.register(name, f"{module.__name__}:{cls.__name__}")
    return name


@pytest.fixture
def register_entropy(monkeypatch):
    """``register_entropy(name, cls)``: a stand-in entropy decoder class in ``ENTROPY_DECODERS``
    under ``name``, for this test only."""
    from kvcodec.bitstream.decoders import ENTROPY_DECODERS

    def add(name, cls):
        monkeypatch.setitem(ENTROPY_DECODERS._targets, name, f"{cls.__module__}:{cls.__name__}")
        monkeypatch.setitem(ENTROPY_DECODERS._loaded, name, cls)
    return add
