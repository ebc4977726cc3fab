"""Encode speed: Hevc's x265 coding tools (``x265``) and ingest's chunk workers."""
from __future__ import annotations

import threading

import av
import numpy as np
import pytest
import torch

from kvcodec.bitstream.hevc import Hevc, x265_tools
from kvcodec.format.codecs import SCHEMES, get_scheme
from kvcodec.ingest import default_workers, ingest, ingest_rungs

from .conftest import AUTH, synthetic_kv

torch.set_num_threads(1)

FAST = "ctu=16:max-tu-size=16:info=0"


@pytest.fixture(scope="module")
def planes10():
    rng = np.random.default_rng(7)
    rows, cols = np.meshgrid(np.arange(64), np.arange(128), indexing="ij")
    base = 512 + 300 * np.sin(rows / 9.0)[None] * np.cos(cols / 17.0)[None]
    return np.clip(base + rng.normal(0, 20, (4, 64, 128)), 0, 1023).astype(np.uint16)


def _nal_starts(data: bytes):
    i = data.find(b"\x00\x00\x01")
    while i >= 0:
        yield i + 3
        i = data.find(b"\x00\x00\x01", i + 3)


def _nal_types(data: bytes):
    """The NAL unit types of an Annex-B stream, in order."""
    return [(data[i] >> 1) & 0x3F for i in _nal_starts(data)]


def _bits(buf: bytes):
    for byte in buf:
        for k in range(7, -1, -1):
            yield (byte >> k) & 1


def _ue(bits) -> int:
    zeros = 0
    while next(bits) == 0:
        zeros += 1
    value = 0
    for _ in range(zeros):
        value = (value << 1) | next(bits)
    return (1 << zeros) - 1 + value


def _pictures(data: bytes):
    """(NAL type, slice_type) of each picture's slice (x265 here: one slice a picture, no extra
    slice header bits): slice_type 2 is I."""
    out = []
    for i in _nal_starts(data):
        t = (data[i] >> 1) & 0x3F
        if t < 32:
            bits = _bits(data[i + 2:i + 12])
            assert next(bits) == 1  # first_slice_segment_in_pic_flag
            if 16 <= t <= 23:
                next(bits)  # no_output_of_prior_pics_flag
            _ue(bits)  # slice_pic_parameter_set_id
            out.append((t, _ue(bits)))
    return out


def test_x265_tools_are_checked_and_canonical():
    assert x265_tools("") == ""
    assert x265_tools("max-tu-size=16:ctu=16:info=0") == "ctu=16:info=0:max-tu-size=16"
    for bad in ("keyint=1", "bframes=2", "forced-idr=0", "repeat-headers=0", "lossless=1", "qp=3", "ctu",
                "ctu=16:ctu=32", "rd=2;ls", "input-csp=i400", "pools=2"):
        with pytest.raises(ValueError):
            x265_tools(bad)


def test_x265_tools_go_into_params_only_when_set():
    video = SCHEMES["video"]
    assert "x265" not in Hevc(**video.codec_params).params  # the video scheme's identity stays as it is
    assert "x265" not in Hevc(lossless=True).params
    codec = Hevc(lossless=False, qp=7, preset="medium", bit_depth=10, tune="mse", x265="info=0:ctu=16:max-tu-size=16")
    assert codec.params["x265"] == "ctu=16:info=0:max-tu-size=16"
    params = codec.x265_params()
    # after the stream's fixed structure, the preset's defaults are overridden by the tools
    assert params.endswith(":ctu=16:info=0:max-tu-size=16")
    for fixed in ("keyint=600", "forced-idr=1", "bframes=0", "repeat-headers=1", "qp=7", "psy-rd=0"):
        assert fixed in params
    # a scheme with the tools has its own identity (old chunks are misses, never wrong reads)
    from dataclasses import replace

    tuned = replace(get_scheme("video"), codec_params=dict(video.codec_params, x265=codec.params["x265"]))
    assert tuned.identity != get_scheme("video").identity


