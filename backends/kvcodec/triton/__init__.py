"""The only code that speaks ``triton_python_backend_utils``: tensors <-> Python values, and
library errors -> Triton error codes. Imported only inside Triton's python-backend stub.

Error mapping (one request fails, never the batch; the client gets a short message, the server
log keeps the traceback):

- ``BadRequest``                   -> INVALID_ARG (only it: an internal ``ValueError`` is INTERNAL)
- ``StoreUnavailable``             -> UNAVAILABLE
- ``Unsupported``                  -> UNSUPPORTED
- anything else                    -> INTERNAL ("internal error; see the server log")
"""
from __future__ import annotations

import json
import logging
from typing import Any, Dict, Optional

import numpy as np
import triton_python_backend_utils as pb_utils

from ..errors import BadRequest, StoreUnavailable, Unsupported
from ..settings import TRITON_OWN_PARAMETERS

log = logging.getLogger("kvcodec.triton")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def model_parameters(args: Dict[str, str]) -> Dict[str, str]:
    """A model's config ``parameters`` as a plain ``{key: string_value}``, without the ones the
    python backend reads itself (``settings.TRITON_OWN_PARAMETERS``)."""
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()
            if k not in TRITON_OWN_PARAMETERS}


def get_array(request, name: str, dtype, ndim: Optional[int] = None, required: bool = True) -> Optional[np.ndarray]:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        if required:
            raise BadRequest(f"input {name!r} is missing")
        return None
    array = tensor.as_numpy() if tensor.is_cpu() else _to_host(tensor)
    if dtype is not None and array.dtype != np.dtype(dtype):
        raise BadRequest(f"input {name!r} must be {np.dtype(dtype).name}, got {array.dtype.name}")
    if ndim is not None and array.ndim != ndim:
        raise BadRequest(f"input {name!r} must have {ndim} dimension(s), got shape {list(array.shape)}")
    return array


def _to_host(tensor) -> np.ndarray:
    """A tensor Triton left on a GPU (``FORCE_CPU_ONLY_INPUT_TENSORS: "no"``), copied to the host
    for a step that works on numpy (DLPack: no copy until here)."""
    import torch.utils.dlpack

    return torch.utils.dlpack.from_dlpack(tensor.to_dlpack()).cpu().numpy()


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
    return pb_utils.Tensor(name, np.ascontiguousarray(value))


def passthrough(request, *names: str) -> list:
    """The named inputs, sent on unchanged (see the ensemble's config: why they pass through)."""
    return [pb_utils.get_input_tensor_by_name(request, name) for name in names]


def has_input(request, name: str) -> bool:
    return pb_utils.get_input_tensor_by_name(request, name) is not None


def text_tensor(name: str, text) -> "pb_utils.Tensor":
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return pb_utils.Tensor(name, np.array([data], dtype=np.object_))


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
