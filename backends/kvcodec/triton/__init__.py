"""The only code that speaks ``triton_python_backend_utils``: tensors <-> Python values, and
library errors -> Triton error codes. Imported only inside Triton's python-backend stub.

Error mapping (one request fails, never the batch; the client gets a short message, the server
log keeps the traceback):

- ``BadRequest``                   -> INVALID_ARG (only it: an internal ``ValueError`` is INTERNAL)
- ``StoreUnavailable``             -> UNAVAILABLE
- ``Unsupported``                  -> UNSUPPORTED
- anything else                    -> INTERNAL ("internal error; see the server log")

Device tensors: ``get_array`` copies an input that Triton left on a GPU to the host (a step that
works on numpy); ``get_tensor`` keeps it there as a torch tensor (DLPack, no copy). ``tensor`` makes
an output from numpy or from a torch tensor: on a GPU through DLPack (no host copy), on the CPU as
numpy (one copy into Triton's memory either way). ``instance_device(args)`` is the model instance's
device (``KIND_GPU``: ``cuda:<model_instance_device_id>``, else the CPU). ``instance_count(args)``
is how many instances the model's ``instance_group`` makes (``count`` per GPU for ``KIND_GPU``).

The batch dimension: every model of the repository has ``max_batch_size: 1``, as TensorRT-LLM's
ensemble has one (Triton lets an ensemble batch only when every step does, and the OpenAI frontend
and genai-perf send ``[[...]]``). A request is one sequence: each input arrives shaped
``[1, *dims]``, and ``get_array`` / ``get_tensor`` / ``get_text`` / ``get_scalar`` hand back the one
row (``BATCH`` is that leading dimension's size); ``tensor`` and ``text_tensor`` put the dimension
back on each output. ``passthrough`` sends inputs on as they came, dimension and all.
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

import numpy as np
import triton_python_backend_utils as pb_utils

from ..errors import BadRequest, StoreUnavailable, Unsupported
from ..settings import TRITON_OWN_PARAMETERS

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvcodec.triton")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def model_parameters(args: Dict[str, str]) -> Dict[str, str]:
    """A model's config ``parameters`` as a plain ``{key: string_value}``, without the ones the
    python backend reads itself (``settings.TRITON_OWN_PARAMETERS``)."""
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()
            if k not in TRITON_OWN_PARAMETERS}


def instance_count(args: Dict[str, str]) -> int:
    """How many instances of this model Triton runs: the sum over ``instance_group`` of ``count``
    (default 1), times the number of ``gpus`` of a GPU group that names them."""
    config = json.loads(args["model_config"])
    total = 0
    for group in config.get("instance_group") or [{}]:
        gpus = group.get("gpus") or []
        per = int(group.get("count") or 1)
        total += per * (len(gpus) if str(group.get("kind", "")).upper() in ("KIND_GPU", "GPU") and gpus else 1)
    return total


def instance_device(args: Dict[str, str]) -> "torch.device":
    """This model instance's device: ``cuda:<model_instance_device_id>`` for a GPU instance
    (``model_instance_kind`` ``GPU``, or ``KIND_GPU``), else the CPU."""
    import torch

    kind = str(args.get("model_instance_kind", "")).upper()
    if kind in ("GPU", "KIND_GPU"):
        return torch.device("cuda", int(args.get("model_instance_device_id") or 0))
    return torch.device("cpu")


BATCH = 1  # the leading dimension of every input and output: one sequence a request


def get_array(request, name: str, dtype, ndim: Optional[int] = None, required: bool = True) -> Optional[np.ndarray]:
    """Input ``name``'s one row as numpy (an input Triton left on a GPU is copied to the host)."""
    tensor = _input(request, name, required)
    if tensor is None:
        return None
    array = _row(name, tensor.as_numpy() if tensor.is_cpu() else _on_device(tensor).cpu().numpy())
    _check(name, array, dtype, ndim)
    return array


def get_tensor(request, name: str, dtype, ndim: Optional[int] = None) -> Union[np.ndarray, "torch.Tensor"]:
    """Input ``name`` where Triton put it: numpy in host memory, or a torch tensor on the GPU that
    holds it (``FORCE_CPU_ONLY_INPUT_TENSORS: "no"``; DLPack: no copy)."""
    tensor = _input(request, name, True)
    value = _row(name, tensor.as_numpy() if tensor.is_cpu() else _on_device(tensor))
    _check(name, value, dtype, ndim)
    return value