def test_fast_tools_keep_every_frame_an_intra_main10_picture(planes10):
    plain = Hevc(lossless=False, qp=7, preset="medium", bit_depth=10, tune="mse")
    fast = Hevc(lossless=False, qp=7, preset="medium", bit_depth=10, tune="mse", x265=FAST)
    a, b = plain.encode(planes10), fast.encode(planes10)
    assert a != b
    # the stream's structure is the tools' business not at all: the same pictures as before them
    # (an IDR picture, then I pictures: TRAIL_R with I slices; x265 does not read the
    # ``forced-idr`` in x265-params, FFmpeg's libx265 option of that name is not set)
    assert _pictures(a) == _pictures(b) == [(20, 2)] + [(1, 2)] * (planes10.shape[0] - 1)
    for data in (a, b):
        ctx = av.CodecContext.create("hevc", "r")
        frames = [f for p in ctx.parse(data) + ctx.parse(None) for f in ctx.decode(p)] + list(ctx.decode(None))
        assert len(frames) == planes10.shape[0] and frames[0].format.name == "yuv420p10le"
        assert ctx.profile == "Main 10"
    assert b"x265 (build" in a and b"x265 (build" not in b  # info=0: no version/options SEI
    assert 39 not in _nal_types(b)  # no prefix SEI at all
    out = fast.decode(b, planes10.shape)
    err = np.abs(out.astype(np.int32) - planes10.astype(np.int32))
    ref = np.abs(plain.decode(a, planes10.shape).astype(np.int32) - planes10.astype(np.int32))
    assert err.mean() <= 1.2 * ref.mean() + 0.05  # the same quantizer: the same error scale


def test_frame_threads_do_not_change_the_pictures(planes10):
    one = Hevc(lossless=False, qp=7, bit_depth=10, tune="mse", x265=FAST, threads=1).encode(planes10)
    two = Hevc(lossless=False, qp=7, bit_depth=10, tune="mse", x265=FAST, threads=2).encode(planes10)
    assert one == two  # without the options SEI the bytes do not depend on the threads either


# -- ingest's chunk workers ------------------------------------------------------------------------

