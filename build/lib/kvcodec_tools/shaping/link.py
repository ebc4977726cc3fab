"""Making and ending links: ``open_link`` (netns or userspace), the userspace kind, and the
teardown of links left up (``down_named``) or left behind by a crash (``down_stale``).

``userspace`` links: ``server_host`` is 127.0.0.1 and ``wrap`` is the identity; ``expose(port)``
starts a shaping proxy (``kvcodec_tools.shaping.proxy``) in front of ``127.0.0.1:port``.

``mode="auto"`` takes netns when this process may make namespaces (root, ``ip netns add`` works),
else userspace; any other netns failure is an error, not a fallback.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
from typing import Optional

from kvcodec_tools.procs import alive, stop_pids

from .base import STATE_DIR, Link, default_name
from .bucket import proxy_params
from .errors import LinkError
from .netns import NetnsLink, delete_namespace, namespaces, netns_permitted
from .proxy import is_our_proxy

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")
MODES = ("auto", "netns", "userspace")


class UserspaceLink(Link):
    kind = "userspace"

    def expose(self, port: int) -> tuple[str, int]:
        return self._proxy(port, ("127.0.0.1", port), self.rate_mbit)

    def describe(self) -> dict:
        return {**super().describe(), "shaper": "proxy", "proxy": proxy_params(self.rate_mbit, self.delay_ms)}


def open_link(rate_mbit: float, delay_ms: float = 0.0, mode: str = "auto", name: Optional[str] = None) -> Link:
    """A link of ``rate_mbit`` Mbit/s and ``delay_ms`` one-way delay (see the module docstring)."""
    if not (isinstance(rate_mbit, (int, float)) and math.isfinite(rate_mbit) and rate_mbit > 0):
        raise ValueError(f"rate_mbit must be a positive number, got {rate_mbit!r}")
    if not (isinstance(delay_ms, (int, float)) and math.isfinite(delay_ms) and delay_ms >= 0):
        raise ValueError(f"delay_ms must be >= 0, got {delay_ms!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if name is not None and not NAME_RE.match(name):
        raise ValueError(f"name must match {NAME_RE.pattern}, got {name!r}")
    if name is not None and (STATE_DIR / f"{name}.json").exists():
        raise LinkError(f"a link named {name} is up already (perf/link down --name {name})")
    if mode == "netns" or (mode == "auto" and netns_permitted()):
        return NetnsLink(rate_mbit, delay_ms, name)
    return UserspaceLink(rate_mbit, delay_ms, name or default_name("u"))


def down_named(name: str) -> dict:
    """Tear down a link left up by ``perf/link up``: its proxies (by PID) and its namespace."""
    state_file = STATE_DIR / f"{name}.json"
    try:
        state = json.loads(state_file.read_text())
    except FileNotFoundError:
        state = {"name": name, "kind": "netns", "netns": name, "proxy_pids": []}
    stop_pids(pid for pid in state.get("proxy_pids", []) if is_our_proxy(pid))
    removed = False
    if state.get("netns") and state["netns"] in namespaces():
        delete_namespace(state["netns"], check=True)
        removed = True
    with contextlib.suppress(FileNotFoundError):
        state_file.unlink()
    return {"name": name, "netns_removed": removed, "proxies_stopped": state.get("proxy_pids", [])}


def down_stale() -> list[str]:
    """Delete ``kvc-<pid>-<n>`` namespaces whose process is gone (left by a crash)."""
    gone = []
    for ns in namespaces():
        m = re.match(r"^kvc-(\d+)-\d+$", ns)
        if m and not alive(int(m.group(1))):
            delete_namespace(ns)
            gone.append(ns)
    return gone
