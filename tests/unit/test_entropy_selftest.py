"""The entropy decoder self-test (``bitstream.entropy_selftest``) and what ``ChunkDecoder`` does
with it: a device entropy decoder (nvCOMP; a stand-in on the CPU here, its planes a torch tensor)
checked at start-up on one reference payload per zstd framing, then trusted like NVDEC: only the
first chunk of each (framing, planes shape) is hashed on the host."""
from __future__ import annotations

import hashlib
import types
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvcodec.bitstream import entropy_selftest
from kvcodec.bitstream.simple import Zstd, ZstdCpuDecoder
from kvcodec.encode import ChunkEncoder
from kvcodec.errors import CorruptChunk, Unsupported
from kvcodec.format.codecs import SCHEMES, get_scheme
from kvcodec.serving import decode as decode_mod
from kvcodec.serving.decode import ChunkDecoder

from .conftest import AUTH, on_tiny_profile, synthetic_kv
from .test_gpu_entropy import DeviceZstd, OffByOneZstd

MODEL = "org/tiny@abc123"
KEY = "aaaa/bbbb/0123456789abcdef"


class SizeBuggyZstd(DeviceZstd):
    """Right at the self-test's planes size, one byte wrong at any other (a buffer-sizing bug)."""

    name = "size-buggy"

    def decode(self, frames, size):
        out = super().decode(frames, size)
        if size != int(np.prod(entropy_selftest.SHAPE)):
            out[0] ^= 1
        return out


class FramedOnlyBuggyZstd(DeviceZstd):
    """Wrong only on payloads of several frames (a batching bug)."""

    name = "framed-buggy"

    def decode(self, frames, size):
        out = super().decode(frames, size)
        if len(frames) > 1:
            out[-1] ^= 1
        return out


@pytest.fixture
def digests(monkeypatch):
    """Counts the host digests ``serving.decode`` takes of decoded planes."""
    real = decode_mod.planes_digest
    state = types.SimpleNamespace(calls=0)

    def counted(planes):
        state.calls += 1
        return real(planes)

    monkeypatch.setattr(decode_mod, "planes_digest", counted)
    return state


def _chunk(spec: str, seed: int = 1, tokens: int = 64) -> bytes:
    scheme = on_tiny_profile(get_scheme(*spec.split(":")) if ":" in spec else SCHEMES[spec])
    return ChunkEncoder(scheme, MODEL, auth=AUTH).encode(synthetic_kv(seed, tokens=tokens), KEY, 0, 0)


