"""What every kind of link shares: the ``Link`` contract, its proxies, and its state file.

A ``Link`` (a context manager) has ``server_host`` (the address a store server binds to),
``wrap(argv)`` (the command that runs ``argv`` on the server side), ``expose(port)`` (the
``(host, port)`` a client in the root namespace connects to, to reach ``server_host:port``
through the link), ``down()`` (tears everything down: idempotent; also on ``__exit__`` and at
interpreter exit) and ``describe()`` (what the link is, for results JSON).

A link left up by ``perf/link up`` (``detach()``) is described in ``STATE_DIR/<name>.json``, which
``down_named`` reads to end it.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
from pathlib import Path
from typing import Optional

from kvcodec_tools.procs import Process

from .errors import LinkError
from .proxy import start_proxy

STATE_DIR = Path(os.environ.get("KVCODEC_LINK_STATE")
                 or ("/run/kvcodec-link" if os.geteuid() == 0 else f"/tmp/kvcodec-link-{os.getuid()}"))
_numbers = itertools.count(1)


def default_name(tag: str = "") -> str:
    """``kvc-<pid>-<tag><n>``, unique in this process (``down_stale`` finds the namespaces of dead
    processes by it)."""
    return f"kvc-{os.getpid()}-{tag}{next(_numbers)}"


class Link:
    """A throttled link (see the module docstring). Made by ``open_link``."""

    kind: str = ""

    def __init__(self, rate_mbit: float, delay_ms: float, name: str):
        self.rate_mbit, self.delay_ms, self.name = float(rate_mbit), float(delay_ms), name
        self.server_host = "127.0.0.1"
        self._proxies: dict[int, tuple[Process, int]] = {}  # server port -> (proxy, its port)
        self._detached = False
        self._up = True
        atexit.register(self.down)

    def wrap(self, argv: list[str]) -> list[str]:
        return list(argv)

    def expose(self, port: int) -> tuple[str, int]:
        raise NotImplementedError

    def _proxy(self, port: int, target: tuple[str, int], rate_mbit: Optional[float]) -> tuple[str, int]:
        if not self._up:
            raise LinkError(f"link {self.name} is down")
        if port not in self._proxies:
            self._proxies[port] = start_proxy(target, rate_mbit, self.delay_ms, detach=self._detached)
        return "127.0.0.1", self._proxies[port][1]

    def proxy_pids(self) -> list[int]:
        return [proc.pid for proc, _ in self._proxies.values()]

    def describe(self) -> dict:
        return {"kind": self.kind, "name": self.name, "rate_mbit": self.rate_mbit, "delay_ms": self.delay_ms,
                "server_host": self.server_host,
                "exposed": {str(k): ["127.0.0.1", p] for k, (_, p) in self._proxies.items()},
                "proxy_pids": self.proxy_pids()}

    def detach(self) -> dict:
        """Leave the link up after this process exits (``perf/link up``); ``down_named`` ends it.
        Proxies started after this outlive the process too."""
        self._detached = True
        atexit.unregister(self.down)
        self.save()
        return self.describe()

    def save(self) -> None:
        """Write the state file ``down_named`` reads."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{self.name}.json").write_text(json.dumps(self.describe()))

    def down(self) -> None:
        if not self._up:
            return
        self._up = False
        atexit.unregister(self.down)
        for proc, _ in self._proxies.values():
            proc.stop(grace_s=3.0)
        self._proxies.clear()
        self._teardown()
        with contextlib.suppress(FileNotFoundError):
            (STATE_DIR / f"{self.name}.json").unlink()

    def _teardown(self) -> None:
        pass

    def __enter__(self) -> "Link":
        return self

    def __exit__(self, *exc) -> None:
        self.down()
