"""Model repository variants, derived from the committed one (``model_repository/``, the CPU variant).

``render(source, out, variant)`` writes a complete repository: every step's ``config.pbtxt``
parsed with Triton's own schema (``model_config_pb2``), changed as the variant says, written back
(with a header naming where it came from), and every ``1/model.py`` copied unchanged. So a variant
can never drift from the CPU repository's wiring: it is the same configs, transformed.

Variants (``VARIANTS``):

- ``cpu``: the committed repository as it is;
- ``gpu``: ``kv_decode``, ``kv_restore`` and ``llm`` run as KIND_GPU instances on the GPUs given
  (default ``[0]``), take their inputs where they are (``FORCE_CPU_ONLY_INPUT_TENSORS: "no"``, so
  tensors arrive as DLPack-able device buffers and ``kvcodec.triton.get_array`` copies to the host
  only where a step needs numpy), and ``kv_decode`` decodes with NVDEC (``decoder: "nvdec"``; the
  GPU id comes from the instance). ``kv_fetch`` stays on the CPU: it waits on the network.
- ``trtllm``: the user's ensemble fed into TensorRT-LLM: the gpu variant's kv_fetch -> kv_decode
  (NVDEC) -> kv_restore, and an ``llm`` step (``engine: "trtllm"``, ``kvcodec.engines.trtllm_engine``)
  that hosts TensorRT-LLM's LLM API in its own process (``TLLM_WORKER_USE_SINGLE_PROCESS=1``) and
  stages each request's restored chunks for our KV connector, which promises TensorRT-LLM exactly
  those tokens. Choose it to get the pipelined read path (chunks decoded on NVDEC while later ones
  are on the wire) on the first request of a prefix.
- ``trtllm-llmapi``: TensorRT-LLM 1.2's own LLM-API model (``tensorrt_llm``, from NVIDIA's
  ``triton_backend/all_models/llmapi``) alone, unmodified, with our connector named in its
  ``1/model.yaml``: ``tensorrt_llm/config.pbtxt`` (KIND_CPU as NVIDIA's is: TensorRT-LLM places itself
  on the GPU; decoupled; the LLM-API model's inputs and outputs: ``text_input`` in, ``text_output``
  out), ``1/model.yaml`` (backend pytorch, block reuse on, ``tokens_per_block``, the connector),
  ``1/kvcodec-trtllm.json`` (the connector's settings, the file ``TRTLLM_KVCODEC_CONFIG`` names) and
  ``README.txt``. Its ``1/model.py`` and ``1/helpers.py`` are TensorRT-LLM's, copied from the
  container (``TRTLLM_MODEL_PY``). Here the connector reads the store itself, never on
  TensorRT-LLM's executor thread: a prompt whose prefix is not yet staged is computed while its
  stored chunks are read into the stage in the background (``prefetch``), and the prompts that
  follow with that prefix reuse it. Choose it to keep NVIDIA's model untouched.

``instances`` (``--instances kv_decode=2,kv_restore=2``) sets the ``instance_group`` count of steps
(per GPU on the gpu variant): ``kv_fetch``, ``kv_decode`` and ``kv_restore`` hold no state across
calls and take any count; ``llm`` runs as one instance (the chunks of a request meet in it, and its
engine batches the requests; its model refuses to load as several), and so does the gpu variant's
``llm``: on the first GPU given only.

``kvcodec repository --variant gpu --out DIR`` writes one into a new or empty folder, or replaces one it
wrote before (the ``MARKER`` file it leaves says so); it refuses any other folder and deletes nothing of
it (a model mounted there survives). ``tests/unit/test_model_repository.py``
checks every variant with the same schema and wiring tests as the committed repository.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from kvcodec.errors import ConfigError

ON_GPU = ("kv_decode", "kv_restore", "llm")
SCALABLE = ("kv_fetch", "kv_decode", "kv_restore")  # stateless across calls: any instance count
SINGLE_INSTANCE = "llm"
MAX_INSTANCES = 64
TRTLLM_MODEL = "tensorrt_llm"  # the LLM-API model's name in NVIDIA's repository and in ours
TRTLLM_CONFIG_FILE = "kvcodec-trtllm.json"
# Written into every repository this tool makes: the one sign that lets a later run replace the folder.
# A folder without it is never deleted (it may be a model mounted there, or someone's own files).
MARKER = ".kvcodec-repository"
_MARKER_TEXT = ("Written by `kvcodec repository --variant {variant}`. This file lets the tool replace this folder's\n"
                "content when it writes a repository here again; a folder without it is never deleted.\n")
# Where the NGC container (nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3) keeps TensorRT-LLM's
# LLM-API model; the same files are triton_backend/all_models/llmapi/tensorrt_llm/1/ in NVIDIA/TensorRT-LLM.
TRTLLM_MODEL_PY = "/app/all_models/llmapi/tensorrt_llm/1"
_T = model_config_pb2
# The LLM-API model's inputs and outputs as TensorRT-LLM 1.2's llmapi config.pbtxt and model.py have them
# (the subset both its 1.x model.py versions read and send): a prompt as text, sampling parameters, text out.
TRTLLM_INPUTS = (
    ("text_input", _T.TYPE_STRING, [-1], False),
    ("streaming", _T.TYPE_BOOL, [1], True),
    ("sampling_param_best_of", _T.TYPE_INT32, [1], True),
    ("sampling_param_temperature", _T.TYPE_FP32, [1], True),
    ("sampling_param_top_k", _T.TYPE_INT32, [1], True),
    ("sampling_param_top_p", _T.TYPE_FP32, [1], True),
    ("sampling_param_frequency_penalty", _T.TYPE_FP32, [1], True),
    ("sampling_param_presence_penalty", _T.TYPE_FP32, [1], True),
    ("sampling_param_max_tokens", _T.TYPE_INT32, [1], True),
    ("sampling_param_stop", _T.TYPE_STRING, [-1], True),
    ("sampling_param_seed", _T.TYPE_UINT64, [1], True),
    ("sampling_param_exclude_input_from_output", _T.TYPE_BOOL, [1], True),
    ("return_finish_reason", _T.TYPE_BOOL, [1], True),
    ("return_stop_reason", _T.TYPE_BOOL, [1], True),
    ("return_cumulative_logprob", _T.TYPE_BOOL, [1], True),
)
TRTLLM_OUTPUTS = (
    ("text_output", _T.TYPE_STRING, [-1]),
    ("finish_reason", _T.TYPE_STRING, [-1]),
    ("stop_reason", _T.TYPE_STRING, [-1]),
    ("cumulative_logprob", _T.TYPE_FP32, [-1]),
)


def load(path: Path) -> "model_config_pb2.ModelConfig":
    return text_format.Parse(Path(path).read_text(), model_config_pb2.ModelConfig())


def _set_parameter(cfg, key: str, value: str) -> None:
    cfg.parameters[key].string_value = value


def _gpu_group(cfg, gpus: Sequence[int]) -> None:
    del cfg.instance_group[:]
    group = cfg.instance_group.add()
    group.kind = model_config_pb2.ModelInstanceGroup.KIND_GPU
    group.count = 1
    group.gpus.extend(int(g) for g in gpus)


def _cpu(committed: Dict[str, Any], gpus: Sequence[int]) -> Dict[str, Any]:
    return committed


def _gpu(committed: Dict[str, Any], gpus: Sequence[int]) -> Dict[str, Any]:
    for name, cfg in committed.items():
        if name not in ON_GPU:
            continue
        _gpu_group(cfg, gpus[:1] if name == SINGLE_INSTANCE else gpus)
        _set_parameter(cfg, "FORCE_CPU_ONLY_INPUT_TENSORS", "no")
        if name == "kv_decode":
            _set_parameter(cfg, "decoder", "nvdec")
    return committed


def _one_gpu(gpus: Sequence[int], variant: str) -> None:
    if len(gpus) != 1:
        raise ConfigError(f"the {variant} variant runs on one GPU (the connector refuses tensor and pipeline "
                          f"parallelism), got --gpus {','.join(str(g) for g in gpus) or '(none)'}")


def trtllm_model_config(gpus: Sequence[int] = (0,)) -> "model_config_pb2.ModelConfig":
    """``tensorrt_llm/config.pbtxt``: the LLM-API model, KIND_CPU as NVIDIA's (TensorRT-LLM places itself
    on the GPU: ``CUDA_VISIBLE_DEVICES`` picks it), decoupled, no batch dimension (``max_batch_size``
    and ``decoupled`` equal to ``model.yaml``'s ``triton_config``, so the model's
    ``auto_complete_config`` finds nothing to change, and ``--disable-auto-complete-config`` loses nothing)."""
    _one_gpu(gpus, "trtllm-llmapi")
    cfg = model_config_pb2.ModelConfig(name=TRTLLM_MODEL, backend="python", max_batch_size=0)
    cfg.model_transaction_policy.decoupled = True
    for name, dtype, dims, optional in TRTLLM_INPUTS:
        cfg.input.add(name=name, data_type=dtype, dims=dims, optional=optional)
    for name, dtype, dims in TRTLLM_OUTPUTS:
        cfg.output.add(name=name, data_type=dtype, dims=dims)
    group = cfg.instance_group.add()
    group.kind = model_config_pb2.ModelInstanceGroup.KIND_CPU
    group.count = 1
    return cfg


def _trtllm_llmapi(committed: Dict[str, Any], gpus: Sequence[int]) -> Dict[str, Any]:
    return {TRTLLM_MODEL: trtllm_model_config(gpus)}


def _trtllm(committed: Dict[str, Any], gpus: Sequence[int]) -> Dict[str, Any]:
    """The gpu variant's ensemble with TensorRT-LLM as the llm step's engine (one GPU)."""
    _one_gpu(gpus, "trtllm")
    rendered = _gpu(committed, gpus)
    _set_parameter(rendered[SINGLE_INSTANCE], "engine", "trtllm")
    return rendered


# variant name -> (the committed configs by step name, GPU ids) -> the variant's configs by model name
VARIANTS: Dict[str, Callable[[Dict[str, Any], Sequence[int]], Dict[str, Any]]] = {
    "cpu": _cpu,
    "gpu": _gpu,
    "trtllm": _trtllm,
    "trtllm-llmapi": _trtllm_llmapi,
}


def configs(source: Path, variant: str, gpus: Sequence[int] = (0,),
            instances: Optional[Mapping[str, int]] = None) -> Dict[str, "model_config_pb2.ModelConfig"]:
    """Each model's config in ``variant``, by model name, with ``instances``' counts set."""
    if variant not in VARIANTS:
        raise ConfigError(f"repository variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    committed = {path.parent.name: load(path) for path in sorted(Path(source).glob("*/config.pbtxt"))}
    if not committed:
        raise ConfigError(f"no config.pbtxt under {source}")
    rendered = VARIANTS[variant](committed, gpus)
    for name, count in (instances or {}).items():
        _set_instances(rendered, name, count)
    return rendered


def _set_instances(rendered: Dict[str, Any], name: str, count: int) -> None:
    if name == SINGLE_INSTANCE and count != 1:
        raise ConfigError(f"{name} runs as one instance (a request's chunks meet in it, and its engine batches the "
                          f"requests), got {count}; give {', '.join(SCALABLE)} more instances instead")
    if name not in SCALABLE and name != SINGLE_INSTANCE:
        raise ConfigError(f"--instances names a step: one of {', '.join(SCALABLE + (SINGLE_INSTANCE,))}, got {name!r}")
    if name not in rendered:
        raise ConfigError(f"the repository has no {name} step to give instances (the trtllm-llmapi variant has none)")
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_INSTANCES:
        raise ConfigError(f"{name}'s instance count must be an integer in 1..{MAX_INSTANCES}, got {count!r}")
    for group in rendered[name].instance_group:
        group.count = count


def parse_instances(text: str) -> Dict[str, int]:
    """``kv_decode=2,kv_restore=2`` -> ``{"kv_decode": 2, "kv_restore": 2}``."""
    out: Dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, count = item.partition("=")
        if not sep or not count.strip().isdigit():
            raise ConfigError(f"--instances takes STEP=COUNT[,STEP=COUNT...], got {item!r}")
        out[name.strip()] = int(count)
    return out


# -- the trtllm variant's files --------------------------------------------------------------------
def trtllm_card(settings):
    """The project's model as TensorRT-LLM computes it: float16 KV, an identity of its own (as
    ``trtllm_config.load_config`` makes it without a config file)."""
    from kvcodec.engines.trtllm_engine import TrtllmEngine

    return TrtllmEngine.model_card(settings)  # the settings' model (``--model``), as the ensemble's engine sees it


def trtllm_settings(settings, card) -> Dict[str, Any]:
    """The ``TRTLLM_KVCODEC_CONFIG`` file's content (``kvcodec.engines.trtllm_config.from_mapping``)."""
    return {"store": settings.store, "ladder": list(settings.ladder), "chunk_tokens": settings.chunk_tokens,
            "writeback": list(settings.writeback) or "off", "key_file": str(settings.key_file),
            "decoder": settings.decoder, "threads": max(1, settings.threads),
            "fetch_timeout_s": settings.fetch_timeout_s, "model": asdict(card)}


