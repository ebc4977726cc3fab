"""The reference engine (``transformers``): a Hugging Face causal LM on the CPU (or a GPU),
dense cache, one request at a time; the settings' model folder or the embedded
SmolLM2-135M-Instruct (``model_files``). It keeps the contract of ``kvcodec.engines``.

- ``tokenize(text)``: the model's token ids (no special tokens added);
- ``prefill_chunks(ids, chunk_tokens)``: runs prefill chunk by chunk and yields each chunk's KV
  as float32 ``[layers, 2, kv_heads, chunk_tokens, head_dim]`` (used by ingest);
- ``stream(ids, max_tokens, past_kv=None, sampling=GREEDY)``: yields token ids one by one (picked
  as ``sampling`` asks, ``engines.torch_sampler``: every field of ``engines.Sampling``); with
  ``past_kv`` (the KV of ``ids[:n]``, float16 or float32) only ``ids[n:]`` is computed. At least
  one token must be left to compute. The model runs in float32 (card ``kv_dtype``): float32 KV
  from ``raw`` is its own, exactly.
- Write-back (``Settings.writeback``, default the ladder's first rung; ``off``: none), as every
  engine: once the first token is out, the prompt's full chunks past ``past_kv`` are copied out of
  the cache and handed to the ``connector.WriteBackSink`` (encoded and stored on its thread; a
  full queue drops, counted); ``report.saved_chunks`` says how many it took.
"""
from __future__ import annotations

import inspect
from typing import Iterator, List, Optional, Sequence

import numpy as np

from ..errors import BadRequest
from ..format.geometry import Geometry
from ..serving.sampling import ENGINE_FIELDS, GREEDY, Sampling
from . import ModelCard, StreamReport, model_files
from .model_files import ModelFiles
from .tokenizer import IncrementalDetokenizer


