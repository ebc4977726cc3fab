"""A tiny Llama with SmolLM2-135M's KV geometry and vocabulary, for the engine check on the lent GPU.

The real model (a 98 MB GGUF, 538 MB converted) does not fit the 64 MiB a device call carries.
This one has the same KV geometry (30 layers, 3 KV heads, head_dim 64: the ``smollm2-135m-v1``
codec profile fits it, so every rung applies), the same vocabulary (49152: SmolLM2's own
tokenizer files are copied in) and the same RoPE theta; hidden 192 (3 attention heads of 64),
intermediate 64, tied embeddings.

Its weights are made by numpy from a seed, so they are the same bytes on every machine whatever
torch does: each a normal draw rounded to a fifth of its std, the embeddings' to their std (few
distinct values, so the packed folder, ``tar.xz``, is about 6 MB of its 33.5). The stds are chosen so that the model depends on its
context (Hugging Face's uniform 0.02 gives near-uniform attention and one token repeated whatever
the prompt): queries and keys 0.2 (peaked attention), values and outputs 0.1, MLP 0.05,
embeddings 0.02. Greedy decoding then gives varied tokens that change with the KV (the dry run
checks it: the KV of another text changes them).

``build(dest, tokenizer_dir)`` writes the folder ``dest/smollm2-135m-instruct`` (the engine reads
its card from a folder of that name beside the weights: ``engines.model_files.card``);
``pack`` / ``unpack`` turn it into one archive and back.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
from pathlib import Path
from typing import Dict

import numpy as np

FOLDER = "smollm2-135m-instruct"  # engines.model_files.FOLDER: where the engine reads its card
NAME = "tiny-llama-smollm2-kv"
SEED = 20260
STD = {"embed": 0.02, "qk": 0.2, "vo": 0.1, "mlp": 0.05}
# a weight is k * std / levels, k an integer: the embeddings (half the weights) coarser still
LEVELS = {"embed": 1.0, "qk": 2.5, "vo": 2.5, "mlp": 2.5}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
CONFIG: Dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 192,
    "intermediate_size": 64,
    "num_hidden_layers": 30,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "initializer_range": STD["embed"],
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "use_cache": True,
    "dtype": "float16",
}


def weights(seed: int = SEED) -> Dict[str, np.ndarray]:
    """The state dict (float16, tied ``lm_head`` left out), from ``seed`` alone."""
    c = CONFIG
    hidden, inter, layers = int(c["hidden_size"]), int(c["intermediate_size"]), int(c["num_hidden_layers"])
    q_out = int(c["num_attention_heads"]) * int(c["head_dim"])
    kv_out = int(c["num_key_value_heads"]) * int(c["head_dim"])
    rng = np.random.default_rng(seed)

    def normal(group: str, *shape: int) -> np.ndarray:
        return (np.rint(rng.normal(0.0, LEVELS[group], shape)) * (STD[group] / LEVELS[group])).astype(np.float16)

    out = {"model.embed_tokens.weight": normal("embed", int(c["vocab_size"]), hidden),
           "model.norm.weight": np.ones(hidden, np.float16)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = normal("qk", q_out, hidden)
        out[p + "self_attn.k_proj.weight"] = normal("qk", kv_out, hidden)
        out[p + "self_attn.v_proj.weight"] = normal("vo", kv_out, hidden)
        out[p + "self_attn.o_proj.weight"] = normal("vo", hidden, q_out)
        out[p + "mlp.gate_proj.weight"] = normal("mlp", inter, hidden)
        out[p + "mlp.up_proj.weight"] = normal("mlp", inter, hidden)
        out[p + "mlp.down_proj.weight"] = normal("mlp", hidden, inter)
        out[p + "input_layernorm.weight"] = np.ones(hidden, np.float16)
        out[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float16)
    return out


def build(dest: Path, tokenizer_dir: Path, seed: int = SEED) -> Path:
    """Write the model folder ``dest/FOLDER`` (weights, config, tokenizer, identity); returns it."""
    from safetensors.numpy import save_file

    folder = Path(dest) / FOLDER
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    save_file(weights(seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2))
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copyfile(Path(tokenizer_dir) / name, folder / name)
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    marker = {"model_id": f"{NAME}@seed{seed}-sha256:{digest[:16]}", "source": f"tests/gpu/tiny_model.py seed {seed}"}
    (folder / "kvcodec-model.json").write_text(json.dumps(marker))  # engines.model_files._READY
    return folder


def model_id(folder: Path) -> str:
    return json.loads((Path(folder) / "kvcodec-model.json").read_text())["model_id"]


def pack(folder: Path, archive: Path) -> None:
    """``folder`` as one ``tar.xz`` (members under ``FOLDER/``, sorted, no owners or times)."""
    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    tmp = Path(str(archive) + ".tmp")
    with tarfile.open(tmp, "w:xz", preset=3) as tar:
        for path in sorted(Path(folder).iterdir()):
            tar.add(path, arcname=f"{FOLDER}/{path.name}", filter=clean)
    tmp.replace(archive)


def unpack(archive: Path, dest: Path) -> Path:
    """Unpack ``archive`` under ``dest``; returns the model folder ``dest/FOLDER``."""
    dest = Path(dest)
    shutil.rmtree(dest / FOLDER, ignore_errors=True)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        names = tar.getnames()
        if any(not n.startswith(FOLDER + "/") or ".." in n for n in names):
            raise ValueError(f"{archive}: unexpected members {names[:5]}")
        tar.extractall(dest, filter="data")
    return dest / FOLDER
