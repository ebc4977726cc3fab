"""The transformers engine calls the model the way the installed transformers wants: no deprecation
warning (``make demo`` once printed transformers' FutureWarning about ``past_key_values``) on any
path that runs the model: prefill by chunks, streaming with and without a restored prefix, and the
teacher-forced log-probabilities of the quality harness."""
from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import numpy as np
import pytest

from kvcodec.engines import open_engine, tokenizer
from kvcodec.engines.model_files import ensure_model
from kvcodec.settings import Settings
from tests.other_model import write_model

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]


def test_no_deprecation_warning_on_any_path_that_runs_the_model(tmp_path):
    folder = write_model(tmp_path / "tiny-llama", ensure_model(REPO / ".cache" / "models").path)
    settings = Settings.load({"model": str(folder), "model_cache": str(tmp_path / "cache"),
                              "home": str(tmp_path / "home"), "threads": "1"}, env={})
    engine = open_engine(settings)
    ids = tokenizer(settings).encode("def f(x):\n    return x * 2\n" * 60)[:300]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning or DeprecationWarning fails the test
        kv = next(engine.prefill_chunks(ids, 256))
        prefill = list(engine.stream(ids, 3))
        reuse = list(engine.stream(ids, 3, past_kv=kv))
        logprobs = engine.continuation_logprobs(kv, ids[256:260])
    assert reuse == prefill and logprobs.shape[0] == 4 and np.isfinite(logprobs).all()
    # the argument name the model's forward declares, not the deprecated alias
    assert engine._cache_arg in inspect.signature(engine.model.forward).parameters