class TransformersEngine(model_files.EngineFiles):
    name = "transformers"
    max_concurrency = 1  # one request at a time (a dense cache per request, no batching)
    sampling_fields = ENGINE_FIELDS  # every field but stop_words (serving.generate's), by engines.torch_sampler
    takes_session = False  # a dense cache: the llm step gives it the whole restored prefix at once

    @classmethod
    def model_card(cls, settings) -> ModelCard:
        return model_files.card_for(settings)

    @classmethod
    def from_settings(cls, settings, device: str = "cpu") -> "TransformersEngine":
        from ..compose import open_writes

        engine = cls(model_files.files_for(settings), threads=settings.threads or None, device=device)
        engine.writeback = open_writes(settings, cls.model_card(settings))
        return engine

    def __init__(self, files: ModelFiles, threads: Optional[int] = None, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from .tokenizer import Tokenizer

        if threads:
            torch.set_num_threads(int(threads))
        self._torch = torch
        self.files = files
        self.model_id = files.model_id
        self.device = torch.device(device)
        self.tokenizer = Tokenizer(files)
        self.model = AutoModelForCausalLM.from_pretrained(files.path, dtype=torch.float32).to(self.device).eval()
        # transformers 5.20+ names the cache argument ``cache`` (``past_key_values`` is deprecated and
        # warns); the vLLM venv pins an older transformers that only knows ``past_key_values``
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        cfg = self.model.config
        if files.card is None:  # the embedded model
            model_files.check_config(cfg.to_dict())
        self.card = files.card or model_files.card(files.path.parent)
        self.layers = int(cfg.num_hidden_layers)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.eos_token_id = self.tokenizer.eos_token_id
        rope = getattr(cfg, "rope_parameters", None) or {}
        self.rope_theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))

    def geometry(self, tokens: int) -> Geometry:
        return Geometry(layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim, tokens=tokens)

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer.encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer.decode)

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _cache_to_numpy(self, cache, start: int, end: int) -> np.ndarray:
        layers = []
        for layer in cache.layers:
            k = layer.keys[0, :, start:end, :]
            v = layer.values[0, :, start:end, :]
            layers.append(self._torch.stack([k, v]))
        return self._torch.stack(layers).float().cpu().numpy()

    def prefill_chunks(self, ids: Sequence[int], chunk_tokens: int) -> Iterator[np.ndarray]:
        """KV of each full chunk of ``ids``, computed incrementally."""
        torch = self._torch
        cache = self._new_cache()
        with torch.inference_mode():
            for start in range(0, len(ids) - chunk_tokens + 1, chunk_tokens):
                x = torch.tensor([list(ids[start : start + chunk_tokens])], device=self.device)
                self.model(input_ids=x, **{self._cache_arg: cache}, use_cache=True)
                yield self._cache_to_numpy(cache, start, start + chunk_tokens)

    def continuation_logprobs(self, past_kv: np.ndarray, ids: Sequence[int]) -> np.ndarray:
        """Log-probabilities ``[len(ids), vocab]`` of the next token after each of ``ids``, run on
        ``past_kv`` (the KV of the tokens before them), teacher-forced."""
        torch = self._torch
        cache = self._cache_from(past_kv)
        x = torch.tensor([list(ids)], device=self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=x, **{self._cache_arg: cache}, use_cache=True).logits[0]
        return torch.log_softmax(logits.float(), dim=-1).cpu().numpy()

    def _cache_from(self, past_kv: np.ndarray):
        want = self.geometry(past_kv.shape[3]).shape
        if tuple(past_kv.shape) != want:
            raise BadRequest(f"restored KV has shape {tuple(past_kv.shape)}, the model needs {want}")
        torch = self._torch
        cache = self._new_cache()
        # one copy, also from a strided view (none for float32 on the CPU: the cache only reads it)
        kv = torch.from_numpy(past_kv).to(self.device, torch.float32)
        for layer in range(self.layers):
            cache.update(kv[layer, 0][None], kv[layer, 1][None], layer)
        return cache

    def stream(self, ids: Sequence[int], max_tokens: int, past_kv: Optional[np.ndarray] = None,
               report: Optional[StreamReport] = None, sampling: Sampling = GREEDY, salt: str = "") -> Iterator[int]:
        from .torch_sampler import TokenPicker

        torch = self._torch
        if len(ids) == 0:
            raise BadRequest("prompt is empty")
        end_id = self.eos_token_id if sampling.end_id is None else sampling.end_id
        picker = TokenPicker(sampling, ids, end_id, [self.tokenize(w) for w in sampling.bad_words], self.device)
        cache = self._new_cache()
        start = 0
        if past_kv is not None and past_kv.shape[3] > 0:
            start = past_kv.shape[3]
            if start >= len(ids):
                raise BadRequest("restored KV covers the whole prompt; at least one token must be computed")
            cache = self._cache_from(past_kv)
        if report is not None:
            report.reused_tokens = start
        x = torch.tensor([list(ids[start:])], device=self.device)
        with torch.inference_mode():
            for step in range(max_tokens):
                logits = self.model(input_ids=x, **{self._cache_arg: cache}, use_cache=True).logits
                token = picker.pick(logits[0, -1])
                yield token
                if step == 0:  # the prompt's KV is in the cache and the first token is out
                    self._save(ids, start, cache, report, salt)
                if token == end_id:
                    return
                x = torch.tensor([[token]], device=self.device)

    def _save(self, ids: Sequence[int], start: int, cache, report: Optional[StreamReport], salt: str = "") -> None:
        """Hand the prompt's full chunks computed here (past ``start``) to the write-back sink (under
        the keys of cache salt ``salt``: the request's tenant's)."""
        if self.writeback is None:
            return
        c = self.writeback.saver.chunk_tokens
        first = -(-start // c)  # the chunks before ``start`` came from the store
        chunks = [(i, i * c, self._cache_to_numpy(cache, i * c, (i + 1) * c)) for i in range(first, len(ids) // c)]
        saved = self.writeback.for_prompt(ids, salt)(chunks) if chunks else 0
        if report is not None:
            report.saved_chunks = saved
