"""Settings of the TensorRT-LLM connector (``trtllm_connector``), typed and parsed once per process.

TensorRT-LLM runs the model, and so both halves of the connector, in its own worker processes
(MPI ranks), which receive only ``TLLM_*``/``TRTLLM_*`` environment variables: ``KVCODEC_*`` does not
reach them. So the connector reads a JSON file named by ``TRTLLM_KVCODEC_CONFIG``:

    {"store": "file:///srv/kv", "ladder": ["int8-zstd", "raw"], "chunk_tokens": 256,
     "writeback": ["raw"], "key_file": "/srv/kv/chunk.key",
     "model": {"name": "Llama-3.1-8B", "model_id": "Llama-3.1-8B@sha256:.../trtllm-float16",
               "layers": 32, "kv_heads": 8, "head_dim": 128, "vocab_size": 128256,
               "max_context": 8192, "codec_profile": null, "kv_dtype": "float16"}}

| key             | meaning (default)                                                           |
|-----------------|-----------------------------------------------------------------------------|
| store           | store URL (required)                                                        |
| ladder          | rung specs, preferred first, a list or a comma string (the server's ladder) |
| chunk_tokens    | tokens per stored chunk (256)                                               |
| writeback       | rungs to store the prompt's new full chunks at, ``off``, ``first`` (first)  |
| key_file        | the chunk signing key (``<home>/chunk.key``)                                |
| home            | base of the defaults (``./.cache``)                                         |
| decoder         | ``pyav``, ``nvdec`` or ``auto`` (pyav)                                      |
| threads         | decoder threads (1)                                                         |
| fetch_timeout_s | a request's store calls end by then; the rest is computed (20)              |
| max_pending     | write-back jobs that may wait before new ones are dropped (8)               |
| prefetch        | read a prompt's stored prefix into the stage when nothing is staged (true:  |
|                 | the stock LLM-API model; the ensemble's llm step stages chunks itself)      |
| stage_bytes     | restored KV staged on the pool's device, outside TensorRT-LLM's pool        |
|                 | (``free_gpu_memory_fraction``), at most (1 GiB); least recently used goes   |
| model           | the model card (``engines.ModelCard`` fields; required)                     |
| encrypt_chunks, local_store, local_store_mb, key_file_previous, adaptive, link_mbps, deadline_s |
|                 | as the settings of those names (``kvcodec.settings``)                       |

Values are checked as ``kvcodec.settings.Settings`` checks them (the same messages); unknown keys
are errors that name them. The ``model_id`` is bound into every chunk key: give TensorRT-LLM's KV
an identity of its own (the weights' identity plus ``/trtllm-<kv dtype>``), as the vLLM engine does,
since engines differ in the last bits. ``kv_dtype`` is the dtype the ``raw`` rung stores.
``TrtllmConfig.settings`` (``to_settings()``) is the ``Settings`` the connector reads and writes with: its reads and
writes are built by ``kvcodec.compose`` as every other deployment's (local tier, breaker, re-signing,
write-back pricing).

Without ``TRTLLM_KVCODEC_CONFIG``, ``Settings.load()`` (``KVCODEC_*``) gives the rest and the model is
the project's own (``model_files``, identity suffixed ``/trtllm-float16``): useful where the
variables do reach the process (one rank, in-process executor).

The chunk key: ``TRTLLM_KVCODEC_CHUNK_KEY`` (hex) takes the place of ``KVCODEC_CHUNK_KEY``; else the
key file (``kvcodec.format.auth.load_auth``); ``TRTLLM_KVCODEC_CHUNK_KEY_PREVIOUS`` (else
``KVCODEC_CHUNK_KEY_PREVIOUS``) names previous keys that verify but never sign (a key rotating).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping, Optional

from ..errors import ConfigError
from ..format.auth import ChunkAuth, load_auth
from ..settings import Settings
from . import ModelCard

CONFIG_ENV = "TRTLLM_KVCODEC_CONFIG"
CHUNK_KEY_ENV = "TRTLLM_KVCODEC_CHUNK_KEY"
_SETTINGS_KEYS = ("store", "ladder", "chunk_tokens", "writeback", "key_file", "home", "decoder", "threads",
                  "fetch_timeout_s", "encrypt_chunks", "local_store", "local_store_mb", "key_file_previous",
                  "adaptive", "link_mbps", "deadline_s")
_KEYS = _SETTINGS_KEYS + ("max_pending", "prefetch", "stage_bytes", "model")


@dataclass(frozen=True)
class TrtllmConfig:
    """The model card, the deployment's ``Settings`` (what ``kvcodec.compose`` builds the reads and
    writes from: one definition of every setting and its default), and the two settings that only
    TensorRT-LLM's connector has."""

    card: ModelCard
    settings: Settings
    prefetch: bool = True
    stage_bytes: int = 1 << 30

    # the settings the connector's own code reads, by the names it reads them
    chunk_tokens = property(lambda self: self.settings.chunk_tokens)
    writeback = property(lambda self: tuple(self.settings.writeback))
    fetch_timeout_s = property(lambda self: self.settings.fetch_timeout_s)
    key_file = property(lambda self: self.settings.key_file)
    encrypt_chunks = property(lambda self: self.settings.encrypt_chunks)

    def to_settings(self) -> Settings:
        return self.settings

    def auth(self, env: Optional[Mapping[str, str]] = None) -> ChunkAuth:
        env = os.environ if env is None else env
        hex_key = env.get(CHUNK_KEY_ENV) or env.get("KVCODEC_CHUNK_KEY") or ""
        previous = env.get(CHUNK_KEY_ENV + "_PREVIOUS") or env.get("KVCODEC_CHUNK_KEY_PREVIOUS") or ""
        keys = {"KVCODEC_CHUNK_KEY": hex_key, "KVCODEC_CHUNK_KEY_PREVIOUS": previous}
        return load_auth(self.key_file, {k: v for k, v in keys.items() if v}, encrypt=self.encrypt_chunks)


