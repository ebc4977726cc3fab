"""``ProcessDecoder`` (``pyav-process``): PyAV in a worker process. The same frames as PyAV in
this process; a worker killed in a call is ``DecoderCrashed``, one that stops answering is killed
and ``DecodeTimeout``; a stream FFmpeg rejects is still ``CorruptChunk``; a new worker takes the
next call each time. The worker is a real spawned interpreter, killed by real signals."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from kvcodec.bitstream.hevc import Hevc, PyAVDecoder
from kvcodec.bitstream.isolated import ProcessDecoder
from kvcodec.bitstream.verified import VerifiedDecoders
from kvcodec.errors import CorruptChunk, DecoderCrashed, DecodeTimeout
from kvcodec.serving.decode import status_of

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def stream():
    """Noise at a fine QP: a stream several times what a pipe holds (64 KiB), so that a stopped
    worker blocks the sending too."""
    rng = np.random.default_rng(3)
    planes = np.clip(512 + rng.normal(0, 40, (6, 128, 256)), 0, 1023).astype(np.uint16)
    coder = Hevc(lossless=True, qp=0, preset="ultrafast", bit_depth=10)
    data = coder.encode(planes)
    coder.close()
    return data, planes


@pytest.fixture
def decoder():
    d = ProcessDecoder(threads=1, timeout_s=20)
    yield d
    d.close()


def _frames(d, stream):
    data, planes = stream
    return d.decode(data, planes.shape[2], planes.shape[1], 10)


def test_the_stream_is_more_than_a_pipe_holds(stream):
    assert len(stream[0]) > 3 * 65536


def test_the_same_frames_as_pyav_here(decoder, stream):
    here = PyAVDecoder(threads=1).decode(stream[0], 256, 128, 10)
    there = _frames(decoder, stream)
    assert len(there) == len(here) == 6
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(there, here, strict=True))
    pid = decoder.pid
    assert pid is not None and pid != os.getpid() and decoder.started == 1
    _frames(decoder, stream)
    assert decoder.pid == pid  # one worker for every call


def test_a_worker_killed_in_a_call_is_a_crash_and_the_next_call_gets_a_new_one(decoder, stream):
    _frames(decoder, stream)
    victim = decoder.pid
    os.kill(victim, signal.SIGSTOP)  # so that the next call is certainly inside it
    outcome = {}

    def call():
        try:
            _frames(decoder, stream)
        except Exception as exc:  # noqa: BLE001
            outcome["error"] = exc

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.5)
    os.kill(victim, signal.SIGSEGV)  # delivered when it runs: it dies as a crashing FFmpeg would
    os.kill(victim, signal.SIGCONT)
    caller.join(30)
    error = outcome["error"]
    assert isinstance(error, DecoderCrashed) and "killed by signal 11" in str(error), error
    assert status_of(error) == "error"
    assert len(_frames(decoder, stream)) == 6 and decoder.pid != victim and decoder.started == 2


def test_a_worker_that_stops_answering_is_killed_at_the_deadline(stream):
    d = ProcessDecoder(threads=1, timeout_s=1.5)
    try:
        _frames(d, stream)
        hung = d.pid
        os.kill(hung, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(DecodeTimeout, match="did not answer within 1.5 s") as err:
            _frames(d, stream)
        assert 1.4 < time.monotonic() - t0 < 10 and status_of(err.value) == "timeout"
        assert not os.path.exists(f"/proc/{hung}") or open(f"/proc/{hung}/stat").read().split()[2] in "ZX"
        assert len(_frames(d, stream)) == 6 and d.pid != hung
    finally:
        d.close()


def test_a_worker_that_died_between_calls_is_replaced_quietly(decoder, stream):
    _frames(decoder, stream)
    old = decoder.pid
    os.kill(old, signal.SIGKILL)
    time.sleep(0.2)
    assert len(_frames(decoder, stream)) == 6 and decoder.pid != old  # no chunk was in it: no miss


def test_what_the_decoder_says_of_a_bad_stream_comes_back_and_the_worker_stays(decoder, stream):
    _frames(decoder, stream)
    pid = decoder.pid
    here = PyAVDecoder().decode(b"\x00\x00\x01" + b"\xff" * 400, 128, 64, 10)
    assert decoder.decode(b"\x00\x00\x01" + b"\xff" * 400, 128, 64, 10) == here == []  # no frame: the chunk check says corrupt
    with pytest.raises(CorruptChunk, match="is yuv420p10le, expected yuv420p"):  # the decoder's own error, raised there
        decoder.decode(stream[0], 256, 128, 8)
    assert decoder.pid == pid


def test_close_ends_the_worker(stream):
    d = ProcessDecoder()
    _frames(d, stream)
    pid = d.pid
    d.close()
    assert d.pid is None
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] in "ZX"
    with pytest.raises(ValueError, match="timeout_s"):
        ProcessDecoder(timeout_s=0)


def test_the_self_tested_decoders_isolate_pyav_when_asked():
    isolated = VerifiedDecoders("pyav", isolate=True, timeout_s=20)
    try:
        assert list(isolated.decoders) == ["pyav-process"]
        assert isolated.verified_stream_profiles and all(r["ok"] for r in isolated.results["pyav-process"].values())
        assert isolated.choose(next(iter(isolated.verified_stream_profiles)))[0].pid is not None
    finally:
        isolated.close()
    assert list(VerifiedDecoders("pyav").decoders) == ["pyav"]
