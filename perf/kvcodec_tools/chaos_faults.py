"""The moving parts of ``kvcodec soak --chaos``: the store it breaks, and the faults themselves.

``ChaosStore(kind, root)`` starts a real store (``nginx``: WebDAV over a folder, a tmpfs of
``disk_mb`` mounted there when run as root so that it can fill up; ``redis``; ``redis-cluster``:
three masters with a replica each; ``s3``: SeaweedFS) with a ``FaultProxy`` in front of it where
the protocol allows one (not Redis Cluster, whose nodes announce their own addresses).
``.server_url`` is what the servers use (through the proxy), ``.direct_url`` what the driver uses
(reference bookkeeping, churn, the final verification), ``.environ`` the variables both need.

``inject(fault, rig, clock)`` does one fault (``chaos_plan.Fault``) and returns a ``FaultRecord``:
when it began and when it was healed (for ``stub-kill`` the watchdog's restart being ready, for
``decoder-kill`` the next decoder process running), seconds from the load's start.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .chaos_plan import Fault
from .fault_proxy import FaultProxy
from .ports import free_port_run, free_ports
from .procstats import descendants, read_proc, stub_pids

PASSWORD = "chaos-store-pw-0123456789"
DECODER_ARGV = "kvcodec.bitstream.isolated"


@dataclass
class FaultRecord:
    kind: str
    at_s: float
    healed_s: Optional[float]
    hold_s: float
    detail: str = ""
    reuse_back_s: Optional[float] = None

    def to_json(self) -> dict:
        return {"kind": self.kind, "at_s": round(self.at_s, 2),
                "healed_s": None if self.healed_s is None else round(self.healed_s, 2),
                "hold_s": self.hold_s, "detail": self.detail, "reuse_back_s": self.reuse_back_s}


class ChaosStore:
    def __init__(self, kind: str, root: Path, token: str, disk_mb: int = 0) -> None:
        if kind not in ("nginx", "redis", "redis-cluster", "s3"):
            raise ValueError(f"unknown chaos store {kind!r} (nginx, redis, redis-cluster, s3)")
        self.kind, self.root, self.token, self.disk_mb = kind, Path(root), token, int(disk_mb)
        self.service = None
        self.proxy: Optional[FaultProxy] = None
        self.mounted: Optional[Path] = None
        self.environ: Dict[str, str] = {}
        self.server_url = self.direct_url = ""

    # -- life --------------------------------------------------------------------------------
    def start(self) -> "ChaosStore":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        upstream = None
        if self.kind == "nginx":
            from .services.nginx import NginxStore

            self.service = NginxStore(self.root / "nginx", "127.0.0.1", free_ports(1)[0], self.token)
            if self.disk_mb:
                self.service.data.mkdir(parents=True, exist_ok=True)
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.disk_mb}m", "tmpfs",
                                str(self.service.data)], check=True, timeout=10)
                self.mounted = self.service.data
            self.service.start()
            upstream = self.service.port
            self.direct_url = self.service.url
            self.environ = {"KVCODEC_STORE_TOKEN": self.token}
        elif self.kind == "redis":
            from .services.redis import RedisServer

            # persistent, as a Redis that holds ingested chunks is run: a kill must not empty it (the
            # ingested rungs, which write-back does not write again, would be gone until re-ingested)
            self.service = RedisServer(self.root / "redis", "127.0.0.1", free_ports(1)[0], PASSWORD,
                                       persistent=True).start()
            upstream = self.service.port
            self.direct_url = self.service.url
        elif self.kind == "redis-cluster":
            from .services.redis import RedisCluster

            self.service = RedisCluster(self.root / "redis-cluster", "127.0.0.1",
                                        free_port_run(6, offsets=(0, 10000)), PASSWORD, nodes=3, replicas=1,
                                        node_timeout_ms=2000).start(timeout_s=60)
            self.direct_url = self.server_url = self.service.url
        else:
            from .services.seaweedfs import SeaweedS3

            self.service = SeaweedS3(self.root / "s3", "127.0.0.1", "chaos-key", "chaos-secret-0123456789",
                                     bucket="chaos").start(timeout_s=90)
            upstream = self.service.port
            self.direct_url = self.server_url = self.service.url  # the endpoint is in the environment
            self.environ = self.service.environ()
        if upstream is not None:
            self.proxy = FaultProxy(("127.0.0.1", upstream))
            if self.kind == "nginx":
                self.server_url = self.direct_url.replace(f":{upstream}/", f":{self.proxy.port}/")
            elif self.kind == "redis":
                self.server_url = self.direct_url.replace(f":{upstream}/", f":{self.proxy.port}/")

    def server_environ(self) -> Dict[str, str]:
        """The variables the servers run with (S3: the endpoint through the proxy)."""
        env = dict(self.environ)
        if self.kind == "s3" and self.proxy is not None:
            env["AWS_ENDPOINT_URL_S3"] = f"http://127.0.0.1:{self.proxy.port}"
        return env

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
        pids = self.pids()
        for pid in pids:  # a paused store would not hear SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if self.service is not None:
            self.service.stop()
        if self.mounted is not None:
            subprocess.run(["umount", "-l", str(self.mounted)], check=False, timeout=30)
            self.mounted = None

    # -- what faults act on ------------------------------------------------------------------
    def pids(self) -> List[int]:
        """The store's processes (each leads its own process group)."""
        if self.service is None:
            return []
        if self.kind == "redis-cluster":
            return list(self.service.pids)
        return [self.service.pid] if self.service.pid else []

    def restart(self) -> None:
        """Start the killed store again: stopped first, which reaps it (a start that still saw the
        killed process alive would return without starting one)."""
        self.service.stop()
        self.service.start(timeout_s=90) if self.kind == "s3" else self.service.start(timeout_s=30)


