"""The chunk container (kvcodec.format.container): every byte is covered by a check."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from kvcodec.errors import CorruptChunk, ForeignChunk
from kvcodec.format import container
from kvcodec.format.container import _PREFIX, FORMAT_VERSION, MAGIC, Container, _canonical, _digest, parse

from .conftest import AUTH

PREFIX = struct.Struct("<4sHI")


def _sample() -> Container:
    return Container(
        {"model_id": "m", "key": "ab/cd/ef", "geometry": {"layers": 1, "kv_heads": 2, "head_dim": 8, "tokens": 16},
         "planes_shape": [2, 16, 16], "note": "x"},
        {"q8_min": bytes(range(16)), "q8_step": b"\x01\x02\x03", "empty": b"", "payload": bytes(range(200, 256)) * 2},
    )


def _header_span(data: bytes) -> tuple:
    _, _, n = PREFIX.unpack_from(data)
    return PREFIX.size, PREFIX.size + n


def test_round_trip_keeps_header_and_sections():
    c = _sample()
    data = c.to_bytes(AUTH)
    assert data[:4] == MAGIC
    back = container.parse(data, AUTH)
    assert back.header == c.header
    assert back.sections == c.sections
    assert list(back.sections) == list(c.sections)  # order kept
    assert back.to_bytes(AUTH) == data


def test_parse_accepts_bytearray_and_memoryview():
    data = _sample().to_bytes(AUTH)
    assert container.parse(bytearray(data), AUTH).sections == _sample().sections
    assert container.parse(memoryview(data), AUTH).header == _sample().header


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_flipping_any_byte_after_the_version_raises_corrupt(mask):
    data = _sample().to_bytes(AUTH)
    version_bytes = range(4, 6)
    for i in range(len(data)):
        if i in version_bytes:
            continue
        bad = bytearray(data)
        bad[i] ^= mask
        with pytest.raises(CorruptChunk):
            container.parse(bytes(bad), AUTH)
            pytest.fail(f"flipping byte {i} (mask {mask:#x}) of {len(data)} was not detected")


def test_flipping_a_section_byte_names_the_section():
    c = _sample()
    data = bytearray(c.to_bytes(AUTH))
    data[-1] ^= 0x01  # last byte of the last section, "payload"
    with pytest.raises(CorruptChunk, match="payload"):
        container.parse(bytes(data), AUTH)


def test_flipping_a_header_value_is_a_checksum_mismatch():
    data = _sample().to_bytes(AUTH)
    start, end = _header_span(data)
    header = data[start:end]
    pos = header.index(b'"note": "x"') + len(b'"note": "')
    bad = bytearray(data)
    bad[start + pos] = ord("y")  # still valid JSON, different value
    with pytest.raises(CorruptChunk, match="header checksum"):
        container.parse(bytes(bad), AUTH)


def test_every_truncation_raises_corrupt():
    data = _sample().to_bytes(AUTH)
    for n in range(len(data)):
        with pytest.raises(CorruptChunk):
            container.parse(data[:n], AUTH)
            pytest.fail(f"truncation to {n} of {len(data)} bytes was not detected")


@pytest.mark.parametrize("extra", [b"\x00", b"KVCC", b"x" * 100])
def test_trailing_bytes_raise_corrupt(extra):
    with pytest.raises(CorruptChunk, match="trailing"):
        container.parse(_sample().to_bytes(AUTH) + extra, AUTH)


@pytest.mark.parametrize("magic", [b"KVCD", b"\x00\x00\x00\x00", b"kvcc"])
def test_bad_magic_raises_corrupt(magic):
    data = _sample().to_bytes(AUTH)
    with pytest.raises(CorruptChunk, match="magic"):
        container.parse(magic + data[4:], AUTH)


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1, 0xFFFF])
def test_another_format_version_is_foreign(version):
    data = _sample().to_bytes(AUTH)
    _, _, n = PREFIX.unpack_from(data)
    other = PREFIX.pack(MAGIC, version, n) + data[PREFIX.size:]
    with pytest.raises(ForeignChunk, match="version"):
        container.parse(other, AUTH)


def test_header_length_out_of_range_raises_corrupt():
    data = _sample().to_bytes(AUTH)
    with pytest.raises(CorruptChunk):
        container.parse(PREFIX.pack(MAGIC, FORMAT_VERSION, len(data)) + data[PREFIX.size:], AUTH)
    with pytest.raises(CorruptChunk):
        container.parse(PREFIX.pack(MAGIC, FORMAT_VERSION, 0xFFFFFFFF) + data[PREFIX.size:], AUTH)


def test_header_that_is_not_json_raises_corrupt():
    blob = b"not json at all"
    with pytest.raises(CorruptChunk, match="unreadable"):
        container.parse(PREFIX.pack(MAGIC, FORMAT_VERSION, len(blob)) + blob, AUTH)
    blob = json.dumps({"no": "sections"}).encode()
    with pytest.raises(CorruptChunk, match="unreadable"):
        container.parse(PREFIX.pack(MAGIC, FORMAT_VERSION, len(blob)) + blob, AUTH)


def test_expect_raises_foreign_on_mismatch_and_passes_on_match():
    c = container.parse(_sample().to_bytes(AUTH), AUTH)
    c.expect(model_id="m", key="ab/cd/ef")
    with pytest.raises(ForeignChunk, match="model_id"):
        c.expect(model_id="other")
    with pytest.raises(ForeignChunk, match="key"):
        c.expect(model_id="m", key="ab/cd/00")
    with pytest.raises(ForeignChunk, match="missing_field"):
        c.expect(missing_field=1)


def test_without_drops_a_section_and_still_round_trips():
    c = _sample()
    light = c.without("payload")
    assert "payload" not in light.sections
    assert set(light.sections) == {"q8_min", "q8_step", "empty"}
    assert "payload" in c.sections  # the original is untouched
    back = container.parse(light.to_bytes(AUTH), AUTH)
    assert back.header == c.header
    assert back.sections == {k: v for k, v in c.sections.items() if k != "payload"}
    assert container.parse(c.without("payload", "q8_min", "q8_step", "empty").to_bytes(AUTH), AUTH).sections == {}


def test_parse_reads_any_buffer_without_copying_the_sections():
    data = Container({"model_id": "m"}, {"payload": b"\x01" * 4096, "side": b"xy"}).to_bytes(AUTH)
    array = np.frombuffer(data, dtype=np.uint8)  # as a Triton step receives a chunk
    c = parse(array, AUTH)
    assert bytes(c.sections["payload"]) == b"\x01" * 4096 and bytes(c.sections["side"]) == b"xy"
    assert np.shares_memory(np.frombuffer(c.sections["payload"], dtype=np.uint8), array)
    assert parse(bytearray(data), AUTH).header == parse(data, AUTH).header == c.header


@pytest.mark.parametrize("sections", [
    [{"name": "p", "length": -1, "digest": "x"}],
    [{"name": "p"}],
    ["p"],
    {"name": "p"},
])
def test_a_bad_section_table_is_corrupt(sections):
    header = {"sections": sections, "key_id": AUTH.key_id}  # signed: only the section table is wrong
    header["tag"] = AUTH.tag(_canonical(header, "tag", "header_digest"))
    header["header_digest"] = _digest(_canonical(header, "header_digest"))
    blob = json.dumps(header, sort_keys=True).encode()
    data = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(blob)) + blob
    with pytest.raises(CorruptChunk):
        parse(data, AUTH)


def test_a_non_buffer_is_corrupt():
    with pytest.raises(CorruptChunk, match="byte buffer"):
        parse(12345, AUTH)
