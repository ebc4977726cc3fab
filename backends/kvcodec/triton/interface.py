"""The ensemble's request inputs, read at its door (step ``kv_fetch``) into a ``serving.Request``.

The names, types and defaults of TensorRT-LLM's Triton ensemble
(``triton_backend/all_models/inflight_batcher_llm/ensemble/config.pbtxt``), every one optional but
``max_tokens`` and one of ``text_input`` / ``input_ids``:

- ``text_input`` (STRING): the prompt, tokenized here with the served model's own tokenizer (the
  one ``kvcodec ingest`` uses: the same text reaches the same stored chunks); or ``input_ids``
  (INT32 [-1]), token ids made with that tokenizer;
- sampling (``engines.Sampling``): ``temperature``, ``top_p``, ``frequency_penalty``,
  ``presence_penalty``, ``repetition_penalty`` (FP32), ``top_k``, ``end_id``, ``min_tokens``
  (INT32), ``seed`` (UINT64), ``stop_words`` / ``bad_words`` (STRING [-1], one word each);
  ``pad_id`` (INT32) is taken and has no effect (one sequence a request: nothing is padded);
- ``stream`` (BOOL): one response per token, else one with the whole answer; absent: false for
  ``text_input`` (as TensorRT-LLM), true for ``input_ids`` (the token-id interface answers token by
  token); ``exclude_input_in_output`` (BOOL): a whole answer leaves the prompt out; absent: the
  server's ``exclude_input_in_output`` setting for ``text_input`` (false unless set, as TensorRT-LLM's
  model parameter), true for ``input_ids``; ``return_num_input_tokens`` /
  ``return_num_output_tokens`` (BOOL): the answer carries those counts;
- ``cache_salt`` (STRING): whose request it is, as vLLM's OpenAI ``cache_salt``: only chunks stored
  under the same salt are reused and its answer is written back under it (``format.keys``; absent or
  empty: unsalted, the shared keys); Triton's ``generate`` endpoints take it as a JSON field of that
  name; a KServe request parameter ``cache_salt`` is read when the input is absent (an input wins;
  whether Triton's ensemble hands request parameters to its first step is not tested here);
- ours: ``reuse`` (BOOL, absent: true), ``codecs`` (STRING, rung specs).
"""
from __future__ import annotations

from typing import Callable, List, Sequence

import numpy as np

from ..errors import BadRequest
from ..serving.request import Reply, Request
from ..serving.sampling import Sampling
from . import get_array, get_scalar, get_text, has_input, request_parameters

FLOATS = ("temperature", "top_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
INTS = ("top_k", "end_id", "min_tokens")
WORDS = ("stop_words", "bad_words")


def read_request(request, tokenize: Callable[[str], Sequence[int]], exclude_input: bool = False) -> Request:
    """The request's ``Request`` (not yet validated against the model: ``Request.validate``);
    ``exclude_input``: whether a text request that does not say gets its answer without the prompt."""
    text = _text(request, "text_input")
    if text is not None and has_input(request, "input_ids"):
        raise BadRequest("send text_input or input_ids, not both")
    if text is None and not has_input(request, "input_ids"):
        raise BadRequest("send the prompt as text_input (or its token ids as input_ids)")
    ids = np.asarray(tokenize(text), np.int32) if text is not None else get_array(request, "input_ids", np.int32,
                                                                                    ndim=1)
    by_ids = text is None
    sampling = {name: float(get_scalar(request, name, np.float32)) for name in FLOATS if has_input(request, name)}
    sampling.update((name, int(get_scalar(request, name, np.int32))) for name in INTS if has_input(request, name))
    if has_input(request, "pad_id"):
        get_scalar(request, "pad_id", np.int32)  # taken, no effect: nothing is padded
    if has_input(request, "seed"):
        sampling["seed"] = int(get_scalar(request, "seed", np.uint64))
    sampling.update((name, tuple(_words(request, name))) for name in WORDS if has_input(request, name))
    reply = Reply(stream=_flag(request, "stream", by_ids), exclude_input=_flag(request, "exclude_input_in_output", by_ids or exclude_input),
                  num_input_tokens=_flag(request, "return_num_input_tokens", False),
                  num_output_tokens=_flag(request, "return_num_output_tokens", False), sampling=Sampling(**sampling),
                  cache_salt=_salt(request))
    spec = get_text(request, "codecs").decode("utf-8", "replace") if has_input(request, "codecs") else None
    return Request(ids, int(get_scalar(request, "max_tokens", np.int32)), _flag(request, "reuse", True),
                   Request.parse_codecs(spec), reply)


def _salt(request) -> str:
    """The ``cache_salt`` input, else the request parameter of that name, else ""."""
    text = _text(request, "cache_salt")
    if text is None:
        params = request_parameters(request)
        text = params.get("cache_salt", "")
        if not isinstance(text, str):
            raise BadRequest("the cache_salt parameter must be a string")
    return text


def _flag(request, name: str, default: bool) -> bool:
    return bool(get_scalar(request, name, np.bool_)) if has_input(request, name) else default


def _text(request, name: str):
    if not has_input(request, name):
        return None
    try:
        return get_text(request, name).decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest(f"{name} is not UTF-8 text") from None


def _words(request, name: str) -> List[str]:
    words = []
    for value in get_array(request, name, None).reshape(-1):
        raw = value if isinstance(value, bytes) else str(value).encode()
        try:
            word = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(f"{name} holds a word that is not UTF-8") from None
        if word:
            words.append(word)
    return words
