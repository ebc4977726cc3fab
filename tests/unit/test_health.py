"""``kvcodec serve``'s health endpoint (``kvcodec_tools.health``): readiness follows the pipeline (a
dead stub the watchdog sees, a restart under way, the guard having given up, a model Triton does not
call ready, a server that stops) without an inference; liveness fails only when the watchdog gave up
or Triton's HTTP front is gone outside a restart. Against fakes (no tritonserver) and a fake Triton
HTTP endpoint for ``TritonServer``'s per-model readiness; a real ``kvcodec serve``:
tests/integration/test_deploy.py."""
from __future__ import annotations

import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvcodec.settings import Settings
from kvcodec_tools.health import Health, serve_health
from kvcodec_tools.ports import free_port
from kvcodec_tools.tritonserver import Ports, TritonServer
from kvcodec_tools.watchdog import Watchdog

from .test_watchdog import WAIT_S, FakeServer


class Pipeline(FakeServer):
    """The watchdog's fake server, with what readiness asks of Triton: the models it calls unready
    and whether its HTTP front answers."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.unready: list = []
        self.http_live = True

    def unready_models(self) -> list:
        return list(self.unready)

    def live_endpoint(self) -> bool:
        return self.http_live


def _get(port: int, path: str) -> tuple:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def endpoint():
    started = []

    def start(health: Health) -> int:
        port = free_port()
        started.append(serve_health(health, "127.0.0.1", port))
        return port

    yield start
    for httpd in started:
        httpd.shutdown()
        httpd.server_close()


def test_ready_and_live_while_the_pipeline_is_sound(endpoint):
    server = Pipeline()
    port = endpoint(Health(server, Watchdog(server).start()))
    assert _get(port, "/ready") == (200, "ready\n")
    assert _get(port, "/live") == (200, "live\n")
    assert _get(port, "/v2/health/ready")[0] == 404


def test_a_dead_stub_is_not_ready_before_the_watchdog_acts_and_still_live(endpoint):
    server = Pipeline()
    watchdog = Watchdog(server)
    watchdog.start()
    watchdog.halt()  # it acts on nothing: readiness must see the fault itself
    port = endpoint(Health(server, watchdog))
    server.kill("kv_decode", zombie=True)
    status, body = _get(port, "/ready")
    assert status == 503 and "the stub of model kv_decode" in body and "zombie" in body
    assert _get(port, "/live")[0] == 200  # the watchdog restarts it; killing the pod would not help


def test_not_ready_while_the_watchdog_restarts_the_server_and_live_throughout(endpoint):
    server = Pipeline()
    release, starting = threading.Event(), threading.Event()
    start = server.start

    def slow_start(timeout_s=180.0, append_log=False):
        starting.set()
        assert release.wait(WAIT_S)
        return start(timeout_s, append_log)

    server.start = slow_start
    watchdog = Watchdog(server, interval_s=0.01).start()
    port = endpoint(Health(server, watchdog))
    try:
        server.kill("llm")
        assert starting.wait(WAIT_S)
        status, body = _get(port, "/ready")
        assert status == 503 and body.startswith("restarting tritonserver (the stub of model llm")
        assert _get(port, "/live") == (200, "live (restarting tritonserver)\n")
    finally:
        release.set()
        watchdog.stop(WAIT_S)
    assert _get(port, "/ready") == (200, "ready\n")


def test_the_guard_giving_up_fails_liveness(endpoint):
    server = Pipeline()
    watchdog = Watchdog(server, interval_s=0.01, max_restarts=1)
    watchdog.start()
    watchdog.halt()
    health = Health(server, watchdog)
    port = endpoint(health)
    server.crash()
    watchdog._halt.clear()
    assert watchdog.tick()  # the first restart
    server.crash()
    assert not watchdog.tick() and watchdog.gave_up  # the second within the window: the guard
    for path in ("/ready", "/live"):
        status, body = _get(port, path)
        assert status == 503 and "gave up after 1 restarts" in body


def test_a_model_triton_calls_unready_or_a_stopping_serve_is_not_ready(endpoint):
    server = Pipeline()
    health = Health(server)  # --no-watchdog
    port = endpoint(health)
    server.unready = ["kv_restore"]
    assert _get(port, "/ready") == (503, "not ready in Triton: kv_restore\n")
    server.unready = []
    health.stopping = True
    assert _get(port, "/ready") == (503, "kvcodec serve is stopping\n")


def test_triton_that_no_longer_answers_fails_liveness_outside_a_restart(endpoint):
    server = Pipeline()
    port = endpoint(Health(server, None))
    server.http_live = False
    assert _get(port, "/live") == (503, "tritonserver does not answer /v2/health/live\n")
    server.crash()
    assert _get(port, "/ready") == (503, "tritonserver is not running\n")


class FakeTriton(BaseHTTPRequestHandler):
    ready = {"kv_fetch", "kvcodec"}  # of the repository's models: the others are loading

    def do_GET(self) -> None:  # noqa: N802
        parts = self.path.strip("/").split("/")
        ok = self.path == "/v2/health/live" or (len(parts) == 4 and parts[3] == "ready" and parts[2] in self.ready)
        self.send_response(200 if ok else 400)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_the_servers_unready_models_are_the_repositorys_by_tritons_per_model_ready(tmp_path):
    for name in ("kv_fetch", "kv_decode", "kvcodec"):
        (tmp_path / "repo" / name).mkdir(parents=True)
        (tmp_path / "repo" / name / "config.pbtxt").write_text(f'name: "{name}"\n')
    (tmp_path / "repo" / "notes").mkdir()  # no config.pbtxt: not a model
    triton = ThreadingHTTPServer(("127.0.0.1", 0), FakeTriton)
    threading.Thread(target=triton.serve_forever, daemon=True).start()
    try:
        server = TritonServer(tmp_path / "repo", Settings.load({"home": str(tmp_path)}),
                              Ports(http=triton.server_address[1]), host="0.0.0.0")  # asked on loopback
        assert server.models() == ["kv_decode", "kv_fetch", "kvcodec"]
        assert server.unready_models() == ["kv_decode"]
        assert server.live_endpoint()
    finally:
        triton.shutdown()
        triton.server_close()
    assert server.unready_models() == server.models() and not server.live_endpoint()  # nothing answers


def test_serve_takes_a_health_port_and_passes_tritonserver_flags_after_dashes(tmp_path):
    from kvcodec_tools.cli import build_parser

    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--health-port", "8003", "--",
                                      "--log-verbose=1", "--cuda-memory-pool-byte-size=0:67108864"])
    assert args.health_port == 8003
    assert args.tritonserver_args == ["--log-verbose=1", "--cuda-memory-pool-byte-size=0:67108864"]
    server = TritonServer(Path("model_repository"), Settings.load({"home": str(tmp_path)}), Ports(),
                          extra_args=args.tritonserver_args)
    assert server.command()[-2:] == args.tritonserver_args  # after ours: a later flag wins in Triton


def test_a_full_triton_install_is_served_with_its_own_backends(tmp_path, monkeypatch):
    """NVIDIA's containers (KVCODEC_TRITON_ROOT=/opt/tritonserver): their python backend carries the
    stub built for the container's Python; kvcodec serve uses that folder as it is."""
    from kvcodec_tools.tritonserver import STUB, prepare_backends

    root = tmp_path / "opt" / "tritonserver"
    for path in (root / "bin" / "tritonserver", root / "backends" / "python" / STUB,
                 root / "backends" / "python" / "libtriton_python.so"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    (root / "lib").mkdir()
    monkeypatch.setenv("KVCODEC_TRITON_ROOT", str(root))
    assert prepare_backends(tmp_path / "unused") == root / "backends"
    assert not (tmp_path / "unused").exists()
    server = TritonServer(Path("model_repository"), Settings.load({"home": str(tmp_path)}), Ports())
    command = server.command()
    assert command[0] == str(root / "bin" / "tritonserver")
    assert f"--backend-directory={root / 'backends'}" in command
    assert server.environment()["LD_LIBRARY_PATH"].split(":")[0] == str(root / "lib")


STAND_IN = """\
import os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
count = os.path.join(sys.argv[1], "starts")
n = int(open(count).read()) + 1 if os.path.exists(count) else 1
open(count, "w").write(str(n))
if n <= int(sys.argv[2]):  # as Triton's python backend does now and then under load
    print("terminate called after throwing an instance of '" + sys.argv[3] + "'", flush=True)
    os.abort()
class Ready(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[4])), Ready).serve_forever()
"""


@pytest.mark.parametrize("aborts, starts", [(0, 1), (2, 3)])
def test_a_start_aborted_by_the_python_backends_lock_is_made_again(tmp_path, aborts, starts):
    """Triton's python backend now and then aborts the server while it starts on a loaded machine
    (``boost::interprocess::lock_exception``): ``TritonServer.start`` starts it again, at most
    ``attempts`` times; any other exit is an error at once."""
    from kvcodec_tools.ports import free_ports
    from kvcodec_tools.procs import ServiceError
    from kvcodec_tools.tritonserver import STARTUP_ABORT

    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    [port] = free_ports(1)
    server = TritonServer(tmp_path / "repo", Settings.load({"home": str(tmp_path)}), Ports(http=port))
    server.command = lambda: [sys.executable, str(script), str(tmp_path), str(aborts), STARTUP_ABORT, str(port)]
    try:
        server.start(timeout_s=60)
        assert server.ready() and int((tmp_path / "starts").read_text()) == starts
    finally:
        server.stop()
    (tmp_path / "starts").unlink()
    with pytest.raises(ServiceError):  # aborted every time: three starts, then the error
        server.command = lambda: [sys.executable, str(script), str(tmp_path), "9", STARTUP_ABORT, str(port)]
        server.start(timeout_s=60)
    assert int((tmp_path / "starts").read_text()) == 3
    (tmp_path / "starts").unlink()
    with pytest.raises(ServiceError):  # another abort: no second start
        server.command = lambda: [sys.executable, str(script), str(tmp_path), "9", "std::bad_alloc", str(port)]
        server.start(timeout_s=60)
    assert int((tmp_path / "starts").read_text()) == 1
