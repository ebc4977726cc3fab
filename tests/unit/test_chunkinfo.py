"""ChunkInfo, the per-chunk record that travels between the serving steps as JSON."""
from __future__ import annotations

import pytest

from kvcodec.errors import BadRequest
from kvcodec.serving.chunkinfo import ChunkInfo


def test_json_round_trip_keeps_every_field():
    info = ChunkInfo("sess-1", 2, 5, status="ok", scheme="lossless8", key="ab/cd/ef", bytes=1234,
                     token_start=512, tokens=256, t={"request": 1.5, "sent": 2.25}, s={"fetch": 0.125})
    text = info.to_json()
    assert isinstance(text, str) and " " not in text
    back = ChunkInfo.from_json(text)
    assert back == info
    assert ChunkInfo.from_json(text.encode()) == info
    assert ChunkInfo.from_json(bytearray(text.encode())) == info


def test_defaults_are_ok_and_independent():
    a, b = ChunkInfo("s", 0, 1), ChunkInfo("s", 1, 1)
    assert a.ok and a.status == "ok" and a.reason == ""
    a.t["request"] = 1.0
    assert b.t == {}


def test_fail_keeps_the_first_failure():
    info = ChunkInfo("s", 0, 1)
    assert info.fail("corrupt", "checksum mismatch") is info
    assert not info.ok
    info.fail("foreign", "another model")
    assert (info.status, info.reason) == ("corrupt", "checksum mismatch")
    back = ChunkInfo.from_json(info.to_json())
    assert (back.status, back.reason, back.ok) == ("corrupt", "checksum mismatch", False)


def test_fail_truncates_long_reasons():
    info = ChunkInfo("s", 0, 1).fail("error", "x" * 1000)
    assert info.reason == "x" * 300


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", '{"session": "s"}', '{"session": "s", "index": 0, '
                                  '"count": 1, "bogus": 1}', b"\xff\xfe"])
def test_bad_json_raises_bad_request(text):
    with pytest.raises(BadRequest, match="bad chunk_info"):
        ChunkInfo.from_json(text)
