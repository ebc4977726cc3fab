"""What deploy/ holds, checked offline: the Dockerfiles lint clean (hadolint) and pin what they
install at the tested versions (requirements.txt); the Kubernetes manifests validate against
Kubernetes' schemas (kubernetes-validate, strict) and fit together (labels, ports, probes, the
Secret and ConfigMap they read); the alert rules pass promtool's checks and their own rule tests;
every dashboard query parses; every metric a rule or a panel reads is one the code exports. A real
Prometheus scraping a real server: tests/integration/test_deploy.py."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name if (BIN / name).exists() else shutil.which(name)
    if not path:
        pytest.skip(f"{name} is not installed (make setup; promtool: .ci/install-services)")
    return str(path)


def _run(*cmd) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120)


def _pins() -> dict:
    pins = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==(\S+)", line.strip())
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


@pytest.mark.parametrize("dockerfile", sorted((DEPLOY / "docker").glob("Dockerfile*")), ids=lambda p: p.name)
def test_dockerfiles_lint_clean_and_pin_the_tested_versions(dockerfile):
    out = _run(_tool("hadolint"), dockerfile)
    assert out.returncode == 0, out.stdout + out.stderr
    text = dockerfile.read_text()
    assert "nvcr.io/nvidia/tritonserver:${TRITON_TAG}" in text and "kvcodec-entrypoint" in text
    pins = _pins()
    for name, version in re.findall(r"\b([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([0-9][^\s\"']*)", text):
        if name.lower() in pins:
            assert version == pins[name.lower()], f"{dockerfile.name}: {name}=={version}, tested {pins[name.lower()]}"
    assert "KVCODEC_TRITON_ROOT=/opt/tritonserver" in text  # kvcodec serve runs the container's tritonserver
    assert re.search(r"^EXPOSE 8000 8001 8002 8003$", text, re.M)  # 8003: the probes' health port
    engine = re.search(r"KVCODEC_ENGINE=(\w+)", text)
    if dockerfile.name == "Dockerfile.vllm":
        assert engine and engine.group(1) == "vllm"  # the engine to serve traffic with


def test_entrypoint_is_valid_sh():
    assert _run("sh", "-n", DEPLOY / "docker" / "entrypoint.sh").returncode == 0


def _entrypoint(tmp_path, **env) -> tuple:
    """Run the containers' entrypoint in a temporary root: ``kvcodec repository`` is the real one;
    whatever the script then execs to serve (``kvcodec serve``, ``tritonserver``) is a shim that
    writes its arguments to ``served.json`` and exits. Returns (the run, the served argv or None)."""
    shims = tmp_path / "shims"
    shims.mkdir(exist_ok=True)
    record = tmp_path / "served.json"
    recorder = (f"#!{sys.executable}\nimport json, sys\n"
                f"open({str(record)!r}, 'w').write(json.dumps(sys.argv))\n")
    (shims / "tritonserver").write_text(recorder)
    (shims / "kvcodec").write_text(
        f"#!/bin/sh\nif [ \"$1\" = serve ]; then exec {shims / 'tritonserver'} \"$@\"; fi\n"
        f"exec {BIN / 'kvcodec'} \"$@\"\n")
    for shim in shims.iterdir():
        shim.chmod(0o755)
    environ = {"PATH": f"{shims}:{BIN}:/usr/bin:/bin", "HOME": str(tmp_path), "KVCODEC_VARIANT": "gpu", **env}
    run = subprocess.run(["sh", DEPLOY / "docker" / "entrypoint.sh", "--log-verbose=1"], env=environ,
                         capture_output=True, text=True, timeout=120)
    return run, (json.loads(record.read_text()) if record.exists() else None)


def _read_only_model(root: Path) -> Path:
    """A model folder as the Deployment mounts it (read-only at /models/llm)."""
    model = root / "models" / "llm"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(b"weights")
    for path in (model / "config.json", model / "model.safetensors", model, model.parent):
        path.chmod(0o555 if path.is_dir() else 0o444)
    return model


def _model_intact(model: Path) -> bool:
    return (model / "model.safetensors").read_bytes() == b"weights" and (model / "config.json").is_file()


def test_the_entrypoint_writes_the_repository_beside_the_model_never_over_it(tmp_path):
    from kvcodec_tools.repository import MARKER

    model = _read_only_model(tmp_path)
    home = tmp_path / "var" / "lib" / "kvcodec"
    run, served = _entrypoint(tmp_path, KVCODEC_HOME=str(home), KVCODEC_MODEL=str(model))
    assert run.returncode == 0, run.stdout + run.stderr
    repository = home / "repository"  # the default: $KVCODEC_HOME/repository, not /models
    assert (repository / MARKER).is_file() and (repository / "kvcodec" / "config.pbtxt").is_file()
    assert 'decoder"' in (repository / "kv_decode" / "config.pbtxt").read_text()  # the gpu variant
    assert served[served.index("--model-repository") + 1] == str(repository)
    assert _model_intact(model)
    # started again (a container restart): the folder it wrote is replaced
    run, served = _entrypoint(tmp_path, KVCODEC_HOME=str(home), KVCODEC_MODEL=str(model))
    assert run.returncode == 0 and (repository / MARKER).is_file(), run.stderr
    # pointed at the model's parent (the old default, /models): refused, the model untouched
    (tmp_path / "served.json").unlink()
    run, served = _entrypoint(tmp_path, KVCODEC_HOME=str(home), KVCODEC_MODEL=str(model),
                              KVCODEC_REPOSITORY=str(model.parent))
    assert run.returncode != 0 and served is None
    assert "refusing to delete" in run.stderr and str(model.parent) in run.stderr
    assert _model_intact(model)
    assert sorted(p.name for p in model.parent.iterdir()) == ["llm"]


def test_the_entrypoint_serves_through_kvcodec_serve_with_its_watchdog_and_health_port(tmp_path):
    """Not tritonserver bare: kvcodec serve (the watchdog, on by default; the admin APIs restricted,
    TritonServer.command; gRPC TLS from the environment), on every address, with the health port
    the probes read; the image's arguments reach tritonserver after --."""
    model = _read_only_model(tmp_path)
    home = tmp_path / "home"
    tls = {"KVCODEC_GRPC_TLS_CERT": "/run/tls/tls.crt", "KVCODEC_GRPC_TLS_KEY": "/run/tls/tls.key",
           "KVCODEC_GRPC_TLS_CLIENT_CA": "/run/tls/ca.crt"}
    run, served = _entrypoint(tmp_path, KVCODEC_HOME=str(home), KVCODEC_MODEL=str(model), **tls)
    assert run.returncode == 0, run.stderr
    assert served[1] == "serve" and "--no-watchdog" not in served
    args, tritonserver = served[2:served.index("--")], served[served.index("--") + 1:]
    assert "--require-profiles" in args  # a ladder whose codec profile is absent fails the start, loudly
    args.remove("--require-profiles")
    options = dict(zip(args[::2], args[1::2], strict=True))
    assert options == {"--host": "0.0.0.0", "--model-repository": str(home / "repository"), "--http-port": "8000",
                       "--grpc-port": "8001", "--metrics-port": "8002", "--health-port": "8003",
                       "--timeout": "1800", "--grpc-tls-cert": "/run/tls/tls.crt",
                       "--grpc-tls-key": "/run/tls/tls.key", "--grpc-tls-client-ca": "/run/tls/ca.crt"}
    assert tritonserver == ["--log-verbose=1"]
    from kvcodec_tools.cli import build_parser

    parsed = build_parser().parse_args(served[1:])  # every flag is one kvcodec serve takes
    assert (parsed.health_port, parsed.watchdog, parsed.tritonserver_args) == (8003, True, ["--log-verbose=1"])


