"""kv_decode: chunk bitstream -> typed planes + restore descriptor (a bad chunk is marked, never raised).

Planes leave as ``planes8`` (uint8) or ``planes16`` (uint16, 10-bit layouts), the other one
empty; the header (checked once here) as JSON in ``chunk_header``, the side sections in ``side``.

The HEVC decoder is made once, in ``initialize``, on the instance's device (``KIND_GPU``: the GPU
``model_instance_device_id``, NVDEC's output kept in device memory; else the CPU), and self-tested
there on the reference stream of every stream profile (``kvcodec.bitstream.selftest``; the result
goes to the server log). PyAV runs in a process of its own (``decoder_process``, on by default;
``kvcodec.bitstream.isolated``): a crash or a hang in FFmpeg is a miss for that one chunk, each
chunk within ``decode_timeout_s``. On a GPU, planes of a verified decoder leave through DLPack, never
copied to the host (``kvcodec.serving.decode`` says which planes skip the host digest). The
entropy-coded rungs (int8-zstd, kvtc-w) decode with nvCOMP on a GPU instance where it opens
(``entropy`` setting, ``auto``), on the CPU otherwise.
"""
import json
import logging

import numpy as np
import triton_python_backend_utils as pb_utils

from kvcodec.compose import open_reads
from kvcodec.engines import model_card
from kvcodec.serving.chunkinfo import ChunkInfo
from kvcodec.serving.restore import descriptor
from kvcodec.settings import Settings
from kvcodec.triton import (
    error_response,
    get_array,
    get_text,
    instance_device,
    model_parameters,
    passthrough,
    tensor,
    text_tensor,
)

EMPTY8 = np.zeros((0, 0, 0), np.uint8)
EMPTY16 = np.zeros((0, 0, 0), np.uint16)
log = logging.getLogger("kvcodec.kv_decode")


def entropy_decoder(setting: str, on_gpu: bool) -> str:
    """The zstd rungs' decoder of this instance: ``auto`` is nvCOMP (where it opens) on a GPU
    instance and the CPU's on a CPU instance; ``cpu`` and ``nvcomp`` as asked."""
    return "cpu" if setting == "auto" and not on_gpu else setting


class TritonPythonModel:
    def initialize(self, args):
        self.settings = Settings.load(model_parameters(args))
        card = model_card(self.settings)  # the model's identity only: nothing is loaded or converted
        device = instance_device(args)
        on_gpu = device.type == "cuda"
        # the deployment's read path (kvcodec.compose): the chunk key; chunks a previous key verified are
        # signed again with the current one (a key rotating), through the store behind the local tier
        self.reads = open_reads(self.settings, card)
        self.resigner = self.reads.resigner
        self.step = self.reads.decode_step(selftest=True, gpu_id=device.index if on_gpu else 0,
                                           device_output=on_gpu, entropy=entropy_decoder(self.settings.entropy, on_gpu))
        decoder = self.step.decoder
        message = (f"kv_decode on {device}: decoder {self.settings.decoder} self-test: "
                   f"{json.dumps(decoder.selftest_results, sort_keys=True)}")
        passed = decoder.selftest_passed
        # kept for the model's life (a deleted family fails its metrics)
        self.selftest_family = pb_utils.MetricFamily(
            "kvcodec_decoder_selftest_passed", "Whether kv_decode's decoders passed their start-up self-test "
            "(1) or not (0: a profile's chunks are decoded by the fallback, or are misses)",
            pb_utils.MetricFamily.GAUGE)
        self.selftest_metric = self.selftest_family.Metric(
            labels={"instance": args.get("model_instance_name", "kv_decode")})
        self.selftest_metric.set(1.0 if passed else 0.0)
        logger = getattr(pb_utils, "Logger", None)  # the python backend's logger: the server log
        if logger is not None:
            (logger.log_info if passed else logger.log_warn)(message)
        elif not passed:
            log.warning(message)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                info = ChunkInfo.from_json(get_text(request, "chunk_info"))
                decoded = self.step.run(info, get_array(request, "chunk", np.uint8))  # no copy of the chunk
                header, side = descriptor(decoded)
                wide = decoded.planes.itemsize == 2  # numpy, or a torch tensor on the GPU (DLPack out)
                responses.append(pb_utils.InferenceResponse(passthrough(request, "input_ids", "max_tokens", "params") + [
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
        self.reads.close()  # the re-signer and the store it opened
