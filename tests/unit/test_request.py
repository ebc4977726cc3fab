"""``serving.request.Request.validate``: each malformed request is a BadRequest with a short message."""
from __future__ import annotations

import numpy as np
import pytest

from kvcodec.engines import ModelCard
from kvcodec.errors import BadRequest
from kvcodec.serving.request import MAX_TOKENS_LIMIT, Request

CARD = ModelCard(name="tiny", model_id="tiny@1", layers=2, kv_heads=1, head_dim=8, vocab_size=1000, max_context=512)


def req(ids=(1, 2, 3), max_tokens=4, codecs=None) -> Request:
    return Request(np.asarray(ids, dtype=np.int32), max_tokens, True, codecs)


def test_a_good_request_passes_and_is_returned():
    r = req(ids=range(100), max_tokens=8, codecs=["raw", "video:8"])
    assert r.validate(CARD) is r


@pytest.mark.parametrize("kwargs, message", [
    ({"ids": ()}, "input_ids is empty"),
    ({"ids": (5, -1)}, "negative token ids"),
    ({"ids": (5, 1000)}, "token id 1000, the vocabulary has 1000"),
    ({"ids": (999_999,)}, "vocabulary"),
    ({"max_tokens": 0}, f"max_tokens must be in 1..{MAX_TOKENS_LIMIT}, got 0"),
    ({"max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens must be in"),
    ({"ids": range(500), "max_tokens": 13}, "longer than the model's context \\(512\\)"),
    ({"codecs": ["h266"]}, "codecs: codec 'h266' is unknown"),
    ({"codecs": ["raw", "raw"]}, "named twice"),
    ({"codecs": ["video:x"]}, "quality must be an integer"),
])
def test_malformed_requests_are_bad_requests(kwargs, message):
    with pytest.raises(BadRequest, match=message):
        req(**kwargs).validate(CARD)


def test_two_dimensional_ids_are_a_bad_request():
    with pytest.raises(BadRequest, match="1 dimension"):
        Request(np.zeros((2, 2), np.int32), 4).validate(CARD)


def test_the_last_vocabulary_id_and_the_full_context_are_accepted():
    full = req(ids=[999] * 508, max_tokens=4)  # 508 + 4 = the card's 512
    assert full.validate(CARD) is full and full.ids.tolist() == [999] * 508
    with pytest.raises(BadRequest):
        req(ids=[999] * 508, max_tokens=5).validate(CARD)  # one past the context


@pytest.mark.parametrize("spec, want", [(None, None), ("", None), (" , ", None), (" raw , video:8 ", ["raw", "video:8"])])
def test_codecs_spec_parsing(spec, want):
    assert Request.parse_codecs(spec) == want