def test_the_images_carry_no_model_and_the_entrypoint_asks_for_one(tmp_path):
    for dockerfile in sorted((DEPLOY / "docker").glob("Dockerfile*")):
        commands = [line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")]
        assert not [line for line in commands if "smollm2" in line], dockerfile.name  # no demo model
        assert "GPL" in dockerfile.read_text(), dockerfile.name  # PyAV's FFmpeg: x264, x265
    run, served = _entrypoint(tmp_path, KVCODEC_HOME=str(tmp_path / "home"))
    assert run.returncode == 2 and served is None
    assert "KVCODEC_MODEL is not set" in run.stderr and not (tmp_path / "home" / "repository").exists()
    assert "GPL" in (DEPLOY / "README.md").read_text()


def _dockerignore(patterns, path: str) -> bool:
    """Whether Docker leaves ``path`` out of the build context: the last pattern that matches the path
    or one of its parent folders decides (``!`` re-includes); ``*`` stays within a folder, ``**`` does not."""
    def regex(pattern: str):
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            else:
                out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
                i += 1
        return re.compile(out + "$")

    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        if any(regex(pattern.lstrip("!")).match(p) for p in prefixes):
            excluded = not negated
    return excluded


def test_the_build_context_holds_what_the_install_reads_and_nothing_else(tmp_path):
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split("\0")
    files = [f for f in tracked if f and (REPO / f).exists()] + [
        ".git/HEAD", ".venv/bin/python", ".venv-vllm/bin/python", ".cache/chunk.key", ".cache/models/m/config.json",
        "backends/kvcodec/__pycache__/x.cpython-311.pyc", "kvcodec.egg-info/PKG-INFO"]
    context = [f for f in files if not _dockerignore(patterns, f)]
    left_out = [f for f in files if _dockerignore(patterns, f)]
    for secret_or_heavy in (".git/HEAD", ".venv/bin/python", ".venv-vllm/bin/python", ".cache/chunk.key",
                            ".cache/models/m/config.json", "backends/kvcodec/__pycache__/x.cpython-311.pyc",
                            "kvcodec.egg-info/PKG-INFO"):
        assert secret_or_heavy in left_out
    assert not [f for f in context if f.startswith(("tests/", "perf/results/", "docs/"))]
    # the context is enough for the images' install: the wheel built from exactly it carries the package
    for f in context:
        src, dst = REPO / f, tmp_path / "ctx" / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(src.readlink())
        else:
            shutil.copy2(src, dst)
    assert "deploy/docker/entrypoint.sh" in context  # COPY deploy/docker/entrypoint.sh
    out = _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
               tmp_path / "ctx", "-w", tmp_path / "dist")
    assert out.returncode == 0, out.stdout + out.stderr
    import zipfile

    (wheel,) = (tmp_path / "dist").glob("kvcodec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"kvcodec_tools/cli.py", "kvcodec_tools/model_repository/kvcodec/config.pbtxt",
            "kvcodec_tools/model_repository/llm/1/model.py", "kvcodec_client/client.py"} <= names
    assert any(n.startswith("kvcodec/profiles/") and n.endswith(".npz") for n in names)