def trtllm_model_yaml(model: str, tokens_per_block: int = 32) -> Dict[str, Any]:
    """``1/model.yaml``: every key but ``triton_config`` is an ``LLM()`` argument (TorchLlmArgs): the
    same arguments the ensemble's engine passes (``trtllm_engine.llm_arguments``). CUDA graphs stay
    on (TensorRT-LLM's default): the connector runs with them from 1.2.0rc2 on (PR #8275) and says at
    start, on older releases, to add ``cuda_graph_config: null``."""
    from kvcodec.engines.trtllm_engine import llm_arguments

    if tokens_per_block <= 0:
        raise ConfigError(f"tokens_per_block must be positive, got {tokens_per_block}")
    return dict(llm_arguments(model, tokens_per_block), triton_config={"max_batch_size": 0, "decoupled": True})


def _yaml(data: Mapping[str, Any], indent: int = 0) -> str:
    """A mapping of mappings, strings, numbers and booleans as YAML (the JSON-compatible subset:
    strings double-quoted as JSON writes them), so no YAML library is needed to write it."""
    lines = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            lines.append(f"{' ' * indent}{key}:")
            lines.append(_yaml(value, indent + 2))
        elif isinstance(value, (str, bool, int, float)):
            lines.append(f"{' ' * indent}{key}: {json.dumps(value)}")
        else:
            raise ConfigError(f"model.yaml: {key} has a value YAML is not written for here: {value!r}")
    return "\n".join(lines)


