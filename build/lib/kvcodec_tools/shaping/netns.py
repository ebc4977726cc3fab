"""netns links (root only): a network namespace joined to the root namespace by a veth pair, with
``tc`` shaping both directions.

The namespace ``kvc-<pid>-<n>`` gets a private /30 from 10.77.0.0/16 (host end ``.1``, namespace
end ``.2``: the ``server_host``); ``tc tbf`` shapes both directions (one qdisc on each veth end).
The delay (``delay_ms`` each way, so the RTT grows by twice it) is a ``netem`` parent of the tbf
where the kernel has netem; where it has not, ``expose`` puts a delay-only relay (the userspace
proxy without a rate) on 127.0.0.1 in front of the namespace address, and
``describe()["delay_via"]`` says so. ``wrap(argv)`` runs ``argv`` inside the namespace
(``ip netns exec``); teardown stops, by PID, whatever still runs there, then deletes the namespace.
"""
from __future__ import annotations

import fcntl
import gzip
import ipaddress
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from kvcodec_tools.procs import stop_pids

from .base import Link, default_name
from .bucket import tbf_params
from .errors import LinkError

LOCK_FILE = Path("/run/lock/kvcodec-link.lock") if Path("/run/lock").is_dir() else Path("/tmp/kvcodec-link.lock")
SUBNETS = ipaddress.ip_network("10.77.0.0/16")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run an ``ip`` or ``tc`` command; ``LinkError`` if it is missing or (with ``check``) fails."""
    try:
        r = subprocess.run(list(args), capture_output=True, text=True)
    except FileNotFoundError:
        raise LinkError(f"`{args[0]}` is not installed (needed for netns links)") from None
    if check and r.returncode != 0:
        raise LinkError(f"`{shlex.join(args)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _free_subnet() -> int:
    """Index of a /30 in 10.77.0.0/16 that no root-namespace address uses (call under LOCK_FILE)."""
    used = set()
    for m in re.finditer(r"inet (10\.77\.\d+\.\d+)/", ip("ip", "-o", "-4", "addr", "show").stdout):
        used.add((int(ipaddress.ip_address(m.group(1))) - int(SUBNETS.network_address)) // 4)
    return next(i for i in range(SUBNETS.num_addresses // 4) if i not in used)


def netns_permitted() -> bool:
    """Whether this process may make network namespaces (root with ``ip`` and ``tc``)."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        return False
    probe = f"kvc-{os.getpid()}-probe"
    if ip("ip", "netns", "add", probe, check=False).returncode != 0:
        return False
    ip("ip", "netns", "del", probe, check=False)
    return True


def netem_available() -> Optional[bool]:
    """Whether this kernel has the netem qdisc (None: unknown)."""
    try:
        with gzip.open("/proc/config.gz", "rt") as f:
            cfg = f.read()
    except OSError:
        return None
    return bool(re.search(r"^CONFIG_NET_SCH_NETEM=[ym]", cfg, re.M))


def namespaces() -> list[str]:
    """The names of the network namespaces there are."""
    return [line.split()[0] for line in ip("ip", "netns", "list", check=False).stdout.splitlines() if line.strip()]


def delete_namespace(netns: str, check: bool = False) -> None:
    """Stop, by PID, what still runs inside a namespace (servers started through ``wrap``), then
    delete it (``LinkError`` if that fails, with ``check``)."""
    stop_pids(int(p) for p in ip("ip", "netns", "pids", netns, check=False).stdout.split())
    ip("ip", "netns", "del", netns, check=check)


class NetnsLink(Link):
    kind = "netns"

    def __init__(self, rate_mbit: float, delay_ms: float, name: Optional[str]):
        name = name or default_name()
        self.netns = name
        self.delay_via: Optional[str] = None
        self._ns_made = False
        LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            r = ip("ip", "netns", "add", name, check=False)
            if r.returncode != 0:
                raise LinkError(f"`ip netns add {name}` failed: {r.stderr.strip()}")
            self._ns_made = True
            try:
                super().__init__(rate_mbit, delay_ms, name)
                idx = _free_subnet()
                base = int(SUBNETS.network_address) + 4 * idx
                self.host_addr = str(ipaddress.ip_address(base + 1))
                self.server_host = str(ipaddress.ip_address(base + 2))
                self.veth = (f"kvc{idx}h", f"kvc{idx}n")
                ip("ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1], "netns", name)
                ip("ip", "addr", "add", f"{self.host_addr}/30", "dev", self.veth[0])
            except BaseException:
                self._teardown()
                raise
        try:
            ip("ip", "link", "set", self.veth[0], "up")
            ip("ip", "-n", name, "addr", "add", f"{self.server_host}/30", "dev", self.veth[1])
            ip("ip", "-n", name, "link", "set", self.veth[1], "up")
            ip("ip", "-n", name, "link", "set", "lo", "up")
            self._shape()
        except BaseException:
            self.down()
            raise

    def _shape(self) -> None:
        t = tbf_params(self.rate_mbit)
        tbf = ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(t["burst"]), "latency", f"{t['latency_ms']}ms"]
        use_netem = self.delay_ms > 0 and netem_available() is not False
        for ns, dev in ((None, self.veth[0]), (self.netns, self.veth[1])):
            tc = ["tc"] + (["-n", ns] if ns else [])
            if use_netem:
                r = ip(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                       "delay", f"{self.delay_ms}ms", "limit", "100000", check=False)
                if r.returncode == 0:
                    ip(*tc, "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf)
                    self.delay_via = "netem"
                    continue
                use_netem = False
            ip(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)
        if self.delay_ms > 0 and self.delay_via is None:
            self.delay_via = "proxy"
        # netem may have gone on one end only: put the host end back to plain tbf
        if self.delay_via == "proxy" and "netem" in ip("tc", "qdisc", "show", "dev", self.veth[0]).stdout:
            ip("tc", "qdisc", "replace", "dev", self.veth[0], "root", "handle", "1:", *tbf)

    def wrap(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def expose(self, port: int) -> tuple[str, int]:
        if not self._up:
            raise LinkError(f"link {self.name} is down")
        if self.delay_via == "proxy":
            return self._proxy(port, (self.server_host, port), None)
        return self.server_host, port

    def describe(self) -> dict:
        return {**super().describe(), "netns": self.netns, "veth": list(self.veth), "host_addr": self.host_addr,
                "delay_via": self.delay_via, "shaper": "tc tbf", "tbf": tbf_params(self.rate_mbit)}

    def _teardown(self) -> None:
        if self._ns_made:
            delete_namespace(self.netns)
            self._ns_made = False
