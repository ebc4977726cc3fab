"""kv_fetch: validate the request, then stream the longest stored prefix chunk by chunk.

The optional ``codecs`` input (a comma list of rung specs, e.g. ``raw`` or ``video:12``) restricts
this request to those rungs, chosen statically; without it the server's ladder is used, chosen
per chunk by the adaptive fetcher when the ``adaptive`` setting is on. The model is never loaded
here: its card (identity, vocabulary, context, codec profile, KV dtype) is all this step needs.
"""
import logging
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from kvcodec.engines import model_card
from kvcodec.serving.costs import for_settings
from kvcodec.serving.fetch import Fetcher
from kvcodec.serving.request import Request
from kvcodec.settings import Settings
from kvcodec.store import open_store
from kvcodec.triton import (
    FINAL,
    error_response,
    get_array,
    get_scalar,
    get_text,
    has_input,
    model_parameters,
    tensor,
    text_tensor,
)

log = logging.getLogger("kvcodec.kv_fetch")


class TritonPythonModel:
    def initialize(self, args):
        self.settings = Settings.load(model_parameters(args))
        self.card = model_card(self.settings)
        self.store = open_store(self.settings.store)  # one connection pool for this instance
        costs = for_settings(self.settings, self.card.geometry(1).fp16_bytes)
        self.fetcher = Fetcher(self.store, self.card.model_id, self.settings.ladder, self.settings.chunk_tokens,
                               costs=costs, adaptive=self.settings.adaptive, deadline_s=self.settings.deadline_s,
                               card=self.card, timeout_s=self.settings.fetch_timeout_s)

    def _parse(self, request) -> Request:
        ids = get_array(request, "input_ids", np.int32, ndim=1)
        max_tokens = int(get_scalar(request, "max_tokens", np.int32))
        reuse = bool(get_scalar(request, "reuse", np.bool_))
        spec = get_text(request, "codecs").decode("utf-8", "replace") if has_input(request, "codecs") else None
        return Request(ids, max_tokens, reuse, Request.parse_codecs(spec)).validate(self.card)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                req = self._parse(request)
            except Exception as exc:  # bad request: INVALID_ARG, nothing sent downstream
                sender.send(error_response(exc), flags=FINAL)
                continue
            ids_t = tensor("input_ids", req.ids)
            max_t = tensor("max_tokens", np.array([req.max_tokens], np.int32))
            try:
                for info, data in self.fetcher.fetch(req.ids.tolist(), uuid.uuid4().hex, req.reuse, req.codecs):
                    chunk = np.frombuffer(data, dtype=np.uint8)
                    sender.send(pb_utils.InferenceResponse([ids_t, max_t, tensor("chunk", chunk),
                                                            text_tensor("chunk_info", info.to_json())]))
            except Exception as exc:  # the stream still ends, with the error as its last response
                log.exception("kv_fetch failed mid-stream")
                sender.send(error_response(exc), flags=FINAL)
            else:
                sender.send(flags=FINAL)
        return None

    def finalize(self):
        self.fetcher.close()
        self.store.close()
