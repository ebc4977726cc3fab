"""A second model, written by the tests: small, randomly initialised, of another KV geometry than
SmolLM2-135M's (4 layers, 2 KV heads, head_dim 32, RoPE theta 10000 against 30 x 3 x 64, 100000),
with SmolLM2's tokenizer files. A real model for the engines (its greedy tokens are compared with
its own prefill), fixed by its seed; ``save_pretrained`` writes it as safetensors.

The weights are drawn wider than transformers' default (``initializer_range`` 0.15, not 0.02) so
that attention is sharp and the next token depends on the context: a wrong KV changes the tokens.
"""
from __future__ import annotations

import shutil
from pathlib import Path

GEOMETRY = dict(layers=4, kv_heads=2, head_dim=32)
ROPE_THETA = 10000.0
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_model(folder: Path, tokenizer_folder: Path, family: str = "llama", seed: int = 0) -> Path:
    """Write the model of ``family`` (llama, qwen2, mistral) to ``folder`` (once: an existing one is kept)."""
    import torch
    import transformers

    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    arch = ARCHITECTURES[family]
    config_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_class(
        vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=GEOMETRY["layers"],
        num_attention_heads=4, num_key_value_heads=GEOMETRY["kv_heads"], head_dim=GEOMETRY["head_dim"],
        max_position_embeddings=2048, initializer_range=0.15, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if family == "mistral":
        config.sliding_window = None  # a dense cache, as the Llama-family models the engines serve
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(torch.float32).eval()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_folder) / name).is_file():
            shutil.copy(Path(tokenizer_folder) / name, tmp / name)
    tmp.rename(folder)
    return folder
