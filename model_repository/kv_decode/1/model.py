"""kv_decode: chunk bitstream -> quantized planes (a bad chunk is marked, never raised)."""
import numpy as np
import triton_python_backend_utils as pb_utils

from kvcodec.chunkinfo import ChunkInfo
from kvcodec.engines.model_files import ensure_model
from kvcodec.settings import Settings
from kvcodec.steps import DecodeStep
from kvcodec.triton import error_response, get_array, get_text, model_parameters, tensor, text_tensor


class TritonPythonModel:
    def initialize(self, args):
        self.settings = Settings.load(model_parameters(args))
        model_id = ensure_model(self.settings.model_cache).model_id
        self.step = DecodeStep(model_id, decoder=self.settings.decoder, threads=max(1, self.settings.threads))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                info = ChunkInfo.from_json(get_text(request, "chunk_info"))
                data = get_array(request, "chunk", np.uint8).tobytes()
                info, planes, header = self.step.run(info, data)
                responses.append(pb_utils.InferenceResponse([
                    pb_utils.get_input_tensor_by_name(request, "input_ids"),
                    pb_utils.get_input_tensor_by_name(request, "max_tokens"),
                    tensor("planes", planes),
                    tensor("chunk_header", np.frombuffer(header, dtype=np.uint8)),
                    text_tensor("chunk_info", info.to_json()),
                ]))
            except Exception as exc:
                responses.append(error_response(exc))
        return responses

    def finalize(self):
        self.step.close()