_README = """\
tensorrt_llm: TensorRT-LLM's LLM-API model, with the KVCodec KV cache connector
(written by `kvcodec repository --variant trtllm-llmapi`; regenerate rather than edit).

1/model.py and 1/helpers.py are NOT here: they are TensorRT-LLM's, and must match the
tensorrt_llm inside the container. Copy them from the NGC container
(nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3):

    cp {model_py}/model.py {model_py}/helpers.py <this folder>/1/

(or from triton_backend/all_models/llmapi/tensorrt_llm/1/ of NVIDIA/TensorRT-LLM at the tag
that `python3 -c "import tensorrt_llm; print(tensorrt_llm.__version__)"` prints). Keep this
folder's config.pbtxt and 1/model.yaml.

Before `tritonserver --model-repository <repository>`:

    export TRTLLM_KVCODEC_CONFIG=<this folder>/1/{config_file}
    export TRTLLM_KVCODEC_CHUNK_KEY=<the chunk key, hex>   # or the key_file the JSON names

TensorRT-LLM's worker processes receive only TLLM_*/TRTLLM_* variables: KVCODEC_* do not
reach the connector. See docs/deploy-trtllm.md.
"""


def _write_trtllm(out: Path, settings, card, model: Optional[str], tokens_per_block: int) -> None:
    from kvcodec.engines import model_files

    settings = settings if settings is not None else _default_settings()
    card = card if card is not None else trtllm_card(settings)
    model = model or str(settings.model or Path(settings.model_cache) / model_files.FOLDER)
    version = out / TRTLLM_MODEL / "1"
    version.mkdir(parents=True, exist_ok=True)
    (version / "model.yaml").write_text(
        "# Generated by `kvcodec repository --variant trtllm-llmapi`: TensorRT-LLM's LLM() arguments, with the\n"
        "# KVCodec connector (kvcodec.engines.trtllm_connector; its settings: TRTLLM_KVCODEC_CONFIG).\n"
        + _yaml(trtllm_model_yaml(model, tokens_per_block)) + "\n")
    (version / TRTLLM_CONFIG_FILE).write_text(json.dumps(trtllm_settings(settings, card), indent=2) + "\n")
    (out / TRTLLM_MODEL / "README.txt").write_text(
        _README.format(model_py=TRTLLM_MODEL_PY, config_file=TRTLLM_CONFIG_FILE))


