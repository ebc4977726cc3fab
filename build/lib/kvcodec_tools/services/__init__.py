"""Store servers as their own processes, for tests and benchmarks: nginx (WebDAV) and redis.

Each launcher writes its own config into a folder under ``root`` (pid file, logs, data and
temporary files all inside it), runs the server in the foreground as a ``kvcodec_tools.procs.Process`` (its
own session, so it never touches /etc, /var or a system daemon), waits until ``(host, port)``
accepts connections and the server answers, and stops it by PID: SIGTERM, a wait, then SIGKILL to
its process group.

``wrap`` is an optional ``list[str] -> list[str]`` applied to every command launched, e.g. to run
the server in a network namespace (``["ip", "netns", "exec", NS, *cmd]``); the host may then be an
address of that namespace reachable from here.

Contract of a service: ``start(timeout_s)`` (raises ``ServiceError`` with the log tail if it
does not come up), ``stop()``, a context manager, ``.url`` (for ``open_store``), ``.pid``.
Free ports for them come from ``kvcodec_tools.ports``.
"""
from __future__ import annotations

import os
import shutil
import socket

from kvcodec_tools.procs import ServiceError


def binary(name: str, package: str) -> str:
    """The path of a server binary, or ``ServiceError`` naming the Debian package to install."""
    path = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)),
                                      None)
    if path is None:
        raise ServiceError(f"{name} is not installed (apt-get install -y {package})")
    return path


def can_connect(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
