"""``kvcodec serve``'s health endpoint (``--health-port``): what a Kubernetes probe, a load balancer or
a person asks, answered from the serving process without an inference.

- ``GET /ready``: 200 ``ready`` when the pipeline can take traffic, else 503 with the first reason:
  ``kvcodec serve`` is stopping; tritonserver is not running; the watchdog is restarting it, has
  given up, or sees a model stub that died (Triton 2.51 keeps answering ready with a dead stub, so
  its own ``/v2/health/ready`` would not say); or a model of the repository (every step of the
  ensemble) is not ready by Triton's per-model ``/v2/models/<name>/ready``. A handful of local HTTP
  calls and a look at /proc: no prefill, nothing the engine computes.
- ``GET /live``: 200 ``live`` while this process serves and its server is running or being
  restarted; 503 once the watchdog gave up (``kvcodec serve`` then exits 1) or when tritonserver no
  longer answers its own ``/v2/health/live`` and no restart is under way. A busy server still
  answers it (Triton's HTTP threads are not the model's), so a long queue of prefills never fails
  liveness.

``Health(server, watchdog)`` composes the answers (``ready()``, ``live()``: ``(ok, reason)``);
``serve_health(health, host, port)`` serves them on a daemon thread until its ``shutdown()``.
``server`` is a ``TritonServer`` (``alive()``, ``unready_models()``, ``live_endpoint()``), the
watchdog a ``kvcodec_tools.watchdog.Watchdog`` (``problem()``) or None (``--no-watchdog``).
"""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional, Tuple


class Health:
    def __init__(self, server, watchdog=None) -> None:
        self.server = server
        self.watchdog = watchdog  # set once the server is up (the watchdog starts on a running server)
        self.stopping = False  # set by kvcodec serve's signal handler: a plain assignment

    def ready(self) -> Tuple[bool, str]:
        if self.stopping:
            return False, "kvcodec serve is stopping"
        watchdog = self.watchdog
        problem = watchdog.problem() if watchdog is not None else ""
        if problem:
            return False, problem
        if not self.server.alive():
            return False, "tritonserver is not running"
        unready = self.server.unready_models()
        if unready:
            return False, f"not ready in Triton: {', '.join(unready)}"
        return True, "ready"

    def live(self) -> Tuple[bool, str]:
        watchdog = self.watchdog
        if watchdog is not None and watchdog.gave_up:
            return False, watchdog.problem()
        if watchdog is not None and watchdog.restarting:
            return True, "live (restarting tritonserver)"
        if self.server.alive() and not self.server.live_endpoint():
            return False, "tritonserver does not answer /v2/health/live"
        return True, "live"


def serve_health(health: Health, host: str, port: int) -> ThreadingHTTPServer:
    """``health`` on ``http://host:port/ready`` and ``/live``, served by a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?")[0].rstrip("/")
            answer: Optional[Tuple[bool, str]] = {"/ready": health.ready, "/live": health.live}.get(path, lambda: None)()
            if answer is None:
                status, body = 404, "not found: GET /ready or /live\n"
            else:
                status, body = (200 if answer[0] else 503), answer[1] + "\n"
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # probes every few seconds: not a log line each
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="kvcodec-health", daemon=True).start()
    return httpd
