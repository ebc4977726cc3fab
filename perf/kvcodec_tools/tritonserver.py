"""Start and stop a real Triton Inference Server (the ``nvidia-pytriton`` wheel's binary) on
our model repository, with the python backend.

``TritonServer(repo, settings, ports).start()`` prepares a backend folder (the wheel's python
backend plus the stub for this Python), sets ``LD_LIBRARY_PATH`` (the wheel's bundled libraries
and this interpreter's ``libpython``), puts this venv's ``bin/`` first on ``PATH`` (the stub finds
its interpreter through it), passes the ``KVCODEC_*`` settings through the environment, waits
until the server is ready and every model is loaded, and raises with the log's tail if it is not.
The server is a ``kvcodec_tools.procs.Process`` (its own session): ``stop()`` sends SIGTERM to the server,
then SIGKILL to its process group after a grace period, and waits until nothing of the group is left.
``start(append_log=True)`` after ``stop()`` starts it again on the same ports, its log appended to.

``stubs()`` lists the server's python backend stubs (its children running
``triton_python_backend_stub``), zombies included: Triton 2.51 neither reaps nor restarts a stub
that died, so a watchdog (``kvcodec_tools.watchdog``) reads them to know when the server must restart.

``tls`` (``GrpcTls``; ``kvcodec serve --grpc-tls-cert F --grpc-tls-key F [--grpc-tls-client-ca CA]``)
serves gRPC over TLS, mutual with a client CA. Triton's administrative APIs (``RESTRICTED``: model control, shared memory, trace, logging) are
restricted to callers that send the header ``kvcodec-admin`` with the server's ``admin_key``
(``KVCODEC_ADMIN_KEY``, else random per server): inference, health and metadata stay open.

``kvcodec serve`` (``register``, ``cmd_serve``) runs the server in the foreground: it refuses ports
already in use, makes the engine's files ready, warns in one line of rungs without a fitted codec
profile and of a store that does not answer, starts the server (one line naming the models that
failed to load if it does not start), serves beside a watchdog (``--watchdog``) and, with
``--health-port``, a health endpoint (``kvcodec_tools.health``: ``/ready`` from every model's own
readiness and the watchdog's state, ``/live``), and on SIGINT or SIGTERM stops the watchdog, then the
server. Arguments after ``--`` go to tritonserver after its own (a later flag wins in Triton's parser).
It is the containers' entrypoint (``deploy/docker/entrypoint.sh``).

The binary: the ``nvidia-pytriton`` wheel's, or a full Triton install named by ``KVCODEC_TRITON_ROOT``
(NVIDIA's containers: ``/opt/tritonserver``, whose ``backends/`` already holds the python backend
with the stub built for the container's Python: it is used as it is).
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import sys
import sysconfig
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from kvcodec.errors import Unsupported
from kvcodec.settings import Settings
from kvcodec_tools.cli import DEFAULT_REPOSITORY, _settings, _store_down, common
from kvcodec_tools.health import Health, serve_health
from kvcodec_tools.procs import Process, ServiceError
from kvcodec_tools.stubs import STUB, Stub, children, read_stub, stubs_of  # noqa: F401  (this module's names too)

MODELS = ("kvcodec", "kv_fetch", "kv_decode", "kv_restore", "llm")
STARTUP_ABORT = "boost::interprocess::lock_exception"  # the python backend's abort at start, under load
# Triton's APIs that change or expose the server (load and unload models, shared memory, tracing,
# log settings) answer only requests with the header ADMIN_HEADER: <admin key>; inference, health,
# metadata, model config and statistics stay open. Checked on tritonserver 2.51 (403 without it).
RESTRICTED = "model-repository,shared-memory,trace,logging"
ADMIN_HEADER = "kvcodec-admin"


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def _pytriton_root() -> Path:
    """The wheel's ``pytriton/tritonserver`` folder; ``KVCODEC_TRITON_ROOT`` names another one laid
    out the same way (``bin/``, ``backends/python/``, ``python_backend_stubs/``, the libraries in
    ``../../nvidia_pytriton.libs``): the GPU run's unpacked carry (``tests/gpu/triton_carry.py``)."""
    override = os.environ.get("KVCODEC_TRITON_ROOT")
    if override:
        root = Path(override)
        if not (root / "bin" / "tritonserver").is_file():
            raise Unsupported(f"KVCODEC_TRITON_ROOT={override}: no bin/tritonserver there")
        return root
    try:
        import pytriton
    except ImportError:
        raise Unsupported("nvidia-pytriton is not installed (it carries the tritonserver binary)") from None
    root = Path(pytriton.__file__).parent / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise Unsupported(f"no tritonserver binary under {root}")
    return root