# -- the reference payloads ---------------------------------------------------------------------------
def test_the_reference_payloads_match_their_index_and_give_zstd_every_kind_of_block():
    index = entropy_selftest.load_index()
    assert index["format"] == entropy_selftest.FORMAT and sorted(index["profiles"]) == sorted(entropy_selftest.FRAMINGS)
    planes = entropy_selftest.reference_planes()
    for name, entry in index["profiles"].items():
        data = (entropy_selftest.REFERENCE_DIR / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["payload_sha256"] and len(data) == entry["bytes"] < 32 * 1024
        assert entry["codec_params"] == entropy_selftest.PARAMS[name]
        coder = Zstd(**entry["codec_params"])
        decoded = coder.decode_with(ZstdCpuDecoder(), data, tuple(entry["planes_shape"]))
        assert np.array_equal(decoded, planes)  # made from today's reference planes
        assert entry["planes_digest"] == decode_mod.planes_digest(decoded)
        assert len(coder.frames(data)) == entry["frames"] == (6 if name == "zstd-framed" else 1)
    # peaked values (Huffman literals), repeats (matches), a run (RLE) and noise (raw blocks)
    assert len(set(planes[0].ravel())) < 100 and (planes[4] == planes[4, 0, 0]).all()
    assert len(set(planes[5].ravel())) == 256


def test_the_rungs_payloads_fall_in_a_tested_framing():
    for name, scheme in SCHEMES.items():
        if scheme.codec == "zstd":
            assert entropy_selftest.framing_of(scheme.codec_params) in entropy_selftest.FRAMINGS, name
    assert entropy_selftest.framing_of({"level": 19, "frame_kb": 64}) == "zstd-framed"


def test_the_cpu_decoder_passes_and_a_damaged_or_missing_reference_is_an_error(tmp_path):
    assert all(r["ok"] for r in entropy_selftest.verify(ZstdCpuDecoder()).values())
    for f in entropy_selftest.REFERENCE_DIR.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    data = bytearray((tmp_path / "zstd.zst").read_bytes())
    data[100] ^= 0xFF
    (tmp_path / "zstd.zst").write_bytes(bytes(data))
    results = entropy_selftest.verify(ZstdCpuDecoder(), tmp_path)
    assert results["zstd"]["status"] == "error" and "damaged" in results["zstd"]["detail"]
    assert results["zstd-framed"]["ok"]
    gone = entropy_selftest.verify(ZstdCpuDecoder(), tmp_path / "nowhere")
    assert all(r["status"] == "error" and "unreadable" in r["detail"] for r in gone.values())


# -- ChunkDecoder: trusted after the self-test, as NVDEC is ------------------------------------------
@pytest.mark.parametrize("rung", ["int8-zstd", "kvtc-w"])
def test_a_self_tested_device_decoder_is_hashed_on_the_host_once_per_shape(rung, register_entropy, digests, tiny_profile):
    register_entropy("device-zstd", DeviceZstd)
    dec = ChunkDecoder(MODEL, auth=AUTH, entropy="device-zstd")
    assert set(dec.selftest_results["device-zstd"]) == dec.verified_framings == set(entropy_selftest.FRAMINGS)
    before = digests.calls
    cpu = ChunkDecoder(MODEL, auth=AUTH)
    for seed in (1, 2, 3):
        chunk = _chunk(rung, seed)
        got = dec.decode(chunk, key=KEY)
        assert isinstance(got.planes, torch.Tensor) and np.array_equal(got.planes.numpy(), cpu.decode(chunk, key=KEY).planes)
    after_device = digests.calls - before - 3  # the CPU decoder's three are always taken
    assert after_device == 1  # the first chunk of this shape only
    dec.decode(_chunk(rung, 4, tokens=32), key=KEY)  # another planes shape: hashed once more
    assert digests.calls - before - 3 == 2
    dec.close()


def test_a_device_decoder_wrong_at_another_size_is_caught_by_that_sizes_first_chunk(register_entropy, tiny_profile):
    register_entropy("size-buggy", SizeBuggyZstd)
    dec = ChunkDecoder(MODEL, auth=AUTH, entropy="size-buggy")
    assert all(not v.startswith(("mismatch", "error")) for v in dec.selftest_results[SizeBuggyZstd.name].values())
    for seed in (1, 2):  # never trusted at this shape: every chunk checked, every one refused
        with pytest.raises(CorruptChunk, match="do not match the digest taken at ingest"):
            dec.decode(_chunk("int8-zstd", seed), key=KEY)
    dec.close()


def test_a_named_decoder_that_fails_one_framing_still_decodes_the_other(register_entropy, tiny_profile):
    register_entropy("framed-buggy", FramedOnlyBuggyZstd)
    dec = ChunkDecoder(MODEL, auth=AUTH, entropy="framed-buggy")
    assert dec.selftest_results[FramedOnlyBuggyZstd.name]["zstd-framed"].startswith("mismatch")
    assert dec.verified_framings == {"zstd"}
    assert isinstance(dec.decode(_chunk("int8-zstd"), key=KEY).planes, torch.Tensor)
    scheme = on_tiny_profile(SCHEMES["int8-zstd"])
    framed = replace(scheme, codec_params=dict(scheme.codec_params, frame_kb=4))
    chunk = ChunkEncoder(framed, MODEL, auth=AUTH).encode(synthetic_kv(1, tokens=64), KEY, 0, 0)
    with pytest.raises(Unsupported, match="failed its self-test for zstd-framed"):
        dec.decode(chunk, key=KEY)
    dec.close()


def test_auto_whose_nvcomp_fails_the_self_test_decodes_on_the_cpu(register_entropy, monkeypatch, tiny_profile):
    register_entropy("nvcomp", OffByOneZstd)  # nvCOMP, as it were, not bit-exact
    dec = ChunkDecoder(MODEL, auth=AUTH, entropy="auto")
    assert dec.selftest_results[OffByOneZstd.name]["zstd"].startswith("mismatch")
    got = dec.decode(_chunk("int8-zstd"), key=KEY)
    assert isinstance(got.planes, np.ndarray)  # the CPU decoder's, checked against the digest
    dec.close()


def test_the_cpu_decoder_has_no_self_test_and_keeps_the_digest_on_every_chunk(digests, tiny_profile):
    dec = ChunkDecoder(MODEL, auth=AUTH, entropy="cpu")
    assert dec.selftest_results is None
    before = digests.calls
    for seed in (1, 2):
        dec.decode(_chunk("int8-zstd", seed), key=KEY)
    assert digests.calls - before == 2
