"""The tooling's one process helper: start a command in its own process group, stop it by PID and
group, wait for it, and wait until it is ready.

``Process(name, cmd, log, wrap, env)`` runs ``wrap(cmd)`` (``wrap``: an optional
``list[str] -> list[str]``, e.g. ``["ip", "netns", "exec", NS, *cmd]``) with stdin from /dev/null
and stdout and stderr appended to the file ``log`` (truncated first with ``append=False``), or
stdout read from ``.stdout`` with ``log=subprocess.PIPE``.
By default it leads a new session, so its process group is its own: ``stop()`` sends SIGTERM to
the process, waits up to a grace period, then sends SIGKILL to the whole group (workers, model
stubs: whatever it started and left behind), reaps it and waits until nothing of the group is left.
A process started with ``new_session=False`` shares our group, and only the process itself is
signalled.

``stop_pids(pids)`` stops processes that are not our children (found in a state file or in a
network namespace) the same way, by PID, and SIGKILLs a group only where the process leads its own.

Nothing is ever killed by name. ``wait_ready`` raises ``ServiceError`` (the process exited) or
``NotReady`` (not ready in time; the process is stopped), each with the tail of the logs.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Callable, Iterable, List, Optional, Sequence, Union

from kvcodec.errors import KVCodecError

Wrap = Optional[Callable[[List[str]], List[str]]]
REAP_S = 10.0  # how long to wait, after SIGKILL, for a process to be reaped and its group to empty


class ServiceError(KVCodecError, RuntimeError):
    """A server is missing, or would not start."""


class NotReady(ServiceError, TimeoutError):
    """A server was still not ready when its time was up."""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log ("" if it cannot be read)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        time.sleep(0.02)


def stop_pids(pids: Iterable[int], grace_s: float = 3.0) -> None:
    """Stop processes that are not our children, by PID: SIGTERM to each, up to ``grace_s`` for
    them to exit, then SIGKILL to each one left and to the group of each that leads its own."""
    pids = list(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if alive(p)]
        time.sleep(0.02)
    for pid in pids:
        try:
            leads_group = os.getpgid(pid) == pid
        except ProcessLookupError:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if leads_group:
            _kill_group(pid)


class Process:
    """One child process, in its own session by default; see the module docstring."""

    def __init__(self, name: str, cmd: List[str], log: Union[str, os.PathLike, int, None] = None, wrap: Wrap = None,
                 env: Optional[dict] = None, new_session: bool = True, append: bool = True) -> None:
        """``log``: a file that stdout and stderr are appended to (truncated first unless
        ``append``), ``subprocess.PIPE`` to read stdout from ``.stdout``, or None to inherit both."""
        self.name, self.log, self.env = name, log, env
        self.cmd = list(wrap(list(cmd))) if wrap else list(cmd)
        self.new_session, self.append = new_session, append
        self.proc: Optional[subprocess.Popen] = None
        self._stopped = False

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    @property
    def stdout(self) -> Optional[IO[bytes]]:
        return self.proc.stdout if self.proc else None

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.returncode if self.proc else None

    def start(self) -> "Process":
        self._stopped = False
        if isinstance(self.log, (str, os.PathLike)):
            Path(self.log).parent.mkdir(parents=True, exist_ok=True)
            with open(self.log, "ab" if self.append else "wb") as out:
                self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=self.new_session, env=self.env)
        else:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self.log,
                                         start_new_session=self.new_session, env=self.env)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout_s: Optional[float] = None) -> int:
        """Wait for the process to exit (``subprocess.TimeoutExpired`` after ``timeout_s``); its exit
        code (0 if it was never started)."""
        return self.proc.wait(timeout=timeout_s) if self.proc else 0

    def terminate(self) -> None:
        """SIGTERM to the process, without waiting (safe inside a signal handler)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float, logs: Sequence[Path] = (),
                   poll_s: float = 0.05) -> None:
        """Poll ``ready()`` until it holds. ``ServiceError`` if the process exits first, ``NotReady``
        (after stopping it) if ``timeout_s`` runs out; either with the tail of ``logs``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                raise ServiceError(f"{self.name} exited ({self.returncode}) while starting: {self.cmd}\n"
                                   + "\n".join(tail(p) for p in logs))
            if ready():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise NotReady(f"{self.name} not ready after {timeout_s:.0f} s: {self.cmd}\n"
                               + "\n".join(tail(p) for p in logs))
            time.sleep(poll_s)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, up to ``grace_s`` for the process to exit, then SIGKILL to its group (to the process
        alone when it shares ours); reap it and wait until nothing of its group is left. Idempotent."""
        if self.proc is None or self._stopped:
            return
        proc, pid = self.proc, self.proc.pid
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        if self.new_session:
            # It led its own group: anything left in it goes too. The group's id is not reused
            # while the group has members, even once the leader is reaped.
            _kill_group(pid)
        elif proc.poll() is None:
            proc.kill()
        proc.wait(timeout=REAP_S)
        if self.new_session:
            _wait_group_gone(pid, REAP_S)
        if proc.stdout is not None:
            proc.stdout.close()
        self._stopped = True  # the group's id may be reused from now on: never signal it again