def prepare_backends(target: Path) -> Path:
    """A backend folder holding the python backend and the stub for this interpreter: a full Triton
    install's own ``backends/`` (its python backend carries its stub), else ``target``, made from the
    wheel's python backend and its stub for this Python."""
    root = _pytriton_root()
    if (root / "backends" / "python" / STUB).is_file():
        return root / "backends"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise Unsupported(f"no python backend stub for Python {version} in nvidia-pytriton")
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in list((root / "backends" / "python").glob("*.*")) + [stub]:
        dst = python_dir / src.name
        if not dst.exists() or dst.stat().st_size != src.stat().st_size:
            shutil.copy2(src, dst)
    return target


@dataclass(frozen=True)
class GrpcTls:
    """TLS on the gRPC endpoint: the server's certificate and key (PEM); with ``client_ca``, mutual
    TLS: only clients with a certificate that CA signed are served."""
    cert: Path
    key: Path
    client_ca: Optional[Path] = None

    def args(self) -> List[str]:
        for path in (self.cert, self.key, self.client_ca):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"gRPC TLS: {path} is not a file")
        out = ["--grpc-use-ssl=true", f"--grpc-server-cert={self.cert}", f"--grpc-server-key={self.key}"]
        if self.client_ca is not None:
            out += [f"--grpc-root-cert={self.client_ca}", "--grpc-use-ssl-mutual=true"]
        return out


