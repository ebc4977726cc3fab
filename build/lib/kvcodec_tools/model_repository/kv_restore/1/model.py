"""kv_restore: typed planes -> KV in the engine's layout (a bad chunk is marked, never raised).

The KV leaves as ``kv`` (float16) or ``kv32`` (float32: raw on a float32 engine), the other one empty.
Restore runs on the instance's device (``KIND_GPU``: ``cuda:<device id>``, else the CPU): planes that
Triton left on a GPU are taken there through DLPack, and on a GPU the KV leaves through DLPack too.
"""
import numpy as np
import triton_python_backend_utils as pb_utils

from kvcodec.engines import model_card
from kvcodec.serving.chunkinfo import ChunkInfo
from kvcodec.serving.restore import EMPTY_KV, EMPTY_KV32, RestoreStep
from kvcodec.settings import Settings
from kvcodec.triton import (
    error_response,
    get_array,
    get_tensor,
    get_text,
    instance_device,
    model_parameters,
    passthrough,
    tensor,
    text_tensor,
)


class TritonPythonModel:
    def initialize(self, args):
        # the card (cheap) makes a model folder's fitted codec profile known to the transform layouts
        model_card(Settings.load(model_parameters(args)))
        self.step = RestoreStep(instance_device(args))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                info = ChunkInfo.from_json(get_text(request, "chunk_info"))
                planes16 = get_tensor(request, "planes16", np.uint16)
                planes = planes16 if np.prod(planes16.shape) else get_tensor(request, "planes8", np.uint8)
                kv = self.step.run_described(info, get_text(request, "chunk_header"),
                                             get_array(request, "side", np.uint8), planes)
                wide = kv.itemsize == 4  # numpy (a failed chunk's EMPTY_KV) or a torch tensor
                responses.append(pb_utils.InferenceResponse(passthrough(request, "input_ids", "max_tokens", "params") + [
                    tensor("kv", EMPTY_KV if wide else kv),
                    tensor("kv32", kv if wide else EMPTY_KV32),
                    text_tensor("chunk_info", info.to_json()),
                ]))
            except Exception as exc:
                responses.append(error_response(exc))
        return responses

    def finalize(self):
        self.step.close()
