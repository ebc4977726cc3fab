"""redis-server as a chunk store: ``RedisServer`` (one node) and ``RedisCluster`` (N masters,
replicas optional). Password required, no persistence; config, logs and the cluster's node files live in a
folder under ``root``. The password is handed to ``redis-cli`` through ``REDISCLI_AUTH``, never on a
command line. ``tls=(cert, key, ca)`` (PEM files) makes a server that speaks only TLS on its port
(``.url`` is ``rediss://``; clients are not asked for certificates); for a cluster, its nodes speak
TLS to clients and on the cluster bus (``.url`` is ``rediss+cluster://``).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple
from urllib.parse import quote

from kvcodec_tools.procs import Process, ServiceError, Wrap, tail

from . import binary, can_connect

CONF = """\
bind {host}
port {port}
protected-mode no
daemonize no
supervised no
requirepass "{password}"
save ""
appendonly {appendonly}
appendfsync everysec
dir {dir}
logfile {dir}/redis.log
loglevel notice
databases 16
"""

TLS = """\
port 0
tls-port {port}
tls-cert-file {cert}
tls-key-file {key}
tls-ca-cert-file {ca}
tls-auth-clients no
"""

CLUSTER = """\
cluster-enabled yes
cluster-config-file {dir}/nodes.conf
cluster-node-timeout {timeout_ms}
cluster-port {bus_port}
masterauth "{password}"
"""


def _check_password(password: str) -> None:
    if not isinstance(password, str) or not password or any(c in password for c in '"\\\n\r \t\'') \
            or len(password) > 512:
        raise ServiceError("redis password must be 1-512 characters, without quotes, backslashes or spaces")


def _command(host: str, port: int, password: str, *args: str, timeout_s: float = 2.0,
             tls: Optional[ssl.SSLContext] = None) -> bytes:
    """One RESP command on a fresh connection (AUTH first); the raw reply. Used for readiness only."""
    def resp(*parts: str) -> bytes:
        out = [f"*{len(parts)}\r\n".encode()]
        for p in parts:
            b = p.encode()
            out.append(b"$%d\r\n%s\r\n" % (len(b), b))
        return b"".join(out)

    with socket.create_connection((host, port), timeout=timeout_s) as plain:
        s = tls.wrap_socket(plain, server_hostname=host) if tls else plain
        s.sendall(resp("AUTH", password) + resp(*args))
        data = b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            first, _, rest = data.partition(b"\r\n")
            if not first.startswith(b"+OK"):
                return data
            if rest.startswith((b"+", b"-", b":")) and rest.endswith(b"\r\n"):
                return rest
            if rest.startswith(b"$"):
                size, _, body = rest.partition(b"\r\n")
                if len(body) >= int(size[1:]) + 2:
                    return body[:int(size[1:])]
        return data


def _ping(host: str, port: int, password: str, tls: Optional[ssl.SSLContext] = None) -> bool:
    try:
        return _command(host, port, password, "PING", tls=tls) == b"+PONG\r\n"
    except OSError:
        return False


class _Node:
    def __init__(self, folder: Path, host: str, port: int, password: str, wrap: Wrap,
                 cluster_bus_port: Optional[int] = None, tls: Optional[Tuple[Path, Path, Path]] = None,
                 persistent: bool = False) -> None:
        self.folder, self.host, self.port, self.password = folder, host, int(port), password
        self.persistent = persistent
        self.tls = tls
        self._tls_context = ssl.create_default_context(cafile=str(tls[2])) if tls else None
        self.wrap, self.cluster_bus_port = wrap, cluster_bus_port
        self.process: Optional[Process] = None

    def launch(self, keep_cluster_config: bool = False, node_timeout_ms: int = 5000) -> None:
        """Start redis-server; ``keep_cluster_config``: a cluster node restarted with its identity
        (it rejoins its cluster: a failed-over master comes back as a replica)."""
        server = binary("redis-server", "redis-server")
        self.folder.mkdir(parents=True, exist_ok=True)
        if not keep_cluster_config:
            (self.folder / "nodes.conf").unlink(missing_ok=True)
        conf_text = CONF.format(host=self.host, port=self.port, password=self.password, dir=self.folder,
                                appendonly="yes" if self.persistent else "no")
        if self.tls:
            cert, key, ca = self.tls
            conf_text += TLS.format(port=self.port, cert=cert, key=key, ca=ca)
        if self.cluster_bus_port is not None:
            conf_text += CLUSTER.format(dir=self.folder, bus_port=self.cluster_bus_port, password=self.password,
                                        timeout_ms=int(node_timeout_ms))
            if self.tls:
                conf_text += "tls-cluster yes\n"
        conf = self.folder / "redis.conf"
        conf.write_text(conf_text)
        conf.chmod(0o600)  # it holds the password
        self.process = Process(f"redis-server :{self.port}", [server, str(conf)], self.folder / "stdout.log",
                               self.wrap).start()

    def wait_ready(self, timeout_s: float) -> None:
        # PING answered with our password: our server, not someone else's on the same port.
        def ready() -> bool:
            return can_connect(self.host, self.port) and _ping(self.host, self.port, self.password, self._tls_context)

        self.process.wait_ready(ready, timeout_s, [self.folder / "stdout.log", self.folder / "redis.log"])

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


class RedisServer:
    """One redis-server: ``.url`` is ``redis://:PASSWORD@HOST:PORT/0``. ``persistent``: an
    append-only file (fsync every second), so that a killed and restarted server keeps its chunks;
    without it a restart empties the store."""

    def __init__(self, root: Path, host: str, port: int, password: str, wrap: Wrap = None,
                 tls: Optional[Tuple[Path, Path, Path]] = None, persistent: bool = False) -> None:
        _check_password(password)
        self.root, self.host, self.port, self.password = Path(root).resolve(), host, int(port), password
        tls = tuple(Path(p).resolve() for p in tls) if tls else None
        self._node = _Node(self.root / f"redis-{self.port}", host, self.port, password, wrap, tls=tls,
                           persistent=persistent)
        self.url = f"{'rediss' if tls else 'redis'}://:{quote(password, safe='')}@{host}:{self.port}/0"

    @property
    def pid(self) -> Optional[int]:
        return self._node.process.pid if self._node.process else None

    def start(self, timeout_s: float = 15.0) -> "RedisServer":
        if self._node.process and self._node.process.alive():
            return self
        self._node.launch()
        self._node.wait_ready(timeout_s)
        return self

    def stop(self) -> None:
        self._node.stop()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisCluster:
    """``nodes`` cluster-enabled masters on ``base_port``.. (bus ports ``bus_base_port``.., by default
    ``base_port + 10000``..), with ``replicas`` replicas each on the ports after them, joined with
    ``redis-cli --cluster create``: ``.url`` is ``redis+cluster://:PASSWORD@HOST:P1,HOST:P2,...``
    (every node). ``fail_master(rng)`` SIGKILLs a master (its replica takes over after
    ``node_timeout_ms``); ``rejoin()`` starts it again with its node file: it comes back a replica."""

    def __init__(self, root: Path, host: str, base_port: int, password: str, nodes: int = 3, wrap: Wrap = None,
                 bus_base_port: Optional[int] = None, tls: Optional[Tuple[Path, Path, Path]] = None,
                 replicas: int = 0, node_timeout_ms: int = 5000) -> None:
        _check_password(password)
        self.tls = tuple(Path(p).resolve() for p in tls) if tls else None
        self._tls_context = ssl.create_default_context(cafile=str(self.tls[2])) if self.tls else None
        if nodes < 3:
            raise ServiceError(f"a redis cluster needs at least 3 masters, got nodes={nodes}")
        self.root, self.host, self.password, self.wrap = Path(root).resolve(), host, password, wrap
        bus = bus_base_port if bus_base_port is not None else base_port + 10000
        self.replicas, self.node_timeout_ms = int(replicas), int(node_timeout_ms)
        self.ports = [int(base_port) + i for i in range(nodes * (1 + self.replicas))]
        self._failed: Optional[_Node] = None
        self._nodes = [_Node(self.root / f"redis-cluster-{p}", host, p, password, wrap, bus + i, tls=self.tls)
                       for i, p in enumerate(self.ports)]
        self.url = (f"{'rediss' if self.tls else 'redis'}+cluster://:{quote(password, safe='')}@"
                    + ",".join(f"{host}:{p}" for p in self.ports))

    @property
    def pids(self) -> List[int]:
        return [n.process.pid for n in self._nodes if n.process]

    @property
    def pid(self) -> Optional[int]:
        """The first node's PID (``pids`` has them all)."""
        return self.pids[0] if self.pids else None

    def info(self, port: int) -> Dict[str, str]:
        reply = _command(self.host, port, self.password, "CLUSTER", "INFO", tls=self._tls_context).decode(
            errors="replace")
        return dict(line.split(":", 1) for line in reply.splitlines() if ":" in line)

    def start(self, timeout_s: float = 30.0) -> "RedisCluster":
        if self._nodes[0].process and all(n.process.alive() for n in self._nodes):
            return self
        deadline = time.monotonic() + timeout_s
        try:
            for n in self._nodes:
                n.launch(node_timeout_ms=self.node_timeout_ms)
            for n in self._nodes:
                n.wait_ready(max(1.0, deadline - time.monotonic()))
            cli = binary("redis-cli", "redis-tools")
            cmd = [cli, *(["--tls", "--cacert", str(self.tls[2])] if self.tls else []),
                   "--cluster", "create", *(f"{self.host}:{p}" for p in self.ports), "--cluster-replicas", str(self.replicas),
                   "--cluster-yes"]
            cmd = list(self.wrap(cmd)) if self.wrap else cmd
            env = dict(os.environ, REDISCLI_AUTH=self.password)
            try:
                made = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                      timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise ServiceError(f"redis-cli --cluster create did not finish within {timeout_s:.0f} s") from None
            if made.returncode != 0:
                raise ServiceError(f"redis-cli --cluster create failed ({made.returncode}):\n"
                                   f"{made.stdout[-2000:]}{made.stderr[-2000:]}")
            while True:
                states = {}
                for p in self.ports:
                    try:
                        states[p] = self.info(p).get("cluster_state", "?")
                    except OSError as exc:
                        states[p] = repr(exc)
                if all(s == "ok" for s in states.values()):
                    return self
                if time.monotonic() > deadline:
                    raise ServiceError(f"redis cluster not ok after {timeout_s:.0f} s: {states}\n"
                                       + tail(self._nodes[0].folder / "redis.log"))
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for n in self._nodes:
            n.stop()

    def masters(self) -> List[int]:
        """The ports of the live nodes that are masters now (``CLUSTER NODES`` of a live node)."""
        for n in self._nodes:
            if n.process is None or not n.process.alive() or n is self._failed:
                continue
            try:
                reply = _command(self.host, n.port, self.password, "CLUSTER", "NODES",
                                 tls=self._tls_context).decode(errors="replace")
            except OSError:
                continue
            out = []
            for line in reply.splitlines():
                fields = line.split()
                if len(fields) > 2 and "master" in fields[2].split(",") and "fail" not in fields[2]:
                    out.append(int(fields[1].split("@")[0].rsplit(":", 1)[1]))
            return sorted(out)
        return []

    def fail_master(self, rng) -> str:
        """SIGKILL one master (a random one); what it did, in words."""
        if self._failed is not None:
            raise ServiceError("a node is down already: rejoin() it first")
        port = rng.choice(self.masters())
        node = next(n for n in self._nodes if n.port == port)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.process.pid, signal.SIGKILL)
        node.process.proc.wait(timeout=10)
        self._failed = node
        return f"master :{port} killed"

    def rejoin(self, timeout_s: float = 30.0) -> None:
        """Start the failed node again with its node file (it rejoins as a replica); wait until every
        node says the cluster is ok."""
        node, self._failed = self._failed, None
        if node is None:
            return
        node.launch(keep_cluster_config=True, node_timeout_ms=self.node_timeout_ms)
        node.wait_ready(timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if all(self.info(p).get("cluster_state") == "ok" for p in self.ports):
                    return
            except OSError:
                pass
            time.sleep(0.2)

    def __enter__(self) -> "RedisCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