class TritonServer:
    def __init__(self, repo: Path, settings: Settings, ports: Ports = Ports(), log_path: Optional[Path] = None,
                 host: str = "127.0.0.1", tls: Optional[GrpcTls] = None, extra_args: Sequence[str] = ()) -> None:
        self.repo = Path(repo).resolve()
        self.extra_args = list(extra_args)  # tritonserver's own flags, after ours (a later flag wins)
        self.tls = tls
        self.settings = settings
        self.ports = ports
        self.host = host
        self.log_path = Path(log_path) if log_path else settings.home / "logs" / "tritonserver.log"
        self.process: Optional[Process] = None
        # Triton's administrative APIs answer only callers with this header's value (RESTRICTED)
        self.admin_key = os.environ.get("KVCODEC_ADMIN_KEY") or secrets.token_hex(16)

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process else None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports.grpc}"

    def command(self) -> list:
        root = _pytriton_root()
        backends = prepare_backends(self.settings.home / "triton-backends")
        return [
            str(root / "bin" / "tritonserver"),
            f"--model-repository={self.repo}",
            f"--backend-directory={backends}",
            f"--http-address={self.host}", f"--http-port={self.ports.http}",
            f"--grpc-address={self.host}", f"--grpc-port={self.ports.grpc}",
            f"--metrics-address={self.host}", f"--metrics-port={self.ports.metrics}",
            "--allow-metrics=true", "--allow-gpu-metrics=false",
            "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0",
            "--exit-timeout-secs=15", "--log-verbose=0",
            f"--http-restricted-api={RESTRICTED}:{ADMIN_HEADER}={self.admin_key}",
            f"--grpc-restricted-protocol={RESTRICTED}:{ADMIN_HEADER}={self.admin_key}",
            *(self.tls.args() if self.tls is not None else []),
            *self.extra_args,
        ]

    def environment(self) -> dict:
        root = _pytriton_root()
        env = dict(os.environ)
        libs = [str(d) for d in (root.parent.parent / "nvidia_pytriton.libs", root / "lib") if d.is_dir()]
        libs.append(str(sysconfig.get_config_var("LIBDIR")))
        if env.get("LD_LIBRARY_PATH"):
            libs.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(libs)
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        # the stubs' embedded Python reads text files in the locale's encoding (it ignores
        # PYTHONUTF8); under the C locale that is ASCII, and torch (imported by vLLM) reads UTF-8
        if "UTF-8" not in (env.get("LC_ALL") or env.get("LC_CTYPE") or env.get("LANG") or "").upper():
            env["LC_ALL"] = "C.UTF-8"
        env.update(self.settings.environ())
        return env

    def start(self, timeout_s: float = 180.0, append_log: bool = False, attempts: int = 3) -> "TritonServer":
        """Start the server (its log truncated unless ``append_log``) and wait until it and every
        model are ready: ``ServiceError`` (a RuntimeError) if it exits first, ``NotReady`` (a
        TimeoutError; the server is stopped) after ``timeout_s``, each with the log's tail. A start
        that aborts on ``STARTUP_ABORT`` (Triton's python backend, now and then on a loaded machine;
        docs/operations.md) is made again, ``attempts`` times at most, the log appended."""
        for attempt in range(attempts):
            self.process = Process("tritonserver", self.command(), self.log_path, env=self.environment(),
                                   append=append_log or attempt > 0)
            start = self.log_path.stat().st_size if attempt and self.log_path.exists() else 0
            try:
                self.process.start().wait_ready(self.ready, timeout_s, [self.log_path], poll_s=0.5)
                return self
            except ServiceError:
                with open(self.log_path, "rb") as log:  # this attempt's part of the log
                    log.seek(start)
                    aborted = STARTUP_ABORT.encode() in log.read()
                if attempt + 1 >= attempts or not aborted:
                    raise
                self.process.stop()  # what is left of its process group
                print(f"tritonserver aborted while starting ({STARTUP_ABORT}): starting it again",
                      file=sys.stderr, flush=True)
        raise AssertionError("unreachable")

    def alive(self) -> bool:
        """Whether the server process runs (it was started and has not exited)."""
        return self.process is not None and self.process.alive()

    @property
    def returncode(self) -> Optional[int]:
        """The server's exit code once it has exited; None while it runs or when never started."""
        return self.process.returncode if self.process else None

    def stubs(self) -> List[Stub]:
        """The server's python backend stubs, zombies included ([] when it is not running)."""
        return stubs_of(self.pid) if self.pid is not None else []

    def models(self) -> List[str]:
        """The repository's models (its folders with a ``config.pbtxt``): every step of the ensemble
        and the ensemble, or the one model of the trtllm-llmapi variant."""
        return sorted(p.parent.name for p in self.repo.glob("*/config.pbtxt")) or list(MODELS)

    def _get(self, path: str, timeout_s: float = 2.0) -> bool:
        """Whether ``GET path`` on the server's HTTP endpoint answers 200 (asked on loopback when it
        binds every address)."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(self.host, self.host)
        try:
            with urllib.request.urlopen(f"http://{host}:{self.ports.http}{path}", timeout=timeout_s) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def unready_models(self) -> List[str]:
        """The models Triton does not call ready (``/v2/models/<name>/ready``), in the repository's order."""
        return [model for model in self.models() if not self._get(f"/v2/models/{model}/ready")]

    def live_endpoint(self) -> bool:
        """Whether Triton answers its ``/v2/health/live`` (its HTTP front, not a model)."""
        return self._get("/v2/health/live")

    def ready(self) -> bool:
        return self._get("/v2/health/ready") and not self.unready_models()

    def terminate(self) -> None:
        """Ask the server to stop (SIGTERM) without waiting: safe inside a signal handler."""
        if self.process is not None:
            self.process.terminate()

    def wait(self) -> int:
        return self.process.wait() if self.process else 0

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server (it stops its model stubs), SIGKILL to its process group after
        ``grace_s``; returns once nothing of the group is left."""
        process, self.process = self.process, None
        if process is not None:
            process.stop(grace_s)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- kvcodec serve: the server in the foreground --------------------------------------------------
def cmd_serve(args) -> int:
    from kvcodec import engines
    from kvcodec_tools.ports import port_is_free

    ports = [("http", args.http_port), ("grpc", args.grpc_port), ("metrics", args.metrics_port)]
    if args.health_port is not None:
        ports.append(("health", args.health_port))
    busy = [f"{port} (--{name}-port)" for name, port in ports if not port_is_free(args.host, port)]
    if busy:
        print(f"kvcodec serve: port {', '.join(busy)} on {args.host} is in use (another kvcodec serve?): "
              "stop what holds it or pass other ports", file=sys.stderr)
        return 1
    settings = _settings(args)
    engines.prepare(settings)
    unfitted = _warn_unfitted(settings, refuse=args.require_profiles)
    if unfitted:
        return 2
    down = _store_down(settings)
    if down:  # the server starts anyway: a store that comes back is used again
        print(f"kvcodec serve: warning: {down}; requests prefill until the store answers", file=sys.stderr,
              flush=True)
    tls = None
    if args.grpc_tls_cert or args.grpc_tls_key or args.grpc_tls_client_ca:
        if not (args.grpc_tls_cert and args.grpc_tls_key):
            print("kvcodec serve: gRPC TLS needs both --grpc-tls-cert and --grpc-tls-key", file=sys.stderr)
            return 1
        tls = GrpcTls(Path(args.grpc_tls_cert), Path(args.grpc_tls_key),
                      Path(args.grpc_tls_client_ca) if args.grpc_tls_client_ca else None)
    server = TritonServer(Path(args.model_repository), settings,
                          Ports(args.http_port, args.grpc_port, args.metrics_port), host=args.host, tls=tls,
                          extra_args=args.tritonserver_args)
    stopping, watching = [], []  # watching: non-empty while a watchdog runs (it may be restarting the server)
    health = Health(server)
    endpoint = serve_health(health, args.host, args.health_port) if args.health_port is not None else None

    def on_signal(signum, _frame):
        stopping.append(signum)
        health.stopping = True  # readiness fails at once: the balancer stops sending while we drain
        if not watching:
            server.terminate()  # the main thread's wait() returns, then stop() reaps everything

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        return _serve(args, settings, server, health, stopping, watching)
    finally:
        if endpoint is not None:
            endpoint.shutdown()
            endpoint.server_close()


def _serve(args, settings, server, health, stopping: list, watching: list) -> int:
    try:
        server.start(timeout_s=args.timeout)
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        if stopping:
            print("kvcodec serve: stopped before it was ready", flush=True)
            return 0
        print(f"kvcodec serve: {_start_failure(exc, server.log_path)}", file=sys.stderr)
        return 1
    # the watchdog takes the stubs it sees as the healthy set: before "ready", so that a stub that
    # dies right after it is a fault, not a server it never knew
    watchdog = _watchdog(server, watching, args.timeout) if args.watchdog else None
    health.watchdog = watchdog
    health_at = f", health {args.host}:{args.health_port}" if args.health_port is not None else ""
    print(f"kvcodec serve: ready (HTTP {server.http_url}, gRPC {server.grpc_url}, "
          f"metrics {args.host}:{args.metrics_port}{health_at}); store {settings.store}; log {server.log_path}"
          f"{'; watchdog on' if args.watchdog else ''}", flush=True)
    code = _serve_watched(server, watchdog, stopping) if watchdog is not None else server.wait()
    server.stop()
    print("kvcodec serve: stopped", flush=True)
    return 0 if stopping else code


def _start_failure(exc: Exception, log_path: Path) -> str:
    """One line for a server that did not start: the models that failed to load, with the first
    line of each one's error, from the log's model table (else the error's first line), then the log."""
    try:
        rows = log_path.read_text(errors="replace").splitlines()
    except OSError:
        rows = []
    failed = []
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if row.startswith("|") and len(cells) >= 3 and cells[2].startswith("UNAVAILABLE"):
            message = cells[2].split("\\n")[0][:300]  # a multi-line error is quoted on one row
            failed.append(f"model {cells[0]}: {message}")
    reason = "; ".join(dict.fromkeys(failed)) or (str(exc).splitlines() or [type(exc).__name__])[0]
    return f"tritonserver did not start: {reason} (log {log_path})"


def _warn_unfitted(settings, refuse: bool = False) -> str:
    """One line if the ladder or the write-back rungs need a codec profile this model lacks: those
    rungs are misses, and write-back at them fails, until ``kvcodec profile fit --model`` has run.
    ``refuse`` (``--require-profiles``, the containers): an error instead, and the line is returned
    (the server is not started: a deployment fails loudly rather than serving misses)."""
    from kvcodec.engines import model_card
    from kvcodec.errors import ConfigError
    from kvcodec.format.ladder import parse_ladder
    from kvcodec.profiles import require_profiles

    card = model_card(settings)
    try:
        for rungs in (settings.ladder, settings.writeback):
            if rungs:
                require_profiles(parse_ladder(list(rungs), card))
    except ConfigError as exc:
        print(f"kvcodec serve: {'error' if refuse else 'warning'}: {exc}", file=sys.stderr, flush=True)
        return str(exc) if refuse else ""
    return ""


def _watchdog(server, watching: list, start_timeout_s: float):
    """A watchdog started on the ready server. Once ``watching`` is marked, the signal handler only
    appends to ``stopping``: the watchdog may be restarting the server."""
    import logging

    from kvcodec_tools.watchdog import Watchdog

    logging.basicConfig(format="kvcodec serve: %(message)s")
    watching.append(True)
    return Watchdog(server, start_timeout_s=start_timeout_s).start()


def _serve_watched(server, watchdog, stopping: list) -> int:
    """Serve beside the running watchdog until a signal (``stopping``) or until the watchdog gives up
    (its exit code); on a signal this thread halts the watchdog first, then ends a start under way."""
    while not stopping and watchdog.join(0.5):
        pass
    watchdog.halt()
    while watchdog.running():
        server.terminate()  # a start under way fails at once; the watchdog restarts nothing more
        watchdog.join(0.5)
    if watchdog.gave_up:
        print(f"kvcodec serve: more than {watchdog.max_restarts} restarts within {watchdog.window_s:.0f} s; "
              "stopped", file=sys.stderr)
    return watchdog.exit_code or (0 if stopping else 1)  # 1 also when the watchdog itself failed


def register(sub) -> None:
    """``kvcodec serve`` under the CLI's subcommands ``sub``."""
    p = sub.add_parser("serve", help="run tritonserver on the model repository in the foreground")
    common(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--model-repository", default=str(DEFAULT_REPOSITORY))
    p.add_argument("--decoder", choices=["pyav", "nvdec", "auto"])
    p.add_argument("--ladder", "--codecs", dest="ladder",
                   help="comma list of rungs to fetch chunks from, in preference order (KVCODEC_LADDER)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the server to be ready")
    p.add_argument("--grpc-tls-cert", help="the gRPC endpoint's TLS certificate (PEM); with --grpc-tls-key")
    p.add_argument("--grpc-tls-key", help="its private key (PEM)")
    p.add_argument("--grpc-tls-client-ca", help="mutual TLS: serve only clients whose certificate this CA signed")
    p.add_argument("--watchdog", action=argparse.BooleanOptionalAction, default=True,
                   help="restart the server when a python stub or the server dies (default on; at most 5 "
                        "restarts in 300 s, then exit 1)")
    p.add_argument("--require-profiles", action="store_true",
                   help="refuse to start when a rung of the ladder or of write-back needs a codec profile this "
                        "model lacks (default: a warning, and those rungs are misses; the containers set it)")
    p.add_argument("--health-port", type=int,
                   help="serve GET /ready (every model ready in Triton, no dead stub, no restart under way; "
                        "no inference) and GET /live on this port, on --host (the containers: 8003)")
    p.add_argument("tritonserver_args", nargs="*", metavar="-- TRITONSERVER_ARG",
                   help="after --: flags passed to tritonserver after kvcodec serve's own (a later flag wins)")
    p.set_defaults(func=cmd_serve)