def _card(value: Any) -> ModelCard:
    if not isinstance(value, dict):
        raise ConfigError(f"model must be an object of model card fields, got {value!r}"[:200])
    names = {f.name for f in fields(ModelCard)}
    unknown = sorted(set(value) - names)
    missing = sorted(f.name for f in fields(ModelCard) if f.name not in value and f.name not in
                     ("codec_profile", "kv_dtype", "rope_theta", "rope_type"))
    if unknown or missing:
        raise ConfigError(f"model: unknown field(s) {unknown}, missing field(s) {missing} "
                          f"(fields: {', '.join(sorted(names))})")
    for name in ("layers", "kv_heads", "head_dim", "vocab_size", "max_context"):
        if not isinstance(value[name], int) or isinstance(value[name], bool) or value[name] <= 0:
            raise ConfigError(f"model.{name} must be a positive integer, got {value[name]!r}")
    for name in ("name", "model_id"):
        if not isinstance(value[name], str) or not value[name]:
            raise ConfigError(f"model.{name} must be a non-empty string, got {value[name]!r}")
    return ModelCard(**value)


def _setting(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return "" if value is None else str(value)


def from_mapping(data: Mapping[str, Any], where: str = "config") -> TrtllmConfig:
    """The config of a parsed JSON object (``where`` names it in messages)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(_KEYS)})")
    for name in ("store", "model"):
        if not data.get(name):
            raise ConfigError(f"{where}: {name} is required")
    try:
        settings = Settings.load({k: _setting(data[k]) for k in _SETTINGS_KEYS if k in data}, env={})
        card = _card(data["model"])
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    max_pending = data.get("max_pending", 8)
    if not isinstance(max_pending, int) or isinstance(max_pending, bool) or max_pending < 1:
        raise ConfigError(f"{where}: max_pending must be an integer >= 1, got {max_pending!r}")
    prefetch = data.get("prefetch", True)
    if not isinstance(prefetch, bool):
        raise ConfigError(f"{where}: prefetch must be true or false, got {prefetch!r}")
    stage_bytes = data.get("stage_bytes", 1 << 30)
    if not isinstance(stage_bytes, int) or isinstance(stage_bytes, bool) or stage_bytes < 1:
        raise ConfigError(f"{where}: stage_bytes must be an integer >= 1, got {stage_bytes!r}")
    return TrtllmConfig(card, replace(settings, writeback_pending=max_pending), prefetch, stage_bytes)


def from_settings(settings: Settings, card: ModelCard) -> TrtllmConfig:
    return TrtllmConfig(card, settings)


def load_config(env: Optional[Mapping[str, str]] = None) -> TrtllmConfig:
    """The JSON file ``TRTLLM_KVCODEC_CONFIG`` names, else ``Settings.load()`` and the project's model."""
    env = os.environ if env is None else env
    path = env.get(CONFIG_ENV)
    if path:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"{CONFIG_ENV}={path}: cannot read it: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ConfigError(f"{CONFIG_ENV}={path}: not JSON: {exc}") from None
        return from_mapping(data, where=path)
    from . import model_files

    settings = Settings.load(env=env)
    base = model_files.card(settings.model_cache)
    return from_settings(settings, replace(base, model_id=f"{base.model_id}/trtllm-float16", kv_dtype="float16"))
