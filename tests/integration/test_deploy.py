"""What a deployment runs against a real server: ``kvcodec probe`` (one token through the ensemble;
a dead address fails it), ``kvcodec serve``'s health endpoint (the probes': a dead stub turns /ready
503 until the watchdog's restart, /live stays 200), and a real Prometheus that scrapes a real
tritonserver under requests, loads the alert rules (deploy/prometheus) and answers every metric a
rule reads and every query of the dashboard (deploy/grafana) with series."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from kvcodec_client import KVCodecClient

from .conftest import KVCODEC, REPO, free_ports, ingest_text, kill_tree, start_serve, text_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

QUESTION = "\n\n# Question: what does this module do?\n# Answer:"
RULES = REPO / "deploy" / "prometheus" / "kvcodec-alerts.yml"


def _probe(*args) -> subprocess.CompletedProcess:
    return subprocess.run([KVCODEC, "probe", *args], capture_output=True, text=True, timeout=120)


def test_the_liveness_probe_passes_on_a_live_server_and_fails_on_a_dead_one(server):
    ok = _probe("--url", server.grpc_url)
    assert ok.returncode == 0 and ok.stdout.startswith(f"ok: {server.grpc_url} answered 1 token"), ok.stderr
    assert _probe("--url", server.http_url, "--protocol", "http").returncode == 0
    [dead] = free_ports(1)
    failed = _probe("--url", f"127.0.0.1:{dead}", "--timeout-s", "5")
    assert failed.returncode == 1 and "no server at" in failed.stderr


def _query(port: int, expr: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture
def prometheus(server, tmp_path):
    binary = shutil.which("prometheus")
    if not binary:
        pytest.skip("prometheus is not installed (.ci/install-services installs it)")
    [port] = free_ports(1)
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(RULES)],
              "scrape_configs": [{"job_name": "kvcodec",
                                  "static_configs": [{"targets": [f"127.0.0.1:{server.ports.metrics}"]}]}]}
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if any(r["value"][1] == "1" for r in _query(port, 'up{job="kvcodec"}')):
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_prometheus_scrapes_every_metric_a_rule_or_panel_reads(server, settings, tokenizer, prometheus, tmp_path):
    from tests.unit.test_deploy import dashboard_queries, metric_names

    text = text_of(tokenizer, "heapq.py", 540)
    ingest_text(settings, tmp_path, text, codec="int8-zstd")
    ids = tokenizer.encode(text + QUESTION)
    client = KVCodecClient(server.grpc_url, "grpc")
    reused = client.generate(ids, 2, reuse=True, codecs="int8-zstd")
    assert reused.reused_tokens == 512
    client.generate(ids, 2, reuse=False)
    time.sleep(4)  # scrapes after the requests
    used = metric_names(RULES.read_text()) | metric_names("\n".join(dashboard_queries()))
    missing = [name for name in sorted(used)
               if not _query(prometheus, f'count({{__name__=~"{name}(_bucket)?", job="kvcodec"}})')]
    assert not missing, f"metrics no scrape returned: {missing}"
    empty = [expr for expr in dashboard_queries() if not _query(prometheus, expr)]
    assert not empty, f"dashboard queries with no series: {empty}"
    with urllib.request.urlopen(f"http://127.0.0.1:{prometheus}/api/v1/rules", timeout=10) as r:
        groups = json.loads(r.read())["data"]["groups"]
    rules = [rule for g in groups for rule in g["rules"]]
    assert len(rules) == 8 and all(rule["health"] == "ok" for rule in rules), rules
    assert not [rule["name"] for rule in rules if rule["state"] != "inactive"]  # a healthy server alerts nothing


def test_the_admin_apis_refuse_callers_without_the_admin_header(server):
    """Model control (and shared memory, trace, logging) answer only with ``kvcodec-admin``; health,
    metadata and inference stay open (the probe above went through)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    def index(headers: dict) -> int:
        request = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", data=b"{}",
                                         method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert index({}) == 403
    assert index({"kvcodec-admin": "wrong"}) == 403
    assert index({"kvcodec-admin": server.admin_key}) == 200
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException):
            client.get_model_repository_index()
        # over gRPC Triton reads the header as triton-grpc-protocol-<name>
        admin = {"triton-grpc-protocol-kvcodec-admin": server.admin_key}
        assert client.get_model_repository_index(headers=admin) is not None
        assert client.is_server_ready() and client.get_model_metadata("kvcodec")
    finally:
        client.close()


def _health(port: int, path: str) -> tuple:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode().strip()
    except OSError as exc:
        return 0, str(exc)


def test_serves_health_follows_a_dead_stub_through_the_watchdogs_restart(settings, tmp_path):
    """The probes' endpoint on a real ``kvcodec serve``: /ready 200 once every step is ready; a killed
    kv_decode stub (Triton itself keeps saying ready) turns /ready 503 at once, and 200 again after
    the watchdog's restart; /live stays 200 throughout (nothing for the kubelet to kill)."""
    import os
    import signal

    from kvcodec_tools.tritonserver import children, stubs_of

    http, grpc, metrics, health = free_ports(4)
    proc, line = start_serve(settings, tmp_path, "--http-port", str(http), "--grpc-port", str(grpc),
                             "--metrics-port", str(metrics), "--health-port", str(health))
    try:
        assert "kvcodec serve: ready" in line and f"health 127.0.0.1:{health}" in line, line
        assert _health(health, "/ready") == (200, "ready")
        assert _health(health, "/live") == (200, "live")
        (server,) = children(proc.pid)
        (stub,) = [s for s in stubs_of(server) if s.model == "kv_decode"]
        os.kill(stub.pid, signal.SIGKILL)
        seen, lives = [], set()
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            status, body = _health(health, "/ready")
            lives.add(_health(health, "/live")[0])
            seen.append((status, body))
            if status == 200 and len(seen) > 1:
                break
            time.sleep(0.2)
        assert seen[0][0] == 503 and "kv_decode" in _health_reasons(seen), seen[:3]
        assert seen[-1] == (200, "ready"), seen[-3:]
        assert lives == {200}
        assert children(proc.pid) != [server]  # restarted
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, rest
    finally:
        kill_tree(proc)


def _health_reasons(seen: list) -> str:
    return " ".join(body for status, body in seen if status == 503)
