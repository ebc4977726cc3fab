"""A stand-in ``triton_python_backend_utils`` for unit tests of a step's model.py on CPU: the
module is installed in ``sys.modules`` (``kvcodec.triton`` re-imported against it) and the step's
model.py loaded as ``fake.model``."""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"


class _Metric:
    def __init__(self, labels) -> None:
        self.labels, self.value = dict(labels or {}), 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def increment(self, value: float) -> None:
        self.value += float(value)

    def observe(self, value: float) -> None:
        self.value += float(value)


class MetricFamily:
    """Records each family made and its metrics (``families``: name -> family)."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    families: dict = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind, self.metrics = name, kind, []
        MetricFamily.families[name] = self

    def Metric(self, labels=None, buckets=None) -> _Metric:  # noqa: N802 (Triton's name)
        metric = _Metric(labels)
        self.metrics.append(metric)
        return metric


def load_step(monkeypatch, step: str, tensor=None) -> types.ModuleType:
    """Install the stand-in (``Tensor`` is ``tensor`` or a plain record) and load ``step``'s model.py."""
    fake = types.ModuleType("triton_python_backend_utils")
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    fake.logged = []
    fake.Logger = types.SimpleNamespace(log_info=lambda m: fake.logged.append(("info", m)),
                                        log_warn=lambda m: fake.logged.append(("warn", m)))
    fake.Tensor = tensor or (lambda name, value: types.SimpleNamespace(name=name, value=value))
    fake.InferenceResponse = lambda tensors=None, output_tensors=None, error=None: types.SimpleNamespace(
        tensors={t.name: t for t in (tensors if tensors is not None else output_tensors) if t is not None}, error=error)
    fake.TritonError = lambda message, code=None: types.SimpleNamespace(message=message, code=code)
    fake.get_input_tensor_by_name = lambda request, name: request.get(name)
    MetricFamily.families = {}
    fake.MetricFamily = MetricFamily
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    for name in ("kvcodec.triton", "kvcodec.triton.metrics"):  # re-imported against the stand-in
        monkeypatch.delitem(sys.modules, name, raising=False)
    spec = importlib.util.spec_from_file_location(f"{step}_model", REPOSITORY / step / "1" / "model.py")
    fake.model = importlib.util.module_from_spec(spec)
    return fake


def exec_step(fake) -> None:
    fake.model.__spec__.loader.exec_module(fake.model)
