"""Throttled links: a KV store server behind a link of a given rate and one-way delay.

``open_link(rate_mbit, delay_ms, mode)`` returns a ``Link`` (a context manager):

- ``server_host``   the address a store server binds to;
- ``wrap(argv)``    the command that runs ``argv`` on the server side of the link;
- ``expose(port)``  the ``(host, port)`` a client in the root namespace connects to, to reach
                    ``server_host:port`` through the link;
- ``down()``        tears everything down (idempotent; also on ``__exit__`` and at interpreter exit);
- ``describe()``    what the link is, for results JSON.

Two kinds:

- ``netns`` (root only): a network namespace ``kvc-<pid>-<n>`` joined to the root namespace by a
  veth pair on a private /30 from 10.77.0.0/16; ``tc tbf`` shapes both directions (one qdisc on
  each veth end). The delay (``delay_ms`` each way, so the RTT grows by twice it) is a ``netem``
  parent of the tbf where the kernel has netem; where it has not, ``expose`` puts a delay-only
  relay (the proxy below, without a rate) on 127.0.0.1 in front of the namespace address, and
  ``describe()["delay_via"]`` says so.
- ``userspace``: ``server_host`` is 127.0.0.1 and ``wrap`` is the identity; ``expose`` starts a
  shaping TCP proxy (``python -m perf.shaping proxy``, a child process so that it does not share
  the benchmark's GIL): one token bucket per direction shared by all connections, each chunk held
  until it has been "serialized" at the rate, then delivered ``delay_ms`` later.

``mode="auto"`` takes netns when this process may make namespaces (root, ``ip netns add`` works),
else userspace; any other netns failure is an error, not a fallback. The shell front end is
``perf/link`` (``main()`` here): ``up``, ``down``, ``run -- CMD``, ``check``.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import fcntl
import ipaddress
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from kvcodec.errors import KVCodecError

STATE_DIR = Path(os.environ.get("KVCODEC_LINK_STATE")
                 or ("/run/kvcodec-link" if os.geteuid() == 0 else f"/tmp/kvcodec-link-{os.getuid()}"))
LOCK_FILE = Path("/run/lock/kvcodec-link.lock") if Path("/run/lock").is_dir() else Path("/tmp/kvcodec-link.lock")
SUBNETS = ipaddress.ip_network("10.77.0.0/16")
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")
MODES = ("auto", "netns", "userspace")


class LinkError(KVCodecError, OSError):
    """A link cannot be set up, used or torn down; the message says which command failed."""


# --- token bucket (pure maths, testable without sockets) -------------------------------------

class TokenBucket:
    """``rate`` bytes/s, at most ``burst`` bytes of credit. ``reserve(n, now)`` takes n bytes
    (the credit may go negative) and returns how long to wait, from ``now``, until they have
    left at the rate."""

    def __init__(self, rate: float, burst: float, now: float = 0.0):
        if rate <= 0 or burst <= 0:
            raise ValueError(f"token bucket needs rate > 0 and burst > 0, got rate={rate} burst={burst}")
        self.rate, self.burst = float(rate), float(burst)
        self.tokens, self.t = float(burst), now

    def reserve(self, n: int, now: float) -> float:
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.t) * self.rate)
        self.t = max(self.t, now)
        self.tokens -= n
        return max(0.0, -self.tokens / self.rate)


def proxy_params(rate_mbit: Optional[float], delay_ms: float) -> dict:
    """Chunk size, bucket burst and queue depth of the userspace proxy for a rate and delay."""
    rate = None if rate_mbit is None else rate_mbit * 1e6 / 8  # bytes/s
    chunk = 262144 if rate is None else int(min(262144, max(4096, rate * 0.002)))
    burst = None if rate is None else max(2 * chunk, rate * 0.005)
    # enough queued chunks to keep rate x delay in flight (10 Gbit/s when unshaped)
    in_flight = (rate or 1.25e9) * delay_ms / 1e3
    return {"rate": rate, "chunk": chunk, "burst": burst, "queue": int(math.ceil(in_flight / chunk)) + 8}


def tbf_params(rate_mbit: float) -> dict:
    """tbf burst and queue latency for a rate: 4 ms of data (for 10 Gbit/s, 5 MB), at least
    128 KiB so a 64 KiB GSO packet always fits."""
    rate = rate_mbit * 1e6 / 8
    return {"burst": int(max(131072, rate * 0.004)), "latency_ms": 20}


# --- the userspace proxy ----------------------------------------------------------------------

async def _pipe(reader, writer, bucket: Optional[TokenBucket], delay: float, p: dict):
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue(maxsize=p["queue"])

    async def pump_in():
        try:
            while data := await reader.read(p["chunk"]):
                wait = bucket.reserve(len(data), loop.time()) if bucket else 0.0
                await q.put((loop.time() + wait + delay, data))
                if wait > 0:
                    await asyncio.sleep(wait)  # hold the reader: no credit, no reading
        except (ConnectionError, OSError):
            pass
        finally:
            await q.put(None)

    async def pump_out():
        try:
            while (item := await q.get()) is not None:
                due, data = item
                if (d := due - loop.time()) > 0:
                    await asyncio.sleep(d)
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError):
            pass

    await asyncio.gather(pump_in(), pump_out())


async def _serve_proxy(target: tuple[str, int], rate_mbit: Optional[float], delay_ms: float,
                       ready: Callable[[int], None]):
    p = proxy_params(rate_mbit, delay_ms)
    now = asyncio.get_running_loop().time()
    buckets = [TokenBucket(p["rate"], p["burst"], now) if p["rate"] else None for _ in range(2)]
    delay = delay_ms / 1e3

    async def handle(c_reader, c_writer):
        try:
            s_reader, s_writer = await asyncio.open_connection(*target)
        except OSError:
            c_writer.close()
            return
        for w in (c_writer, s_writer):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(_pipe(c_reader, s_writer, buckets[0], delay, p),
                                 _pipe(s_reader, c_writer, buckets[1], delay, p))
        finally:
            for w in (c_writer, s_writer):
                w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=p["chunk"])
    ready(server.sockets[0].getsockname()[1])
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def _start_proxy(target: tuple[str, int], rate_mbit: Optional[float], delay_ms: float,
                 detach: bool = False) -> tuple[subprocess.Popen, int]:
    argv = [sys.executable, "-m", "perf.shaping", "proxy", "--target", f"{target[0]}:{target[1]}",
            "--delay-ms", str(delay_ms)]
    if rate_mbit is not None:
        argv += ["--rate-mbit", str(rate_mbit)]
    if detach:
        argv.append("--detach")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=detach, env=_child_env())
    line = proc.stdout.readline()
    proc.stdout.close()
    try:
        return proc, int(json.loads(line)["port"])
    except (ValueError, KeyError, TypeError):
        proc.kill()
        proc.wait()
        raise LinkError(f"link proxy to {target[0]}:{target[1]} did not start (said {line!r})") from None


def _child_env() -> dict:
    env = dict(os.environ)
    root = Path(__file__).resolve().parents[2]  # the repository: packages perf and (under backends/) kvcodec
    paths = [str(root), str(root / "backends")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _stop_pid(pid: int, proc: Optional[subprocess.Popen] = None, grace_s: float = 3.0) -> None:
    """Stop a proxy by PID: SIGTERM, then SIGKILL after the grace period."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return
        elif not _alive(pid):
            return
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if proc is not None:
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _is_our_proxy(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"perf.shaping" in cmd and b"proxy" in cmd


# --- links ------------------------------------------------------------------------------------

class Link:
    """A throttled link (see the module docstring). Made by ``open_link``."""

    kind: str = ""

    def __init__(self, rate_mbit: float, delay_ms: float, name: str):
        self.rate_mbit, self.delay_ms, self.name = float(rate_mbit), float(delay_ms), name
        self.server_host = "127.0.0.1"
        self._proxies: dict[int, tuple[subprocess.Popen, int]] = {}  # server port -> (proc, port)
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
            self._proxies[port] = _start_proxy(target, rate_mbit, self.delay_ms, detach=self._detached)
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
        self._save()
        return self.describe()

    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{self.name}.json").write_text(json.dumps(self.describe()))

    def down(self) -> None:
        if not self._up:
            return
        self._up = False
        atexit.unregister(self.down)
        for proc, _ in self._proxies.values():
            _stop_pid(proc.pid, proc)
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


class UserspaceLink(Link):
    kind = "userspace"

    def expose(self, port: int) -> tuple[str, int]:
        return self._proxy(port, ("127.0.0.1", port), self.rate_mbit)

    def describe(self) -> dict:
        return {**super().describe(), "shaper": "proxy", "proxy": proxy_params(self.rate_mbit, self.delay_ms)}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
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
    for m in re.finditer(r"inet (10\.77\.\d+\.\d+)/", _ip("ip", "-o", "-4", "addr", "show").stdout):
        used.add((int(ipaddress.ip_address(m.group(1))) - int(SUBNETS.network_address)) // 4)
    return next(i for i in range(SUBNETS.num_addresses // 4) if i not in used)


def netns_permitted() -> bool:
    """Whether this process may make network namespaces (root with ``ip`` and ``tc``)."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        return False
    probe = f"kvc-{os.getpid()}-probe"
    if _ip("ip", "netns", "add", probe, check=False).returncode != 0:
        return False
    _ip("ip", "netns", "del", probe, check=False)
    return True


def netem_available() -> Optional[bool]:
    """Whether this kernel has the netem qdisc (None: unknown)."""
    try:
        import gzip
        with gzip.open("/proc/config.gz", "rt") as f:
            cfg = f.read()
    except OSError:
        return None
    return bool(re.search(r"^CONFIG_NET_SCH_NETEM=[ym]", cfg, re.M))


class NetnsLink(Link):
    kind = "netns"
    _count = 0

    def __init__(self, rate_mbit: float, delay_ms: float, name: Optional[str]):
        NetnsLink._count += 1
        name = name or f"kvc-{os.getpid()}-{NetnsLink._count}"
        self.netns = name
        self.delay_via: Optional[str] = None
        self._ns_made = False
        LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            r = _ip("ip", "netns", "add", name, check=False)
            if r.returncode != 0:
                raise LinkError(f"`ip netns add {name}` failed: {r.stderr.strip()}")
            self._ns_made = True
            try:
                super().__init__(rate_mbit, delay_ms, name)
                idx = _free_subnet()
                base = int(SUBNETS.network_address) + 4 * idx
                self.host_addr, self.server_host = str(ipaddress.ip_address(base + 1)), str(ipaddress.ip_address(base + 2))
                self.veth = (f"kvc{idx}h", f"kvc{idx}n")
                _ip("ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1], "netns", name)
                _ip("ip", "addr", "add", f"{self.host_addr}/30", "dev", self.veth[0])
            except BaseException:
                self._teardown()
                raise
        try:
            _ip("ip", "link", "set", self.veth[0], "up")
            _ip("ip", "-n", name, "addr", "add", f"{self.server_host}/30", "dev", self.veth[1])
            _ip("ip", "-n", name, "link", "set", self.veth[1], "up")
            _ip("ip", "-n", name, "link", "set", "lo", "up")
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
                r = _ip(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
                        "delay", f"{self.delay_ms}ms", "limit", "100000", check=False)
                if r.returncode == 0:
                    _ip(*tc, "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf)
                    self.delay_via = "netem"
                    continue
                use_netem = False
            _ip(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)
        if self.delay_ms > 0 and self.delay_via is None:
            self.delay_via = "proxy"
        # netem may have gone on one end only: put the host end back to plain tbf
        if self.delay_via == "proxy" and "netem" in _ip("tc", "qdisc", "show", "dev", self.veth[0]).stdout:
            _ip("tc", "qdisc", "replace", "dev", self.veth[0], "root", "handle", "1:", *tbf)

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
            _kill_netns_pids(self.netns)
            _ip("ip", "netns", "del", self.netns, check=False)
            self._ns_made = False


def _kill_netns_pids(netns: str) -> None:
    """Stop what still runs inside a namespace we made (servers started through ``wrap``)."""
    pids = [int(p) for p in _ip("ip", "netns", "pids", netns, check=False).stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 3.0
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.02)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def open_link(rate_mbit: float, delay_ms: float = 0.0, mode: str = "auto", name: Optional[str] = None) -> Link:
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
    NetnsLink._count += 1
    return UserspaceLink(rate_mbit, delay_ms, name or f"kvc-{os.getpid()}-u{NetnsLink._count}")


def down_named(name: str) -> dict:
    """Tear down a link left up by ``perf/link up``: its proxies (by PID) and its namespace."""
    state_file = STATE_DIR / f"{name}.json"
    try:
        state = json.loads(state_file.read_text())
    except FileNotFoundError:
        state = {"name": name, "kind": "netns", "netns": name, "proxy_pids": []}
    for pid in state.get("proxy_pids", []):
        if _is_our_proxy(pid):
            _stop_pid(pid)
    removed = False
    if state.get("netns") and state["netns"] in _netns_list():
        _kill_netns_pids(state["netns"])
        _ip("ip", "netns", "del", state["netns"])
        removed = True
    with contextlib.suppress(FileNotFoundError):
        state_file.unlink()
    return {"name": name, "netns_removed": removed, "proxies_stopped": state.get("proxy_pids", [])}


def _netns_list() -> list[str]:
    return [line.split()[0] for line in _ip("ip", "netns", "list", check=False).stdout.splitlines() if line.strip()]


def down_stale() -> list[str]:
    """Delete ``kvc-<pid>-<n>`` namespaces whose process is gone (left by a crash)."""
    gone = []
    for ns in _netns_list():
        m = re.match(r"^kvc-(\d+)-\d+$", ns)
        if m and not _alive(int(m.group(1))):
            _kill_netns_pids(ns)
            _ip("ip", "netns", "del", ns, check=False)
            gone.append(ns)
    return gone


# --- measuring a link -------------------------------------------------------------------------

SOURCE = ("import socket,sys,threading\n"
          "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
          "s.bind((sys.argv[1],0));s.listen(8);print(s.getsockname()[1],flush=True)\n"
          "buf=memoryview(bytes(1<<20))\n"
          "def serve(c):\n"
          " f=c.makefile('rb')\n"
          " for line in f:\n"
          "  n=int(line)\n"
          "  while n>0:\n"
          "   k=min(n,len(buf));c.sendall(buf[:k]);n-=k\n"
          " c.close()\n"
          "while True:\n"
          " c,_=s.accept();threading.Thread(target=serve,args=(c,),daemon=True).start()\n")


@contextlib.contextmanager
def byte_source(link: Link):
    """A tiny server on the link's server side that answers a line ``N`` with N bytes.
    Yields the port it listens on (at ``link.server_host``)."""
    proc = subprocess.Popen(link.wrap([sys.executable, "-c", SOURCE, link.server_host]),
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise LinkError(f"byte source on {link.server_host} did not start (said {line!r})")
        yield int(line)
    finally:
        _stop_pid(proc.pid, proc)
        proc.stdout.close()


def measure(host: str, port: int, nbytes: int, timeout_s: float = 60.0, pings: int = 5) -> dict:
    """Connect, time ``pings`` 1-byte requests/responses (RTT: the first includes the server's
    start on the connection, the min does not), then a download of ``nbytes``."""
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t_conn = time.perf_counter()
        rtts = []
        for _ in range(pings):
            t = time.perf_counter()
            s.sendall(b"1\n")
            _recv_n(s, 1)
            rtts.append(time.perf_counter() - t)
        t_rtt = time.perf_counter()
        s.sendall(b"%d\n" % nbytes)
        _recv_n(s, nbytes)
        t_end = time.perf_counter()
    secs = t_end - t_rtt
    return {"bytes": nbytes, "seconds": round(secs, 4), "mbit_s": round(nbytes * 8 / secs / 1e6, 1),
            "connect_ms": round((t_conn - t0) * 1e3, 3), "first_rtt_ms": round(rtts[0] * 1e3, 3),
            "rtt_ms": round(min(rtts) * 1e3, 3)}


def _recv_n(s: socket.socket, n: int) -> None:
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    while n > 0:
        k = s.recv_into(view[:min(n, len(buf))])
        if k == 0:
            raise LinkError(f"connection closed with {n} bytes still to come")
        n -= k


def check(rate_mbit: float, delay_ms: float = 0.0, mode: str = "auto", megabytes: float = 30.0) -> dict:
    """Bring a link up, download ``megabytes`` across it, report the achieved rate and RTT."""
    with open_link(rate_mbit, delay_ms, mode) as link, byte_source(link) as port:
        host, xport = link.expose(port)
        m = measure(host, xport, int(megabytes * 1e6))
        return {**link.describe(), "measured": m, "achieved_ratio": round(m["mbit_s"] / rate_mbit, 3)}


# --- command line (perf/link) -----------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="perf/link", description="Throttled links for the TTFT benchmarks.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def link_args(p, name=True):
        p.add_argument("--rate-mbit", type=float, required=True)
        p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (RTT grows by twice it)")
        p.add_argument("--mode", choices=MODES, default="auto")
        if name:
            p.add_argument("--name")
        p.add_argument("--expose", type=int, action="append", default=[], metavar="PORT",
                       help="server-side port to expose (needed for userspace, and for netns delay without netem)")

    link_args(sub.add_parser("up", help="bring a link up, print it as JSON, leave it up"))
    d = sub.add_parser("down", help="tear down a link left up by `up`")
    d.add_argument("--name")
    d.add_argument("--stale", action="store_true", help="also delete kvc-<pid>-<n> namespaces of dead processes")
    r = sub.add_parser("run", help="bring a link up, run CMD (env KVCODEC_LINK_*), tear it down")
    link_args(r)
    r.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD")
    c = sub.add_parser("check", help="measure the achieved rate and RTT of a link")
    link_args(c, name=False)
    c.add_argument("--megabytes", type=float, default=30.0)
    p = sub.add_parser("proxy", help=argparse.SUPPRESS)
    p.add_argument("--target", required=True)
    p.add_argument("--rate-mbit", type=float)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--detach", action="store_true")
    return ap


def link_env(link: Link) -> dict:
    d = link.describe()
    env = {"KVCODEC_LINK_KIND": link.kind, "KVCODEC_LINK_NAME": link.name,
           "KVCODEC_LINK_SERVER_HOST": link.server_host, "KVCODEC_LINK_RATE_MBIT": str(link.rate_mbit),
           "KVCODEC_LINK_DELAY_MS": str(link.delay_ms), "KVCODEC_LINK_WRAP": shlex.join(link.wrap([])),
           "KVCODEC_LINK_EXPOSED": ",".join(f"{k}={h}:{p}" for k, (h, p) in d["exposed"].items())}
    if isinstance(link, NetnsLink):
        env["KVCODEC_LINK_NETNS"] = link.netns
    return env


def _run_proxy(args) -> int:
    host, _, port = args.target.rpartition(":")
    if not args.detach:  # die with the process that opened the link
        import ctypes
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            return 0

    def ready(p: int) -> None:
        print(json.dumps({"port": p}), flush=True)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)

    asyncio.run(_serve_proxy((host, int(port)), args.rate_mbit, args.delay_ms, ready))
    return 0


def _expose_all(link: Link, ports: list[int]) -> None:
    for port in ports:
        link.expose(port)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "proxy":
        return _run_proxy(args)
    try:
        if args.cmd == "down":
            if not args.name and not args.stale:
                raise LinkError("down needs --name NAME or --stale")
            out = down_named(args.name) if args.name else {}
            if args.stale:
                out["stale_removed"] = down_stale()
            print(json.dumps(out))
            return 0
        if args.cmd == "check":
            res = check(args.rate_mbit, args.delay_ms, args.mode, args.megabytes)
            print(json.dumps(res, indent=1))
            return 0
        link = open_link(args.rate_mbit, args.delay_ms, args.mode, args.name)
        if args.cmd == "up":
            try:
                link.detach()
                _expose_all(link, args.expose)
                link._save()
            except BaseException:
                link.down()
                raise
            print(json.dumps({**link.describe(), "env": link_env(link)}, indent=1))
            return 0
        # run
        cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not cmd:
            link.down()
            raise LinkError("run needs a command after --")

        def on_signal(signum, _frame):
            raise KeyboardInterrupt(signum)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, on_signal)
        with link:
            _expose_all(link, args.expose)
            try:
                return subprocess.run(cmd, env={**os.environ, **link_env(link)}).returncode
            except KeyboardInterrupt:
                return 130
    except (LinkError, ValueError) as e:
        print(f"perf/link: {e}", file=sys.stderr)
        return 2