MANIFESTS = sorted(m for m in (DEPLOY / "kubernetes").glob("*.yaml") if m.name != "kustomization.yaml")
OVERLAYS = ("cpu", "gpu")


def test_kubernetes_manifests_validate_strictly():
    crds = ("servicemonitor.yaml", "prometheusrule.yaml")  # the operator's: checked by their fields
    core = [m for m in MANIFESTS if m.name not in crds]
    out = _run(_tool("kubernetes-validate"), "--strict", "--quiet", *core)
    assert out.returncode == 0 and "ERROR" not in out.stdout + out.stderr, out.stdout + out.stderr


def test_kubernetes_manifests_fit_together():
    yaml = pytest.importorskip("yaml")
    every = [d for m in MANIFESTS for d in yaml.safe_load_all(m.read_text()) if d]
    docs = {d["kind"]: d for d in every if d["metadata"]["name"] in ("kvcodec", "kvcodec-settings", "kvcodec-secrets",
                                                                      "kvcodec-store-gc")}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    [server] = pod["containers"]
    sources = {s.get("configMapRef", s.get("secretRef"))["name"] for s in server["envFrom"]}
    assert sources == {docs["ConfigMap"]["metadata"]["name"], docs["Secret"]["metadata"]["name"]}
    assert "KVCODEC_CHUNK_KEY" in docs["Secret"]["stringData"]
    health = next(p["containerPort"] for p in server["ports"] if p["name"] == "health")
    assert health == 8003  # the entrypoint's --health-port
    probes = {kind: server[f"{kind}Probe"] for kind in ("startup", "readiness", "liveness")}
    for probe in probes.values():  # cheap: none is an inference (no exec of kvcodec probe)
        assert "exec" not in probe and probe["httpGet"]["port"] == "health"
    assert [probes[k]["httpGet"]["path"] for k in ("startup", "readiness", "liveness")] == ["/ready", "/ready", "/live"]
    assert probes["startup"]["periodSeconds"] * probes["startup"]["failureThreshold"] >= 1800  # the start timeout
    ports = {p["name"] for p in server["ports"]}
    assert {p["targetPort"] for p in docs["Service"]["spec"]["ports"]} <= ports
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert docs["Service"]["spec"]["selector"].items() <= labels.items()
    monitor = docs["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= docs["Service"]["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"metrics"}
    gc = docs["CronJob"]["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert gc[:3] == ["kvcodec", "store", "gc"]
    assert docs["ConfigMap"]["data"]["KVCODEC_ENGINE"] == "vllm"
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in every}
    for name in ("kvcodec", "kvcodec-vllm-serve"):  # the Triton ensemble and vllm serve beside it
        spec = by_name[("Deployment", name)]["spec"]["template"]["spec"]
        [container] = spec["containers"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"  # the python backend's tensors
        assert "persistentVolumeClaim" in volumes[mounts["/var/lib/kvcodec/models"]]  # a cache that persists
        assert not any("configMap" in v for v in volumes.values())  # no profile squeezed into 1 MiB
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert all(p["httpGet"]["path"] in ("/ready", "/live", "/health")
                   for p in (container[f"{k}Probe"] for k in ("startup", "readiness", "liveness")))
        assert spec["serviceAccountName"] == by_name[("ServiceAccount", "kvcodec")]["metadata"]["name"]
        store_ca = volumes[mounts["/etc/kvcodec/store-ca"]]["secret"]
        assert store_ca["optional"] is True and docs["ConfigMap"]["data"]["KVCODEC_STORE_CA_FILE"].startswith(
            "/etc/kvcodec/store-ca/")
    vllm = by_name[("Deployment", "kvcodec-vllm-serve")]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "KVCodecConnector" in vllm[vllm.index("--kv-transfer-config") + 1]
    pdb = by_name[("PodDisruptionBudget", "kvcodec")]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items() and pdb["maxUnavailable"] == 1
    policy = by_name[("NetworkPolicy", "kvcodec")]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert {p["port"] for rule in policy["ingress"] for p in rule["ports"]} == {8000, 8001, 8002}
    fit = by_name[("Job", "kvcodec-profile-fit")]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert fit[:3] == ["kvcodec", "profile", "fit"]
    assert docs["ConfigMap"]["data"]["KVCODEC_STORE"].startswith(("rediss://", "https://", "s3://"))  # TLS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_kustomize_overlays_render_and_validate(overlay, tmp_path):
    """deploy/overlays/{cpu,gpu} over deploy/kubernetes, rendered by kubectl's kustomize, validated
    strictly; the gpu overlay gives every Deployment a GPU and the GPU nodes' toleration, cpu none."""
    yaml = pytest.importorskip("yaml")
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its kustomize) is not installed: the overlays are not rendered")
    out = _run(kubectl, "kustomize", DEPLOY / "overlays" / overlay)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    core = [d for d in docs if d["kind"] not in ("ServiceMonitor", "PrometheusRule")]
    for i, d in enumerate(core):
        (tmp_path / f"{i}.yaml").write_text(yaml.safe_dump(d))
    check = _run(_tool("kubernetes-validate"), "--strict", "--quiet", *sorted(tmp_path.glob("*.yaml")))
    assert check.returncode == 0 and "ERROR" not in check.stdout + check.stderr, check.stdout + check.stderr
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} == {"kvcodec", "kvcodec-vllm-serve"}
    settings = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    assert settings["KVCODEC_VARIANT"] == overlay
    for d in deployments:
        spec = d["spec"]["template"]["spec"]
        gpus = spec["containers"][0]["resources"]["limits"].get("nvidia.com/gpu")
        tolerated = [t["key"] for t in spec.get("tolerations", [])]
        assert (gpus, tolerated) == ((1, ["nvidia.com/gpu"]) if overlay == "gpu" else (None, []))


