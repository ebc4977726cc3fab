"""Store servers as their own processes, for tests and benchmarks: nginx (WebDAV) and redis.

Each launcher writes its own config into a folder under ``root`` (pid file, logs, data and
temporary files all inside it), runs the server in the foreground in its own session (so it never
touches /etc, /var or a system daemon), waits until ``(host, port)`` accepts connections and the
server answers, and stops it by PID: SIGTERM, a wait, then SIGKILL to its process group.

``wrap`` is an optional ``list[str] -> list[str]`` applied to every command launched, e.g. to run
the server in a network namespace (``["ip", "netns", "exec", NS, *cmd]``); the host may then be an
address of that namespace reachable from here.

Contract of a service: ``start(timeout_s)`` (raises ``ServiceError`` with the log tail if it
does not come up), ``stop()``, a context manager, ``.url`` (for ``open_store``), ``.pid``.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from kvcodec.errors import KVCodecError

Wrap = Optional[Callable[[List[str]], List[str]]]


class ServiceError(KVCodecError, RuntimeError):
    """A store server is missing, or would not start."""


def binary(name: str, package: str) -> str:
    """The path of a server binary, or ``ServiceError`` naming the Debian package to install."""
    path = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)),
                                      None)
    if path is None:
        raise ServiceError(f"{name} is not installed (apt-get install -y {package})")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port_run(n: int, host: str = "127.0.0.1", offsets: Sequence[int] = (0,), lo: int = 20000,
                  hi: int = 40000) -> int:
    """A base port B with B+i+o free for every i < n and o in ``offsets`` (e.g. (0, 10000) for redis
    cluster bus ports). Free now; another process may still take it before the server binds."""
    start = lo + (os.getpid() * 7919 + time.monotonic_ns()) % (hi - lo)
    for step in range(0, hi - lo, n):
        base = lo + (start - lo + step) % (hi - lo - n)
        if all(port_is_free(host, base + i + o) for i in range(n) for o in offsets):
            return base
    raise ServiceError(f"no run of {n} free ports on {host} in [{lo}, {hi})")


def can_connect(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class Process:
    """One server process: launched in its own session, stopped by PID (then its group)."""

    def __init__(self, name: str, cmd: List[str], log: Path, wrap: Wrap = None, env: Optional[dict] = None) -> None:
        self.name, self.log = name, log
        self.cmd = list(wrap(list(cmd))) if wrap else list(cmd)
        self.env = env
        self.proc: Optional[subprocess.Popen] = None

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def launch(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=self.env)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float, logs: Sequence[Path]) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                raise ServiceError(f"{self.name} exited ({code}) while starting: {self.cmd}\n"
                                   + "\n".join(tail(p) for p in logs))
            if ready():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise ServiceError(f"{self.name} not ready after {timeout_s:.0f} s: {self.cmd}\n"
                                   + "\n".join(tail(p) for p in logs))
            time.sleep(0.05)

    def stop(self, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        pid = self.proc.pid
        if self.proc.poll() is None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # The server led its own session: anything left in its process group (workers) goes too.
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=grace_s)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