def _row(name: str, value):
    """The one row of a batched input (a view: no copy)."""
    shape = list(value.shape)
    if not shape or shape[0] != BATCH:
        raise BadRequest(f"input {name!r} must hold one sequence (batch size {BATCH}), got shape {shape}")
    return value[0]


def _input(request, name: str, required: bool):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None and required:
        raise BadRequest(f"input {name!r} is missing")
    return tensor


def _on_device(tensor) -> "torch.Tensor":
    """A tensor Triton left on a GPU, as a torch tensor there (DLPack: no copy)."""
    import torch.utils.dlpack

    return torch.utils.dlpack.from_dlpack(tensor.to_dlpack())


def _check(name: str, value, dtype, ndim: Optional[int]) -> None:
    got = np.dtype(value.dtype).name if isinstance(value, np.ndarray) else str(value.dtype).replace("torch.", "")
    if dtype is not None and got != np.dtype(dtype).name:
        raise BadRequest(f"input {name!r} must be {np.dtype(dtype).name}, got {got}")
    if ndim is not None and value.ndim != ndim:
        raise BadRequest(f"input {name!r} must have {ndim} dimension(s), got shape {list(value.shape)}")


def get_text(request, name: str) -> bytes:
    array = get_array(request, name, None)
    if array.size != 1:
        raise BadRequest(f"input {name!r} must hold one string, got {array.size}")
    value = array.reshape(-1)[0]
    return value if isinstance(value, bytes) else str(value).encode()


def get_scalar(request, name: str, dtype) -> Any:
    array = get_array(request, name, dtype)
    if array.size != 1:
        raise BadRequest(f"input {name!r} must hold exactly one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0].item()


def tensor(name: str, value) -> "pb_utils.Tensor":
    """An output tensor (the batch dimension put in front) from numpy, or from a torch tensor: a GPU
    one through DLPack (C-contiguous, as the python backend requires; no host copy), a CPU one as
    numpy (its own memory)."""
    if isinstance(value, np.ndarray):
        return pb_utils.Tensor(name, np.ascontiguousarray(value[None]))
    if value.device.type == "cpu":
        return pb_utils.Tensor(name, np.ascontiguousarray(value.numpy()[None]))
    return pb_utils.Tensor.from_dlpack(name, _c_order(value.unsqueeze(0)))


def _c_order(t: "torch.Tensor") -> "torch.Tensor":
    """``t`` with the exact C-order strides the python backend checks (size-1 dimensions too, which
    torch's ``contiguous()`` leaves as they are): a copy only when they differ."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if stride != expected:
            import torch

            return t.clone(memory_format=torch.contiguous_format)
        expected *= size
    return t


def passthrough(request, *names: str) -> list:
    """The named inputs, sent on unchanged (see the ensemble's config: why they pass through)."""
    return [pb_utils.get_input_tensor_by_name(request, name) for name in names]


def has_input(request, name: str) -> bool:
    return pb_utils.get_input_tensor_by_name(request, name) is not None


def request_parameters(request) -> Dict[str, Any]:
    """The request's parameters (KServe v2 ``parameters``: Triton's ``generate`` endpoints put
    unknown JSON fields there), {} when there are none or they are unreadable."""
    getter = getattr(request, "parameters", None)
    if getter is None:
        return {}
    try:
        raw = json.loads(getter() or "{}")
    except (TypeError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def text_tensor(name: str, text) -> "pb_utils.Tensor":
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return pb_utils.Tensor(name, np.array([[data]], dtype=np.object_))


def _code(name: str):
    return getattr(pb_utils.TritonError, name, None)


def error_for(exc: BaseException) -> "pb_utils.TritonError":
    if isinstance(exc, BadRequest):
        message, code = str(exc), _code("INVALID_ARG")
    elif isinstance(exc, StoreUnavailable):
        message, code = str(exc), _code("UNAVAILABLE")
    elif isinstance(exc, Unsupported):
        message, code = str(exc), _code("UNSUPPORTED")
    else:
        log.error("request failed", exc_info=exc)
        message, code = "internal error; see the server log", _code("INTERNAL")
    return pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)


def error_response(exc: BaseException) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(output_tensors=[], error=error_for(exc))
