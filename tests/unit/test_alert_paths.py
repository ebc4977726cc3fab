"""Every metric an alert rule, its promtool test or a dashboard panel reads is one the code exports
on the path it is meant for: ``kvcodec serve`` (Triton: triton/metrics.py, the steps' model.py,
Triton's own ``nv_*``) or ``vllm serve`` (engines/vllm_metrics.FAMILIES, vLLM's own ``vllm:*``).
Groups of deploy/prometheus/kvcodec-alerts.yml name their path (``kvcodec``: both); each alert is
fired by a promtool test from series of its path only; the PrometheusRule manifest holds the same
groups. vLLM's own names are checked against its source where vLLM is installed (.venv-vllm)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvcodec.engines.vllm_metrics import FAMILIES

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "kvcodec-alerts.yml"
RULE_TESTS = RULES.with_suffix(".test.yml")
DASHBOARD = REPO / "deploy" / "grafana" / "kvcodec-dashboard.json"
OPERATOR = REPO / "deploy" / "kubernetes" / "prometheusrule.yaml"

TRITON, VLLM = "kvcodec serve", "vllm serve"
PATHS = {"kvcodec": {TRITON, VLLM}, "kvcodec-triton": {TRITON}, "kvcodec-vllm": {VLLM}}
# vLLM's own families the rules and panels read (vllm/v1/metrics/loggers.py; a Counter named
# vllm:request_success is exposed as vllm:request_success_total)
VLLM_OWN = {"vllm:request_success_total": "vllm:request_success",
            "vllm:time_to_first_token_seconds": "vllm:time_to_first_token_seconds"}
_NAME = re.compile(r"\b((?:kvcodec|nv)_[a-z_]+|vllm:[a-z_:]+)")
_SUFFIX = re.compile(r"_bucket$")  # a histogram's buckets: its family


def names(text: str) -> set:
    return {_SUFFIX.sub("", n) for n in _NAME.findall(text)}


def triton_exports() -> set:
    """Families ``kvcodec serve`` exports: the pb_utils.MetricFamily names in the llm step's metrics
    and the steps' model.py (the per-request histograms are named in a loop), and Triton's own."""
    code = (REPO / "backends/kvcodec/triton/metrics.py").read_text()
    code += "".join(p.read_text() for p in (REPO / "model_repository").rglob("model.py"))
    found = set(re.findall(r'MetricFamily\(\s*"((?:kvcodec)_[a-z_]+)"', code))
    loop = re.search(r'for name, what in \(([^)]*\)[^:]*)\):\s*\n\s*family = pb_utils\.MetricFamily\(f"kvcodec_\{name\}_seconds"',
                     code)
    assert loop, "the llm step's seconds histograms are no longer made in their loop: update this test"
    found |= {f"kvcodec_{s}_seconds" for s in re.findall(r'\("([a-z]+)", "', loop.group(1))}
    return found | {"nv_inference_count"}


def vllm_exports() -> set:
    return set(FAMILIES) | set(VLLM_OWN)


def exported(path: str) -> set:
    return triton_exports() if path == TRITON else vllm_exports()


def rules_by_alert() -> dict:
    out = {}
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        assert group["name"] in PATHS, f"group {group['name']!r} names no path ({', '.join(PATHS)})"
        for rule in group["rules"]:
            out[rule["alert"]] = (PATHS[group["name"]], rule["expr"])
    return out


def test_the_exporters_are_read_as_they_are():
    t = triton_exports()
    assert {"kvcodec_ttft_seconds", "kvcodec_fetch_seconds", "kvcodec_decoder_selftest_passed",
            "kvcodec_store_breaker_state", "kvcodec_misses_total"} <= t
    assert "kvcodec_ttft_seconds" not in vllm_exports() and "kvcodec_decoder_selftest_passed" not in vllm_exports()


def test_every_rule_reads_only_what_each_of_its_paths_exports():
    for alert, (paths, expr) in rules_by_alert().items():
        for path in paths:
            missing = names(expr) - exported(path)
            assert not missing, f"{alert} reads {sorted(missing)}, which {path} does not export"


def test_every_alert_is_fired_by_a_promtool_test_from_series_of_each_of_its_paths():
    fired = {}  # alert -> the paths whose series fired it
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        series = {names(s["series"]).pop() for s in case["input_series"]}
        paths = {p for p in (TRITON, VLLM) if series <= exported(p)}
        assert paths, f"a test case's series come from no one path: {sorted(series)}"
        for t in case["alert_rule_test"]:
            if t["exp_alerts"]:
                fired.setdefault(t["alertname"], set()).update(paths)
    for alert, (paths, _) in rules_by_alert().items():
        assert paths <= fired.get(alert, set()), f"{alert} is not fired by a test on {paths - fired.get(alert, set())}"


def test_every_dashboard_panel_shows_data_on_each_path_or_says_which():
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        read = names(" ".join(t["expr"] for t in panel["targets"]))
        assert read <= triton_exports() | vllm_exports(), panel["title"]
        for path in (TRITON, VLLM):
            if not read & exported(path):
                assert f"{(TRITON if path == VLLM else VLLM)} only" in panel["title"], \
                    f"panel {panel['title']!r} stays empty on {path}"


def test_the_prometheus_rule_manifest_holds_the_same_groups():
    manifest = yaml.safe_load(OPERATOR.read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert manifest["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_the_rule_file_cites_tests_that_exist():
    for text in (RULES.read_text(), RULE_TESTS.read_text(), DASHBOARD.read_text(), OPERATOR.read_text()):
        for cited in re.findall(r"tests/[a-z_/]+\.py", text):
            assert (REPO / cited).is_file(), f"cites {cited}, which does not exist"


def test_vllms_own_names_are_vllms():
    loggers = pytest.importorskip("vllm.v1.metrics.loggers", reason="vLLM is not installed here (.venv-vllm)")
    source = Path(loggers.__file__).read_text()
    for exposed, declared in VLLM_OWN.items():
        assert f'"{declared}"' in source, f"vLLM no longer declares {declared} (exposed as {exposed})"