def _default_settings():
    from kvcodec.settings import Settings

    return Settings.load()


def render(source: Path, out: Path, variant: str, gpus: Sequence[int] = (0,), settings=None, card=None,
           model: Optional[str] = None, tokens_per_block: int = 32,
           instances: Optional[Mapping[str, int]] = None) -> Path:
    """Write the ``variant`` repository of ``source`` to ``out``: a new or empty folder, or one an
    earlier run wrote (it holds ``MARKER``; its content is replaced). Any other folder is refused
    (``ConfigError``) and left as it is: the tool never deletes what it did not make.

    ``settings``, ``card``, ``model`` and ``tokens_per_block`` are the ``trtllm-llmapi`` variant's: the
    connector's settings (default ``Settings.load()``), the model card (default ``trtllm_card``),
    what ``model.yaml`` loads (default the project's converted model folder) and the KV block size."""
    source, out = Path(source).resolve(), Path(out).resolve()
    if out == source:
        raise ConfigError("the variant would overwrite its source repository")
    rendered = configs(source, variant, gpus, instances)
    _clear(out, source)
    for name, cfg in rendered.items():
        (out / name).mkdir(parents=True)
        if (source / name).is_dir():
            origin = (f" from {source.name}/{name}/config.pbtxt\n"
                      f"# (see that file for what each field means); do not edit: regenerate.\n")
        else:
            origin = (f": TensorRT-LLM 1.2's LLM-API model\n"
                      f"# (the inputs and outputs of NVIDIA's all_models/llmapi/{name}/config.pbtxt), one GPU, decoupled.\n"
                      f"# 1/model.py and 1/helpers.py are TensorRT-LLM's: copy them from {TRTLLM_MODEL_PY}\n"
                      f"# (README.txt). Do not edit: regenerate.\n")
        counts = "".join(f" --instances {k}={v}" for k, v in (instances or {}).items() if k == name)
        header = f"# Generated by `kvcodec repository --variant {variant}{counts}`{origin}"
        (out / name / "config.pbtxt").write_text(header + text_format.MessageToString(cfg))
        if not (source / name).is_dir():
            continue
        for version in sorted((source / name).iterdir()):
            if version.is_dir():
                shutil.copytree(version, out / name / version.name, ignore=shutil.ignore_patterns("__pycache__"))
    if variant == "trtllm-llmapi":
        _write_trtllm(out, settings, card, model, tokens_per_block)
    (out / MARKER).write_text(_MARKER_TEXT.format(variant=variant))
    return out


