"""kv_fetch: validate the request, then stream the longest stored prefix chunk by chunk.

The optional ``codecs`` input (a comma list of rung specs, e.g. ``raw`` or ``video:12``) restricts
this request to those rungs, chosen statically; without it the server's ladder is used, chosen
per chunk by the adaptive fetcher when the ``adaptive`` setting is on.
"""
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from kvcodec.engines.model_files import ensure_model
from kvcodec.costs import for_settings
from kvcodec.errors import BadRequest, ConfigError
from kvcodec.fetcher import Fetcher
from kvcodec.ladder import parse_ladder
from kvcodec.settings import Settings
from kvcodec.store import open_store
from kvcodec.triton import (FINAL, error_response, get_array, get_scalar, get_text, model_parameters, tensor,
                            text_tensor)

MAX_TOKENS_LIMIT = 4096


class TritonPythonModel:
    def initialize(self, args):
        self.settings = Settings.load(model_parameters(args))
        files = ensure_model(self.settings.model_cache)
        self.store = open_store(self.settings.store)  # one connection pool for this instance
        costs = for_settings(self.settings, files.geometry(1).fp16_bytes)
        self.fetcher = Fetcher(self.store, files.model_id, self.settings.codecs, self.settings.chunk_tokens,
                               costs=costs, adaptive=self.settings.adaptive, deadline_s=self.settings.deadline_s)

    def _parse(self, request):
        ids = get_array(request, "input_ids", np.int32, ndim=1)
        if ids.size == 0:
            raise BadRequest("input_ids is empty: the prompt needs at least one token")
        if ids.min() < 0:
            raise BadRequest("input_ids holds negative token ids")
        max_tokens = int(get_scalar(request, "max_tokens", np.int32))
        if not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            raise BadRequest(f"max_tokens must be in 1..{MAX_TOKENS_LIMIT}, got {max_tokens}")
        reuse = bool(get_scalar(request, "reuse", np.bool_))
        codecs = None
        if pb_utils.get_input_tensor_by_name(request, "codecs") is not None:
            spec = get_text(request, "codecs").decode("utf-8", "replace").strip()
            if spec:
                try:
                    codecs = [s.strip() for s in spec.split(",") if s.strip()]
                    parse_ladder(codecs)
                except ConfigError as exc:
                    raise BadRequest(f"codecs: {exc}") from None
        return ids, max_tokens, reuse, codecs

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                ids, max_tokens, reuse, codecs = self._parse(request)
            except Exception as exc:  # bad request: INVALID_ARG, nothing sent downstream
                sender.send(error_response(exc), flags=FINAL)
                continue
            ids_t = tensor("input_ids", ids)
            max_t = tensor("max_tokens", np.array([max_tokens], np.int32))
            for info, data in self.fetcher.fetch(ids.tolist(), uuid.uuid4().hex, reuse, codecs):
                chunk = np.frombuffer(data, dtype=np.uint8)
                sender.send(pb_utils.InferenceResponse([ids_t, max_t, tensor("chunk", chunk),
                                                        text_tensor("chunk_info", info.to_json())]))
            sender.send(flags=FINAL)
        return None

    def finalize(self):
        self.fetcher.close()
        self.store.close()
