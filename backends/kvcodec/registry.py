"""A lazy registry from name to ``"module:attribute"``.

Entries name where a class lives; the module is imported only when the entry is chosen, so a
heavy dependency (PyAV, PyNvVideoCodec, redis) is loaded only by those who use it. Registering a
name twice raises; asking for an unknown name raises ``Unsupported`` listing the known ones.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, Generic, TypeVar

from .errors import Unsupported

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._targets: Dict[str, str] = {}
        self._loaded: Dict[str, Any] = {}

    def register(self, name: str, target: str) -> None:
        """Register ``name`` -> ``"package.module:Attribute"``."""
        if name in self._targets:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if ":" not in target:
            raise ValueError(f"{self.kind} target must be 'module:attribute', got {target!r}")
        self._targets[name] = target

    def names(self) -> list:
        return sorted(self._targets)

    def __contains__(self, name: str) -> bool:
        return name in self._targets

    def get(self, name: str) -> Any:
        """The registered attribute (usually a class), imported on first use."""
        if name not in self._targets:
            known = ", ".join(self.names()) or "none"
            raise Unsupported(f"unknown {self.kind} {name!r} (known: {known})")
        if name not in self._loaded:
            module_name, attr = self._targets[name].split(":", 1)
            module = importlib.import_module(module_name)
            self._loaded[name] = getattr(module, attr)
        return self._loaded[name]


# The engines, by name (``settings`` checks ``engine`` against it without importing one; ``engines``
# opens them): here, at the bottom, so that both import it downwards.
ENGINES: Registry = Registry("engine")
ENGINES.register("transformers", "kvcodec.engines.transformers_engine:TransformersEngine")
ENGINES.register("vllm", "kvcodec.engines.vllm_engine:VllmEngine")
ENGINES.register("trtllm", "kvcodec.engines.trtllm_engine:TrtllmEngine")  # TensorRT-LLM's LLM API (its container)