def _written_before_markers(entries) -> bool:
    """Whether ``entries`` are a repository an older release of this tool wrote (before ``MARKER``):
    folders only, each with a ``config.pbtxt`` whose header says this tool generated it."""
    for entry in entries:
        config = entry / "config.pbtxt"
        if entry.is_symlink() or not entry.is_dir() or not config.is_file():
            return False
        with config.open("rb") as f:
            if not f.read(64).startswith(b"# Generated by `kvcodec repository"):
                return False
    return True


def _clear(out: Path, source: Path) -> None:
    """Make ``out`` an empty folder to write a repository into. A folder this tool wrote (it holds
    ``MARKER``) loses what it holds (the folder itself stays: it may be a mount point); an empty
    folder is used as it is; anything else (a folder of other files, a model mounted there, a file)
    is refused and left untouched. A repository an older release wrote (no marker; every folder's
    ``config.pbtxt`` headed "Generated by `kvcodec repository`") is replaced too."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError(f"--out {out} is not a folder: refusing to replace it")
    if source == out or source in out.parents or out in source.parents:
        raise ConfigError(f"--out {out} overlaps the source repository {source}")
    if not out.exists():
        out.mkdir(parents=True)
        return
    entries = list(out.iterdir())
    if not entries:
        return
    if not (out / MARKER).is_file() and not _written_before_markers(entries):
        shown = ", ".join(sorted(e.name for e in entries)[:5]) + (", ..." if len(entries) > 5 else "")
        raise ConfigError(f"--out {out} holds files this tool did not write ({shown}) and no {MARKER} marker: "
                          "refusing to delete them; give an empty or new folder (the containers use "
                          "/var/lib/kvcodec/repository), or remove that folder yourself")
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
