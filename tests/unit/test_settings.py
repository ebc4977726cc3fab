"""Typed settings (kvcodec.settings): explicit, then environment, then default."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcodec.errors import ConfigError
from kvcodec.settings import Settings


def test_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = Settings.load(env={})
    home = (tmp_path / ".cache").resolve()
    assert s.home == home
    assert s.store == f"file://{home / 'store'}"
    assert s.model_cache == home / "models"
    assert s.ladder == ("kvtc-w", "video", "int8-zstd", "raw")  # rungs that pass the quality gate
    assert s.engine == "transformers"
    assert (s.chunk_tokens, s.threads, s.decoder) == (256, 0, "pyav")


def test_home_moves_the_store_and_model_cache(tmp_path):
    s = Settings.load(env={"KVCODEC_HOME": str(tmp_path / "h")})
    assert s.home == (tmp_path / "h").resolve()
    assert s.store == f"file://{s.home / 'store'}" and s.model_cache == s.home / "models"


@pytest.mark.parametrize("name, explicit, env, default", [
    ("chunk_tokens", "512", "128", 256),
    ("threads", "3", "2", 0),
    ("decoder", "auto", "nvdec", "pyav"),
    ("entropy", "nvcomp", "cpu", "auto"),
    ("store", "memory://x", "file:///tmp/env-store", None),
    ("ladder", "raw", "int8-zstd,video", None),
    ("engine", "transformers", "transformers", "transformers"),
])
def test_explicit_beats_env_beats_default(name, explicit, env, default, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env_var = {f"KVCODEC_{name.upper()}": env}

    def value(s):
        v = getattr(s, name)
        return ",".join(v) if name == "ladder" else v

    def typed(text):
        return int(text) if name in ("chunk_tokens", "threads") else text

    assert value(Settings.load({name: explicit}, env=env_var)) == typed(explicit)
    assert value(Settings.load({}, env=env_var)) == typed(env)
    if default is not None:
        assert value(Settings.load({}, env={})) == default
    # an empty explicit value means "not given"
    assert value(Settings.load({name: ""}, env=env_var)) == typed(env)
    assert value(Settings.load({name: None}, env=env_var)) == typed(env)


def test_the_process_environment_is_the_default_env(monkeypatch):
    monkeypatch.setenv("KVCODEC_CHUNK_TOKENS", "64")
    assert Settings.load().chunk_tokens == 64
    assert Settings.load(env={}).chunk_tokens == 256


def test_unknown_key_raises_naming_it():
    with pytest.raises(ConfigError, match="chunk_tokns") as err:
        Settings.load({"chunk_tokns": "256"}, env={})
    assert "chunk_tokens" in str(err.value)  # and lists the known ones


@pytest.mark.parametrize("name, value, match", [
    ("chunk_tokens", "abc", "chunk_tokens must be an integer, got 'abc'"),
    ("chunk_tokens", "4", "chunk_tokens must be >= 8, got 4"),
    ("chunk_tokens", "0", "chunk_tokens"),
    ("chunk_tokens", "-256", "chunk_tokens"),
    ("chunk_tokens", "100", "multiple of 8, got 100"),
    ("chunk_tokens", "2.5e2", "chunk_tokens"),
    ("threads", "-1", "threads must be >= 0, got -1"),
    ("threads", "two", "threads must be an integer, got 'two'"),
    ("decoder", "cuda", "decoder must be one of pyav, nvdec, auto, got 'cuda'"),
    ("decoder", "PYAV", "'PYAV'"),
    ("ladder", "lossless8,h266", "ladder: codec 'h266' is unknown"),
    ("ladder", "LOSSLESS8", "'LOSSLESS8'"),
    ("engine", "tensorrt", "engine must be one of transformers, trtllm, vllm, got 'tensorrt'"),
    ("step_tokens", "-1", "step_tokens must be >= 0"),
    ("prefill_slice", "x", "prefill_slice must be an integer"),
    ("stream_loads", "maybe", "stream_loads must be 0 or 1"),
    ("entropy", "gpu", "entropy must be one of auto, cpu, nvcomp, got 'gpu'"),
])
def test_bad_values_raise_config_error_naming_field_and_value(name, value, match):
    with pytest.raises(ConfigError, match=match):
        Settings.load({name: value}, env={})
    with pytest.raises(ConfigError, match=match):
        Settings.load({}, env={f"KVCODEC_{name.upper()}": value})


@pytest.mark.parametrize("value", [",", " , "])
def test_an_empty_codec_list_raises_config_error(value):
    with pytest.raises(ConfigError, match="ladder"):
        Settings.load({"ladder": value}, env={})


def test_ladder_is_stripped_and_ordered():
    assert Settings.load({"ladder": " raw , lossless8 ,"}, env={}).ladder == ("raw", "lossless8")


def test_the_ladders_old_name_is_still_read_from_the_environment():
    assert Settings.load({}, env={"KVCODEC_CODECS": "raw"}).ladder == ("raw",)
    assert Settings.load({}, env={"KVCODEC_CODECS": "raw", "KVCODEC_LADDER": "video"}).ladder == ("video",)


@pytest.mark.parametrize("value, want", [("off", ()), ("first", ("raw",)), ("int8-zstd,raw", ("int8-zstd", "raw"))])
def test_writeback_is_off_the_ladders_first_rung_or_a_ladder(value, want):
    s = Settings.load({"ladder": "raw,video", "writeback": value}, env={})
    assert s.writeback == want
    assert Settings.load(env=s.environ()).writeback == want


def test_a_bad_writeback_rung_is_a_config_error():
    with pytest.raises(ConfigError, match="writeback: codec 'nope' is unknown"):
        Settings.load({"writeback": "nope"}, env={})


def test_environ_round_trips_through_load(tmp_path):
    s = Settings.load({"home": str(tmp_path / "h"), "store": "memory://rt", "ladder": "raw,video",
                       "chunk_tokens": "128", "threads": "2", "decoder": "auto"}, env={})
    env = s.environ()
    assert set(env) == {f"KVCODEC_{n}" for n in
                        ("HOME", "STORE", "MODEL_CACHE", "LADDER", "CHUNK_TOKENS", "THREADS", "DECODER",
                         "ADAPTIVE", "LINK_MBPS", "DEADLINE_S", "ENGINE", "KEY_FILE", "FETCH_TIMEOUT_S", "WRITEBACK",
                         "INGEST_WORKERS", "DECODER_PROCESS", "DECODE_TIMEOUT_S", "MODEL", "STORE_CA_FILE",
                         "STREAM_LOADS", "ASYNC_LOADS", "STEP_TOKENS", "PREFILL_SLICE", "ENTROPY",
                         "WRITEBACK_PENDING", "EXCLUDE_INPUT_IN_OUTPUT", "PREFIX_CACHE", "KEY_FILE_PREVIOUS",
                             "LOCAL_STORE", "LOCAL_STORE_MB", "ENCRYPT_CHUNKS",
                             "TRTLLM_KV_FRACTION", "TRTLLM_OVERLAP_SCHEDULER", "VLLM_ENGINE_ARGS")}
    assert all(isinstance(v, str) for v in env.values())
    assert Settings.load(env=env) == s
    defaults = Settings.load(env={"KVCODEC_HOME": str(tmp_path)})
    assert Settings.load(env=defaults.environ()) == defaults


def test_scheduling_levers_reach_vllms_engine_arguments():
    from kvcodec.engines.vllm_engine import _scheduling

    s = Settings.load({"step_tokens": "512", "prefill_slice": "128", "stream_loads": "0"}, env={})
    assert (s.step_tokens, s.prefill_slice, s.stream_loads) == (512, 128, False)
    assert _scheduling(s) == {"max_num_batched_tokens": 512, "long_prefill_token_threshold": 128}
    assert _scheduling(Settings.load(env={})) == {"max_num_batched_tokens": 512,  # the engine's, measured
                                                  "long_prefill_token_threshold": 128}


def test_settings_are_frozen(tmp_path):
    s = Settings.load(env={"KVCODEC_HOME": str(tmp_path)})
    with pytest.raises(AttributeError):
        s.chunk_tokens = 8  # type: ignore[misc]
    assert isinstance(s.home, Path)


def test_ingest_workers_from_the_environment_and_back():
    s = Settings.load(env={"KVCODEC_INGEST_WORKERS": "3"})
    assert s.ingest_workers == 3 and Settings.load(env=s.environ()).ingest_workers == 3
    assert Settings.load(env={}).ingest_workers == 0  # ingest's own default
    with pytest.raises(ConfigError, match="ingest_workers must be >= 0"):
        Settings.load({"ingest_workers": "-1"}, env={})


def test_decoder_process_and_its_deadline():
    s = Settings.load(env={})
    assert s.decoder_process is True and s.decode_timeout_s == 30.0
    off = Settings.load({"decoder_process": "0", "decode_timeout_s": "2.5"}, env={})
    assert off.decoder_process is False and off.decode_timeout_s == 2.5
    assert Settings.load(env=off.environ()) == off
    assert Settings.load(env={"KVCODEC_DECODER_PROCESS": "no"}).decoder_process is False
    with pytest.raises(ConfigError, match="decoder_process must be 0 or 1"):
        Settings.load({"decoder_process": "maybe"}, env={})
    with pytest.raises(ConfigError, match="decode_timeout_s"):
        Settings.load({"decode_timeout_s": "0"}, env={})


def test_previous_key_file_is_a_file_and_round_trips(tmp_path):
    previous = tmp_path / "previous.keys"
    with pytest.raises(ConfigError, match="key_file_previous"):
        Settings.load({"key_file_previous": str(previous)}, env={})
    previous.write_text("00" * 32)
    s = Settings.load({"key_file_previous": str(previous)}, env={})
    assert s.key_file_previous == previous and Settings.load(env=s.environ()) == s
