"""kv_restore: planes -> float16 KV in the engine's layout (a bad chunk is marked, never raised)."""
import numpy as np
import triton_python_backend_utils as pb_utils

from kvcodec.chunkinfo import ChunkInfo
from kvcodec.steps import RestoreStep
from kvcodec.triton import error_response, get_array, get_text, tensor, text_tensor


class TritonPythonModel:
    def initialize(self, args):
        self.step = RestoreStep()

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                info = ChunkInfo.from_json(get_text(request, "chunk_info"))
                planes = get_array(request, "planes", np.uint8)
                header = get_array(request, "chunk_header", np.uint8).tobytes()
                info, kv = self.step.run(info, planes, header)
                responses.append(pb_utils.InferenceResponse([
                    pb_utils.get_input_tensor_by_name(request, "input_ids"),
                    pb_utils.get_input_tensor_by_name(request, "max_tokens"),
                    tensor("kv", kv),
                    text_tensor("chunk_info", info.to_json()),
                ]))
            except Exception as exc:
                responses.append(error_response(exc))
        return responses