class ChunkEngine:
    """Prefill stand-in: synthetic chunks (seeded by position), recording which thread asked."""

    model_id = "unit/encode-speed"

    def __init__(self, fail_at=None):
        self.fail_at = fail_at

    def prefill_chunks(self, ids, chunk_tokens):
        for i in range(len(ids) // chunk_tokens):
            yield synthetic_kv(100 + i)


class RecordingStore:
    def __init__(self):
        self.data, self.order, self.lock = {}, [], threading.Lock()

    def exists(self, key):
        return key in self.data

    def put(self, key, data, overwrite=False):
        with self.lock:
            if key in self.data and not overwrite:
                return False
            self.data[key] = bytes(data)
            self.order.append(key)
            return True


class Overlap:
    """Counts the real ``ChunkEncoder.encode`` calls in flight: ``peak`` is the most at once. With
    ``meet=n`` the first ``n`` calls wait (up to 10 s) until ``n`` run together, so an ingest that
    encodes one chunk at a time fails (``BrokenBarrierError``) instead of passing by luck."""

    def __init__(self, monkeypatch, meet: int = 0):
        from kvcodec.encode import ChunkEncoder

        real, self.lock, self.running, self.peak, self.calls = ChunkEncoder.encode, threading.Lock(), 0, 0, 0
        barrier = threading.Barrier(meet, timeout=10) if meet > 1 else None

        def encode(encoder, *args):
            with self.lock:
                self.running += 1
                self.calls += 1
                self.peak = max(self.peak, self.running)
                first = self.calls <= meet
            try:
                if barrier is not None and first:
                    barrier.wait()
                return real(encoder, *args)
            finally:
                with self.lock:
                    self.running -= 1

        monkeypatch.setattr(ChunkEncoder, "encode", encode)


def _ingest(workers, rungs=("int8-zstd", "raw"), chunks=5, store=None, engine=None):
    from kvcodec.format.ladder import parse_ladder

    store = store if store is not None else RecordingStore()
    done = []
    report = ingest(engine or ChunkEngine(), store, list(range(256 * chunks + 17)), parse_ladder(list(rungs)), 256,
                    auth=AUTH, workers=workers, progress=done.append)
    return store, report, done


def test_chunk_workers_encode_side_by_side(monkeypatch):
    """Two workers run two encodes at once (a serial ingest breaks the barrier); one never does."""
    two = Overlap(monkeypatch, meet=2)
    _ingest(2)
    assert two.peak == 2 and two.calls == 10
    one = Overlap(monkeypatch)
    _ingest(1)
    assert one.peak == 1 and one.calls == 10


def test_chunk_workers_store_the_same_chunks_in_the_same_order(monkeypatch):
    one, r1, p1 = _ingest(1)
    overlap = Overlap(monkeypatch, meet=2)  # the same bytes although encodes really overlap
    two, r2, p2 = _ingest(2)
    assert overlap.peak == 2
    three, r3, _ = _ingest(3)
    assert one.data == two.data == three.data  # byte for byte: the same chunks under the same keys
    assert one.order == two.order == three.order  # stored in chunk order, rung by rung
    assert len(one.data) == 10 and r1.written == r2.written == r3.written == 10
    assert r1.bytes_written == r2.bytes_written and r1.fp16_bytes == r2.fp16_bytes
    assert sum(p1) == sum(p2) == 5
    for name in r1.rungs:
        assert r2.rungs[name].written == r1.rungs[name].written == 5
        assert r2.rungs[name].encode_s > 0


def test_chunk_workers_skip_what_is_stored_and_resume():
    store, _, _ = _ingest(2, chunks=3)
    for key in list(store.data)[:2]:
        del store.data[key]
    store.order.clear()
    _, report, _ = _ingest(2, chunks=3, store=store)
    assert report.written == 2 and len(store.order) == 2


def test_an_encode_error_in_a_worker_reaches_the_caller(monkeypatch):
    from kvcodec.encode import ChunkEncoder

    real = ChunkEncoder.encode

    def encode(self, kv, key, i, token_start, tenant=""):
        if i == 2:
            raise RuntimeError("encoder broke on chunk 2")
        return real(self, kv, key, i, token_start, tenant)

    monkeypatch.setattr(ChunkEncoder, "encode", encode)
    store = RecordingStore()
    with pytest.raises(RuntimeError, match="chunk 2"):
        _ingest(2, store=store)
    assert len(store.order) <= 2 * 2  # only chunks before the broken one were stored


@pytest.mark.parametrize("setting, workers, want", [("0", None, default_workers()), ("1", None, 1), ("2", None, 2),
                                                     ("1", 2, 2)])
def test_workers_default_and_setting(monkeypatch, tmp_path, setting, workers, want):
    """``ingest_rungs`` (the CLI's ingest) runs as many encoders at once as the ``ingest_workers``
    setting says (0: ``default_workers()``, 1 or 2 on these machines), or its ``workers`` argument."""
    from kvcodec.settings import Settings

    assert 1 <= default_workers() <= 2
    settings = Settings.load({"home": str(tmp_path), "store": f"memory://unit-workers-{setting}-{workers}",
                              "ingest_workers": setting, "ladder": "int8-zstd,raw"}, env={})
    engine = ChunkEngine()
    engine.card = None  # unbound rungs: int8-zstd and raw need no codec profile
    engine.geometry = lambda tokens: type("G", (), {"fp16_bytes": 2 * 4 * 2 * 3 * 64 * tokens})()
    overlap = Overlap(monkeypatch, meet=want)
    report = ingest_rungs(settings, engine, list(range(256 * 4)), workers=workers)
    assert report.written == 8 and overlap.calls == 8 and overlap.peak == want


def test_video_ingest_times_whole_ingests_per_rung_and_workers():
    from kvcodec_tools.encode_video_ingest import video_ingest

    engine = ChunkEngine()
    engine.card = None  # unbound rungs: int8-zstd and raw need no codec profile
    rows = video_ingest(engine, list(range(256 * 3)), 256, [("int8-zstd", 1), ("int8-zstd", 2), ("raw", 1)], rounds=2)
    assert list(rows) == ["int8-zstd x1", "int8-zstd x2", "raw x1"]
    first = rows["int8-zstd x1"]
    assert first["speedup"] == 1.0 and first["bytes_vs_first"] == 0.0 and len(first["encode_runs_s"]) == 2
    assert rows["int8-zstd x2"]["bytes"] == first["bytes"]  # the same chunks, whatever the workers
    assert rows["raw x1"]["bytes"] > first["bytes"] and rows["raw x1"]["ingest_tokens_per_s"] > 0
