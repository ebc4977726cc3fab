"""kv_decode: chunk bitstream -> typed planes + restore descriptor (a bad chunk is marked, never raised).

Planes leave as ``planes8`` (uint8) or ``planes16`` (uint16, 10-bit layouts), the other one
empty; the header (checked once here) as JSON in ``chunk_header``, the side sections in ``side``.
"""
import numpy as np
import triton_python_backend_utils as pb_utils

from kvcodec.engines import model_card
from kvcodec.format.auth import load_auth
from kvcodec.serving.chunkinfo import ChunkInfo
from kvcodec.serving.decode import DecodeStep
from kvcodec.serving.restore import descriptor
from kvcodec.settings import Settings
from kvcodec.triton import error_response, get_array, get_text, model_parameters, passthrough, tensor, text_tensor

EMPTY8 = np.zeros((0, 0, 0), np.uint8)
EMPTY16 = np.zeros((0, 0, 0), np.uint16)


class TritonPythonModel:
    def initialize(self, args):
        self.settings = Settings.load(model_parameters(args))
        card = model_card(self.settings)  # the model's identity only: nothing is loaded or converted
        self.step = DecodeStep(card.model_id, auth=load_auth(self.settings.key_file), decoder=self.settings.decoder,
                               threads=max(1, self.settings.threads), geometry=card.geometry(self.settings.chunk_tokens))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                info = ChunkInfo.from_json(get_text(request, "chunk_info"))
                decoded = self.step.run(info, get_array(request, "chunk", np.uint8))  # no copy of the chunk
                header, side = descriptor(decoded)
                wide = decoded.planes.dtype == np.uint16
                responses.append(pb_utils.InferenceResponse(passthrough(request, "input_ids", "max_tokens") + [
                    tensor("planes8", EMPTY8 if wide else decoded.planes),
                    tensor("planes16", decoded.planes if wide else EMPTY16),
                    tensor("side", side),
                    text_tensor("chunk_header", header),
                    text_tensor("chunk_info", info.to_json()),
                ]))
            except Exception as exc:
                responses.append(error_response(exc))
        return responses

    def finalize(self):
        self.step.close()