RULES = DEPLOY / "prometheus" / "kvcodec-alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "kvcodec-dashboard.json"


def test_alert_rules_pass_promtool_and_their_tests():
    promtool = _tool("promtool")
    check = _run(promtool, "check", "rules", RULES)
    assert check.returncode == 0, check.stdout + check.stderr
    tests = _run(promtool, "test", "rules", RULES.with_suffix(".test.yml"))
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr


def dashboard_queries() -> list:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def test_every_dashboard_query_parses(tmp_path):
    promtool = _tool("promtool")
    rules = {"groups": [{"name": "panels", "rules": [{"record": f"panel:{i}", "expr": e}
                                                      for i, e in enumerate(dashboard_queries())]}]}
    path = tmp_path / "panels.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    out = _run(promtool, "check", "rules", path)
    assert out.returncode == 0, out.stdout + out.stderr


def metric_names(text: str) -> set:
    names = set(re.findall(r"\b((?:kvcodec|nv)_[a-z_]+)", text))
    return {n.removesuffix("_bucket") for n in names}  # a histogram's buckets: its family


def test_every_metric_a_rule_or_panel_reads_is_exported():
    code = "".join(p.read_text() for d in (REPO / "backends", REPO / "model_repository") for p in d.rglob("*.py"))
    used = metric_names(RULES.read_text()) | metric_names("\n".join(dashboard_queries()))
    triton_own = {"nv_inference_count"}
    # the per-request histograms are named in a loop: f"kvcodec_{name}_seconds" over ttft, fetch, ...
    stages = {f"kvcodec_{s}_seconds" for s in ("ttft", "fetch", "decode", "restore")}
    assert 'f"kvcodec_{name}_seconds"' in code
    missing = sorted(n for n in used - triton_own - stages if f'"{n}"' not in code)
    assert not missing, missing
    assert {"kvcodec_store_breaker_state", "kvcodec_misses_total", "kvcodec_requests_total",
            "kvcodec_writeback_total", "kvcodec_decoder_selftest_passed"} <= used


def test_the_prefix_router_config_is_valid_nginx_and_hashes_the_clients_header(tmp_path):
    """deploy/router/nginx-prefix.conf passes ``nginx -t`` and hashes the header the client library
    sends (``kvcodec_client.ROUTE_HEADER``), consistently."""
    from kvcodec_client import ROUTE_HEADER

    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        pytest.skip("nginx is not installed (.ci/install-services)")
    conf = DEPLOY / "router" / "nginx-prefix.conf"
    (tmp_path / "logs").mkdir()
    done = _run(nginx, "-t", "-p", tmp_path, "-c", conf, "-e", "stderr", "-g", f"pid {tmp_path / 'nginx.pid'};")
    assert done.returncode == 0, done.stderr
    variable = "$http_" + ROUTE_HEADER.lower().replace("-", "_")
    assert f"hash {variable} consistent;" in conf.read_text()