def _signal_groups(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)


@dataclass
class Rig:
    """What the faults act on: the store, the servers (``TritonServer``) and their watchdogs."""

    store: ChaosStore
    servers: list
    watchdogs: list
    rng: random.Random = field(default_factory=random.Random)


def inject(fault: Fault, rig: Rig, clock: Callable[[], float], stop: Callable[[], bool]) -> FaultRecord:
    """Do ``fault`` now and heal it after its hold (``stop()`` cuts a hold short); ``clock()`` is
    seconds from the load's start."""
    at = clock()
    detail = ""
    store = rig.store
    if fault.kind == "store-kill":
        _signal_groups(store.pids(), signal.SIGKILL)
        _hold(fault.hold_s, stop)
        store.restart()
    elif fault.kind == "store-pause":
        pids = store.pids()
        if store.kind == "redis-cluster":
            pids = [rig.rng.choice(pids)]
            detail = f"node pid {pids[0]}"
        _signal_groups(pids, signal.SIGSTOP)
        _hold(fault.hold_s, stop)
        _signal_groups(pids, signal.SIGCONT)
    elif fault.kind in ("trickle", "stall"):
        store.proxy.set_mode(fault.kind)
        _hold(fault.hold_s, stop)
        store.proxy.set_mode("ok")
    elif fault.kind == "failover":
        detail = store.service.fail_master(rig.rng)
        _hold(fault.hold_s, stop)
        store.service.rejoin()
    elif fault.kind == "disk-full":
        filler = store.mounted / ".chaos-filler"
        detail = f"{_fill(filler) / 2**20:.0f} MiB filler"
        _hold(fault.hold_s, stop)
        filler.unlink(missing_ok=True)
    elif fault.kind == "stub-kill":
        return _stub_kill(fault, rig, at, clock)
    elif fault.kind == "decoder-kill":
        return _decoder_kill(fault, rig, at, clock)
    else:
        raise ValueError(f"unknown fault {fault.kind!r}")
    return FaultRecord(fault.kind, at, clock(), fault.hold_s, detail)


def _hold(seconds: float, stop: Callable[[], bool]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stop():
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))


def _fill(path: Path) -> int:
    """Fill the file system under ``path`` (a file of all its free space, then small writes until
    ENOSPC); the bytes written."""
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    written = 0
    with open(path, "wb", buffering=0) as f:  # unbuffered: nothing left to fail at close
        with contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), 0, max(free, 1))
            written = free
            f.seek(0, os.SEEK_END)
        with contextlib.suppress(OSError):
            while f.write(b"\0" * 4096):
                written += 4096
    return written


def _stub_kill(fault: Fault, rig: Rig, at: float, clock: Callable[[], float]) -> FaultRecord:
    """SIGKILL a random stub of a random ready server; healed when its watchdog has restarted it and
    it answers ready (Triton does not restart a stub; ``kvcodec_tools.watchdog`` restarts the server)."""
    ready = [i for i, s in enumerate(rig.servers) if s.ready()]
    if not ready:
        return FaultRecord(fault.kind, at, clock(), 0.0, "skipped: no server ready")
    i = rig.rng.choice(ready)
    server, watchdog = rig.servers[i], rig.watchdogs[i]
    stubs = stub_pids(server.pid)
    if not stubs:
        return FaultRecord(fault.kind, at, clock(), 0.0, f"skipped: server {i} has no stub")
    model = rig.rng.choice(sorted(stubs))
    before = watchdog.restarts
    with contextlib.suppress(ProcessLookupError):
        os.kill(stubs[model], signal.SIGKILL)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and not (watchdog.restarts > before and server.ready()):
        time.sleep(0.5)
    healed = clock() if watchdog.restarts > before and server.ready() else None
    took = f", restart {watchdog.history[-1].ready_s:.1f} s" if watchdog.restarts > before else ", not restarted"
    return FaultRecord(fault.kind, at, healed, 0.0, f"server {i} stub {model}{took}")


def decoder_processes(root: int) -> List[int]:
    return [p.pid for p in map(read_proc, descendants(root)) if p and p.state != "Z" and DECODER_ARGV in " ".join(p.argv)]


def _decoder_kill(fault: Fault, rig: Rig, at: float, clock: Callable[[], float]) -> FaultRecord:
    """SIGKILL kv_decode's decoder process of a random server, while it decodes (state R) if it does
    within 10 s; healed when a new decoder process runs there (it starts with the next chunk)."""
    order = list(range(len(rig.servers)))
    rig.rng.shuffle(order)
    for i in order:
        server = rig.servers[i]
        pids = decoder_processes(server.pid) if server.pid else []
        if not pids:
            continue
        victim = pids[0]
        busy = False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            info = read_proc(victim)
            if info is None:
                break
            if info.state == "R":
                busy = True
                break
            time.sleep(0.01)
        at = clock()
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(p != victim for p in decoder_processes(server.pid) if server.pid):
                return FaultRecord(fault.kind, at, clock(), 0.0,
                                   f"server {i} pid {victim} {'mid-chunk' if busy else 'idle'}")
            time.sleep(0.2)
        return FaultRecord(fault.kind, at, None, 0.0, f"server {i} pid {victim}: no new decoder process in 120 s")
    return FaultRecord(fault.kind, at, clock(), 0.0, "skipped: no decoder process running")
