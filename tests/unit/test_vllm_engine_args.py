"""The ``vllm`` engine's arguments (``kvcodec.engines.vllm_engine.engine_args``): vLLM's own
``EngineArgs`` names from the setting ``vllm_engine_args`` merged over defaults that follow the model
(its whole context; float32 and eager on the CPU build, float16 and CUDA graphs on a GPU); names
vLLM does not have, names a setting owns and values the connector cannot serve refused, each named;
the model card's context, KV dtype and identity follow what is passed. Without vLLM (the names are
checked against a stand-in set); against vLLM's real ``EngineArgs`` where it is importable."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcodec.engines import vllm_engine
from kvcodec.engines.vllm_engine import OWN_ARGS, engine_args
from kvcodec.errors import ConfigError
from kvcodec.settings import Settings

REPO = Path(__file__).resolve().parents[2]
KNOWN = frozenset({"dtype", "max_model_len", "seed", "disable_log_stats", "max_logprobs", "enforce_eager",
                   "gpu_memory_utilization", "max_num_seqs", "quantization", "tensor_parallel_size",
                   "kv_cache_dtype", "swap_space", "distributed_executor_backend", *OWN_ARGS})


def _settings(args: str = "", **more) -> Settings:
    return Settings.load({"vllm_engine_args": args, **more}, env={})


def test_the_defaults_follow_the_model_and_keep_what_ran_on_the_cpu():
    cpu = engine_args(_settings(), 131072, on_gpu=False, known=KNOWN)
    assert cpu == {"dtype": "float32", "enforce_eager": True, "max_model_len": 131072, "seed": 0,
                   "disable_log_stats": True, "max_logprobs": -1, "max_num_batched_tokens": 512,
                   "long_prefill_token_threshold": 128}
    gpu = engine_args(_settings(), 131072, on_gpu=True, known=KNOWN)
    assert gpu["dtype"] == "float16" and "enforce_eager" not in gpu  # vLLM's CUDA graphs
    assert gpu["max_model_len"] == 131072  # the model's, not a fixed cap


def test_vllms_own_names_pass_through_over_the_defaults():
    given = ('{"gpu_memory_utilization": 0.85, "max_num_seqs": 64, "quantization": "fp8", "max_model_len": 64, '
             '"enforce_eager": false, "dtype": "half", "tensor_parallel_size": 1}')
    args = engine_args(_settings(given, step_tokens="256"), 8192, on_gpu=True, known=KNOWN)
    assert {k: args[k] for k in ("gpu_memory_utilization", "max_num_seqs", "quantization", "enforce_eager")} == {
        "gpu_memory_utilization": 0.85, "max_num_seqs": 64, "quantization": "fp8", "enforce_eager": False}
    assert (args["dtype"], args["max_model_len"]) == ("float16", 64)  # vLLM's alias, as the card names it
    assert (args["max_num_batched_tokens"], args["long_prefill_token_threshold"]) == (256, 64)  # within the context


def test_unknown_names_are_refused_naming_every_one():
    with pytest.raises(ConfigError, match="not vLLM EngineArgs names: gpu_mem_util, max_seqs"):
        engine_args(_settings('{"max_seqs": 4, "gpu_mem_util": 0.9, "max_num_seqs": 4}'), 8192, False, known=KNOWN)
    # without vLLM at hand (the card in kv_fetch) the names wait for the engine's start
    assert engine_args(_settings('{"max_seqs": 4}'), 8192, False)["max_seqs"] == 4


@pytest.mark.parametrize("given, message", [
    ('{"model": "/elsewhere"}', "model: the model folder is the setting model"),
    ('{"enable_prefix_caching": false}', "the setting prefix_cache"),
    ('{"max_num_batched_tokens": 4096}', "the setting step_tokens"),
    ('{"long_prefill_token_threshold": 64}', "the setting prefill_slice"),
    ('{"kv_transfer_config": {}}', "the KVCodec connector"),
    ('{"dtype": "bfloat16"}', "dtype 'bfloat16': the stored KV is float16 or float32"),
    ('{"dtype": "auto"}', "dtype 'auto'"),
    ('{"kv_cache_dtype": "fp8"}', "kv_cache_dtype 'fp8'"),
    ('{"max_model_len": 16384}', r"max_model_len 16384: .* at most the model's max_position_embeddings \(8192\)"),
    ('{"max_model_len": "4k"}', "max_model_len '4k'"),
    ('{"tensor_parallel_size": 2}', r"tensor_parallel_size 2: .* \(1 only\)"),
    ('{"distributed_executor_backend": "mp"}', "distributed_executor_backend 'mp': uni only"),
    ('{"max_num_seqs": 0}', "max_num_seqs 0"),
])
def test_what_the_connector_cannot_serve_is_refused_naming_it(given, message):
    with pytest.raises(ConfigError, match=message):
        engine_args(_settings(given), 8192, on_gpu=True, known=KNOWN)


@pytest.mark.parametrize("text", ["[1, 2]", "{gpu_memory_utilization: 0.9}", '"x"'])
def test_the_setting_is_a_json_object(text):
    with pytest.raises(ConfigError, match="vllm_engine_args must be a JSON object"):
        _settings(text)


def test_the_setting_reaches_the_server_processes_environment():
    s = Settings.load(env={"KVCODEC_VLLM_ENGINE_ARGS": '{"max_num_seqs": 8,  "gpu_memory_utilization": 0.5}'})
    assert s.vllm_engine_args == '{"gpu_memory_utilization":0.5,"max_num_seqs":8}'
    assert Settings.load(env=s.environ()) == s


@pytest.fixture
def model_cache():
    cache = REPO / ".cache" / "models"
    if not (cache / "smollm2-135m-instruct" / "config.json").is_file():
        pytest.skip("the converted SmolLM2 folder is not in .cache/models (make setup, then any integration test)")
    return str(cache)


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu", "gpu"])
def test_the_card_follows_what_is_passed(model_cache, monkeypatch, on_gpu):
    from kvcodec.engines import model_files
    from kvcodec.engines.vllm_engine import VllmEngine

    monkeypatch.setattr(vllm_engine, "_on_gpu", lambda: on_gpu)
    base = model_files.card_for(_settings(model_cache=model_cache))
    card = VllmEngine.model_card(_settings(model_cache=model_cache))
    dtype = "float16" if on_gpu else "float32"
    assert (card.max_context, card.kv_dtype, card.model_id) == (base.max_context, dtype, f"{base.model_id}/vllm-{dtype}")
    card = VllmEngine.model_card(_settings('{"max_model_len": 2048, "dtype": "float"}', model_cache=model_cache))
    assert (card.max_context, card.kv_dtype, card.model_id) == (2048, "float32", f"{base.model_id}/vllm-float32")


def test_the_names_are_vllms_own_engine_args():
    pytest.importorskip("vllm", reason="vLLM is in .venv-vllm (make setup-vllm)")
    from kvcodec.engines.vllm_engine import engine_arg_names

    names = engine_arg_names()
    assert {"gpu_memory_utilization", "max_num_seqs", "quantization", "tensor_parallel_size", "enforce_eager",
            "max_model_len", "dtype", "kv_cache_dtype"} <= names
    assert set(OWN_ARGS) <= names  # each one refused is one vLLM has
    assert set(engine_args(_settings(), 8192, on_gpu=False, known=names)) <= names  # the defaults, too
    with pytest.raises(ConfigError, match="not vLLM EngineArgs names: gpu_mem_util"):
        engine_args(_settings('{"gpu_mem_util": 0.9}'), 8192, on_gpu=True, known=names)
