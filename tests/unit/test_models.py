"""Any model of the supported families (setting ``model``, ``--model DIR``): the card, identity,
tokenizer and KV geometry come from the folder; a rung that needs a codec profile is refused, naming
the command that fits one, until it exists. The models are small, random and written by the test
(``tests.other_model``), with SmolLM2's tokenizer files; the engine runs them for real."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvcodec.engines import model_card, open_engine
from kvcodec.engines.gguf import ensure_model
from kvcodec.engines.model_files import files_for
from kvcodec.engines.tokenizer import Tokenizer
from kvcodec.errors import ConfigError, Unsupported
from kvcodec.format.ladder import parse_ladder
from kvcodec.profiles import find_profile, require_profiles
from kvcodec.settings import Settings
from kvcodec_tools import cli, tritonserver
from tests.other_model import GEOMETRY, ROPE_THETA, write_model

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
SMOLLM2_CACHE = REPO / ".cache" / "models"  # the embedded model, converted once (~20 s)


@pytest.fixture(scope="module")
def smollm2_folder() -> Path:
    return ensure_model(SMOLLM2_CACHE).path


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_folder) -> Path:
    return tmp_path_factory.mktemp("models")


def _settings(folder: Path, cache: Path, **more) -> Settings:
    return Settings.load({"model": str(folder), "model_cache": str(cache), "home": str(cache.parent / "home"),
                          "threads": "1", **more}, env={})


def test_the_card_comes_from_the_folder_with_its_own_geometry_and_identity(models, smollm2_folder, tmp_path):
    folder = write_model(models / "tiny-llama", smollm2_folder)
    card = model_card(_settings(folder, tmp_path / "cache"))
    assert (card.layers, card.kv_heads, card.head_dim) == tuple(GEOMETRY.values())
    assert (card.vocab_size, card.max_context, card.kv_dtype) == (49152, 2048, "float32")
    assert (card.rope_theta, card.rope_type) == (ROPE_THETA, "default")
    smollm2 = model_card(Settings.load({"model_cache": str(SMOLLM2_CACHE)}, env={}))
    assert (smollm2.layers, smollm2.kv_heads, smollm2.head_dim) == (30, 3, 64)
    assert card.model_id.startswith("llama@hf-sha256:") and card.model_id != smollm2.model_id
    assert card.codec_profile != smollm2.codec_profile and card.codec_profile.startswith("llama-")
    # the weights' hash is remembered against size and mtime: the second card reads it back
    records = list((tmp_path / "cache" / "identities").glob("*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["model_id"] == card.model_id
    assert model_card(_settings(folder, tmp_path / "cache")).model_id == card.model_id
    # other weights (another seed), another identity and profile; the same model mounted at another
    # path under another name: the same identity and profile (replicas share chunks and the profile)
    other = model_card(_settings(write_model(models / "tiny-llama-seed1", smollm2_folder, seed=1), tmp_path / "c2"))
    assert other.model_id.split("@")[1] != card.model_id.split("@")[1]
    again = model_card(_settings(write_model(tmp_path / "mounted" / "elsewhere", smollm2_folder), tmp_path / "c3"))
    assert (again.model_id, again.codec_profile) == (card.model_id, card.codec_profile)


def test_the_embedded_models_own_folder_is_the_embedded_model(smollm2_folder, tmp_path):
    by_folder = model_card(Settings.load({"model": str(smollm2_folder), "model_cache": str(SMOLLM2_CACHE)}, env={}))
    assert by_folder == model_card(Settings.load({"model_cache": str(SMOLLM2_CACHE)}, env={}))
    # a copy under another name and path (its files linked): the same identity and shipped profile
    import os
    import shutil

    copy = shutil.copytree(smollm2_folder, tmp_path / "mnt" / "my-model", copy_function=os.symlink)
    by_copy = model_card(Settings.load({"model": str(copy), "model_cache": str(tmp_path / "cache")}, env={}))
    assert (by_copy.model_id, by_copy.codec_profile) == (by_folder.model_id, by_folder.codec_profile)


def test_the_model_setting_is_read_from_the_environment_and_passed_on(models, smollm2_folder, tmp_path):
    folder = write_model(models / "tiny-llama", smollm2_folder)
    s = Settings.load({}, env={"KVCODEC_MODEL": str(folder), "KVCODEC_HOME": str(tmp_path)})
    assert s.model == folder.resolve() and s.environ()["KVCODEC_MODEL"] == str(folder.resolve())
    assert Settings.load(env=s.environ()) == s
    assert Settings.load({}, env={"KVCODEC_HOME": str(tmp_path)}).model is None
    with pytest.raises(ConfigError, match="model must be a Hugging Face model folder"):
        Settings.load({"model": str(tmp_path)}, env={})


def test_an_unsupported_architecture_or_no_safetensors_is_refused(models, smollm2_folder, tmp_path):
    folder = tmp_path / "bert"
    folder.mkdir()
    config = json.loads((write_model(models / "tiny-llama", smollm2_folder) / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, architectures=["BertForMaskedLM"])))
    with pytest.raises(Unsupported, match="architecture 'BertForMaskedLM' is not supported"):
        model_card(_settings(folder, tmp_path / "cache"))
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(Unsupported, match="no \\*.safetensors"):
        model_card(_settings(folder, tmp_path / "cache"))


def test_a_rung_that_needs_a_profile_is_refused_until_one_is_fitted(models, smollm2_folder, tmp_path, capsys):
    folder = write_model(models / "tiny-llama", smollm2_folder)
    settings = _settings(folder, tmp_path / "cache")
    card = model_card(settings)
    require_profiles(parse_ladder("raw,int8-zstd,cachegen", card))  # these need none
    for rung in ("kvtc-w", "video", "transform-zstd", "kvtc"):
        with pytest.raises(ConfigError, match=f"not fitted yet.*kvcodec profile fit --model {folder.resolve()}"):
            require_profiles(parse_ladder(rung, card))
    # the CLI says it in one line, before the model loads; the default ladder starts with kvtc-w
    text = tmp_path / "t.txt"
    text.write_text("hello " * 400)
    code = cli.main(["ingest", "--model", str(folder), "--model-cache", str(tmp_path / "cache"),
                     "--home", str(tmp_path / "home"), "--text-file", str(text), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "kvcodec ingest: codec profile" in err and "kvcodec profile fit --model" in err
    # serve starts (the fetch misses those rungs) and says why in one line
    assert tritonserver._warn_unfitted(settings) == ""
    assert "kvcodec serve: warning: codec profile" in capsys.readouterr().err
    # --require-profiles (the containers' entrypoint): an error, and serve does not start
    assert "not fitted yet" in tritonserver._warn_unfitted(settings, refuse=True)
    assert "kvcodec serve: error: codec profile" in capsys.readouterr().err
    parsed = cli.build_parser().parse_args(["serve", "--require-profiles"])
    assert parsed.require_profiles and not cli.build_parser().parse_args(["serve"]).require_profiles
    # a fitted profile file where the card looks for it ends the refusal
    from kvcodec.engines.model_files import profile_path

    path = profile_path(tmp_path / "cache", card.codec_profile)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"fitted")
    assert find_profile(card.codec_profile) == path
    require_profiles(parse_ladder("kvtc-w,video", card))
    tritonserver._warn_unfitted(settings)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_the_transformers_engine_runs_each_family_and_raw_kv_gives_its_own_tokens(models, smollm2_folder, tmp_path,
                                                                                  family):
    folder = write_model(models / f"tiny-{family}", smollm2_folder, family=family)
    settings = _settings(folder, tmp_path / "cache")
    engine = open_engine(settings)
    assert engine.card == model_card(settings) and engine.geometry(1).shape == (4, 2, 2, 1, 32)
    ids = Tokenizer(files_for(settings)).encode("def f(x):\n    return x * 2\n" * 60)[:540]
    assert engine.tokenize("def f(x):") == ids[:len(engine.tokenize("def f(x):"))]
    kv = np.concatenate(list(engine.prefill_chunks(ids, 256)), axis=3)
    assert kv.shape == (4, 2, 2, 512, 32) and kv.dtype == np.float32
    prefill = list(engine.stream(ids, 6))
    assert list(engine.stream(ids, 6, past_kv=kv)) == prefill
    assert list(engine.stream(ids, 6, past_kv=np.zeros_like(kv))) != prefill  # the KV is what it answers from


def test_a_sliding_window_caps_the_context_below_it(models, smollm2_folder, tmp_path):
    """A cache with a window keeps its last ``window - 1`` tokens only: the card's context stays below."""
    source = write_model(models / "tiny-mistral", smollm2_folder, family="mistral")
    folder = tmp_path / "tiny-mistral-window"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, sliding_window=1024)))
    assert model_card(_settings(folder, tmp_path / "cache")).max_context == 1023


