"""Software HEVC decode in a process of its own, so that a native fault ends one chunk, not the server.

FFmpeg is C: hostile bytes that crash it, or make it spin, would otherwise take the ``kv_decode``
python stub down with them (Triton 2.51 then fails every later request until the server restarts,
``tests/integration/test_faults.py``). ``ProcessDecoder`` has ``PyAVDecoder``'s interface,
``decode(data, width, height, bit_depth) -> frames``, and runs the PyAV decoder in a worker
(``python -m kvcodec.bitstream.isolated``, one process, the interpreter of this environment), one
call at a time over its stdin and stdout (length-prefixed pickles; the worker's own stdout is
moved to stderr, so nothing a library prints can mix in):

- a worker that dies during a call (a signal, an abort) raises ``DecoderCrashed``: that chunk is
  a miss (status ``error``), the model computes the rest, and the next call starts a new worker;
- a worker that has not answered within ``timeout_s`` (the whole call: sending, decoding, the
  reply) is killed and ``DecodeTimeout`` is raised (status ``timeout``);
- what the decoder raises itself (``CorruptChunk`` for a stream FFmpeg rejects) comes back as it is.

The worker starts on the first call (kv_decode's start-up self-test makes that call) and exits
when its stdin closes, so it does not outlive a stub that is killed. It costs the bitstream's and
the planes' trip through the pipes: ~10 ms for a `video` chunk (1.6 MB in, 5.9 MB of planes out)
against ~63 ms of decoding it at 2 threads on this CPU (the frames go back as one array: as 60
separate frames it was ~22 ms). ``started`` counts the workers started (restarts are ``started - 1``), ``pid``
is the live one's.

This is the one module of the library that starts a process (``tests/unit/test_library_boundaries``
names it): isolating a native decoder is part of the fault model, not tooling.
"""
from __future__ import annotations

import os
import pickle
import select
import shutil
import struct
import subprocess
import sys
import time
from typing import Any, List, Optional

import numpy as np

from ..errors import CorruptChunk, DecoderCrashed, DecodeTimeout, KVCodecError

_LENGTH = struct.Struct("<Q")


class _Gone(Exception):
    """The other end of a pipe closed."""


def _python() -> str:
    """The interpreter for the worker: this one, or (inside Triton's python stub, whose executable
    is the stub) the ``python3`` on PATH, which is the stub's own environment's."""
    exe = sys.executable or ""
    if os.path.basename(exe).startswith("python"):
        return exe
    return shutil.which("python3") or shutil.which("python") or os.path.join(sys.prefix, "bin", "python3")


def _wait(fd: int, write: bool, deadline: Optional[float]) -> None:
    """Until ``fd`` can be written (or read), or ``TimeoutError`` at ``deadline`` (None: no deadline)."""
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
        raise TimeoutError
    ready = select.select([], [fd], [], left)[1] if write else select.select([fd], [], [], left)[0]
    if not ready:
        raise TimeoutError


def _write_all(fd: int, data: bytes, deadline: Optional[float]) -> None:
    """``fd`` is non-blocking on the caller's side with a deadline (a blocking write of more than
    the pipe holds would wait on a stopped worker for ever), blocking in the worker."""
    view = memoryview(data)
    while view:
        _wait(fd, True, deadline)
        try:
            n = os.write(fd, view[:1 << 20])
        except BlockingIOError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            raise _Gone from None
        view = view[n:]


def _read_exact(fd: int, n: int, deadline: Optional[float]) -> bytes:
    parts, got = [], 0
    while got < n:
        _wait(fd, False, deadline)
        try:
            part = os.read(fd, min(n - got, 1 << 20))
        except BlockingIOError:
            continue
        if not part:
            raise _Gone
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _send(fd: int, value: Any, deadline: Optional[float] = None) -> None:
    body = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    _write_all(fd, _LENGTH.pack(len(body)) + body, deadline)


def _receive(fd: int, deadline: Optional[float] = None) -> Any:
    (size,) = _LENGTH.unpack(_read_exact(fd, _LENGTH.size, deadline))
    return pickle.loads(_read_exact(fd, size, deadline))


def _serve(threads: int) -> None:
    """The worker: decode each ``(data, width, height, bit_depth)`` received until stdin closes."""
    replies = os.dup(1)
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the replies
    from .hevc import PyAVDecoder

    decoder = PyAVDecoder(threads=threads)
    while True:
        try:
            data, width, height, bit_depth = _receive(0)
        except _Gone:
            return
        try:
            frames = decoder.decode(data, width, height, bit_depth)
            # one contiguous array pickles as one buffer (the frames are strided views of FFmpeg's)
            reply = ("ok", np.stack(frames) if frames else [])
        except KVCodecError as exc:
            reply = ("error", exc)
        except Exception as exc:  # noqa: BLE001  (anything else FFmpeg or PyAV raises is the stream's fault)
            reply = ("error", CorruptChunk(f"hevc decode failed: {type(exc).__name__}: {exc}"[:300]))
        try:
            _send(replies, reply)
        except _Gone:
            return


def _how(code: Optional[int]) -> str:
    if code is None:
        return "exit code unknown"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


class ProcessDecoder:
    """PyAV's HEVC decoder in a worker process (see the module's docstring)."""

    name = "pyav-process"

    def __init__(self, threads: int = 1, timeout_s: float = 30.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._threads = int(threads)
        self.timeout_s = float(timeout_s)
        self._proc: Optional[subprocess.Popen] = None
        self.started = 0

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [_python(), "-m", "kvcodec.bitstream.isolated", str(self._threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        os.set_blocking(self._proc.stdin.fileno(), False)
        os.set_blocking(self._proc.stdout.fileno(), False)
        self.started += 1

    def _stop(self, kill: bool = False) -> Optional[int]:
        """End the worker (killed if ``kill``, else by closing its stdin) and reap it: its exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if kill:
            proc.kill()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            return proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(5)

    def decode(self, data: Any, width: int, height: int, bit_depth: int = 8) -> List[Any]:
        if self._proc is None or self._proc.poll() is not None:
            self._stop()
            self._start()
        pid = self._proc.pid
        deadline = time.monotonic() + self.timeout_s
        try:
            _send(self._proc.stdin.fileno(), (bytes(data), int(width), int(height), int(bit_depth)), deadline)
            status, value = _receive(self._proc.stdout.fileno(), deadline)
        except _Gone:
            how = _how(self._stop(kill=True))
            raise DecoderCrashed(f"hevc decoder process {pid} died decoding this chunk ({how}); "
                                 f"a new one takes the next chunk") from None
        except TimeoutError:
            self._stop(kill=True)
            raise DecodeTimeout(f"hevc decoder process {pid} did not answer within {self.timeout_s:g} s; "
                                f"killed, a new one takes the next chunk") from None
        if status == "error":
            raise value
        return list(value)  # the frames, as views of the one array received

    def close(self) -> None:
        self._stop()


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