def test_the_engines_tokenizer_function_is_not_shadowed_by_its_submodule():
    import importlib
    import types

    import kvcodec.engines.tokenizer  # noqa: F401  (a first import of the submodule once replaced the function)

    engines = importlib.import_module("kvcodec.engines")
    assert isinstance(engines.tokenizer, types.ModuleType)  # the submodule; the function has its own name
    from kvcodec.engines import open_tokenizer

    assert callable(open_tokenizer) and open_tokenizer.__module__ == "kvcodec.engines"


@pytest.mark.parametrize("command", [["serve"], ["ingest", "--text-file", "t"], ["generate", "--text-file", "t"],
                                     ["eval", "--text-file", "t"], ["rd"], ["eval-task"], ["demo"],
                                     ["profile", "fit"], ["profile", "weigh", "--base", "b", "--out", "o"],
                                     ["bench", "ttft"], ["bench", "concurrency"], ["soak"]],
                         ids=lambda c: "-".join(c[:2]).replace("--text-file", "").strip("-"))
def test_every_command_that_loads_a_model_takes_model(models, smollm2_folder, command):
    folder = write_model(models / "tiny-llama", smollm2_folder)
    args = cli.build_parser().parse_args([*command, "--model", str(folder), "--home", str(models / "home")])
    assert cli._settings(args).model == folder.resolve()
