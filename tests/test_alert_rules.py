"""The Prometheus alert rules: promtool accepts them, their unit tests pass, the generated
copies are up to date, and every alert carries what an on-call person needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.prometheus import ToolMissing, promtool_path

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "deploy" / "prometheus" / "rules.py"
PLAIN = ROOT / "deploy" / "prometheus" / "kvgate-rules.yaml"
UNIT_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "kvgate-rules.test.yaml"
PROMETHEUS_RULE = ROOT / "deploy" / "kubernetes" / "base" / "prometheusrule.yaml"
HELM_RULES = ROOT / "helm" / "kvgate" / "files" / "kvgate-rules.yaml"

SEVERITIES = {"warning", "critical", "page"}
# The symptoms the rules must cover (docs/contracts.md metric -> at least one alert on it).
REQUIRED_METRICS = {
    "kvgate_kv_forecast_peak_ratio",
    "kvgate_kv_forecast_exhaustion_seconds",
    "vllm:num_preemptions_total",
    "kvgate_requests_total",
    "kvgate_prediction_error_ratio_bucket",
    "kvgate_queue_requests",
    "kvgate_queue_wait_seconds_bucket",
    "kvgate_upstream_up",
    "kvgate_upstream_metrics_age_seconds",
    "kvgate_kv_events_stale",
}


@pytest.fixture(scope="module")
def promtool() -> str:
    try:
        return promtool_path()
    except ToolMissing as error:
        pytest.fail(str(error), pytrace=False)


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _alerts() -> list[dict[str, Any]]:
    return [rule for group in _load(PLAIN)["groups"] for rule in group["rules"] if "alert" in rule]


def test_promtool_check_rules(promtool: str) -> None:
    result = _run([promtool, "check", "rules", str(PLAIN)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests(promtool: str) -> None:
    result = _run([promtool, "test", "rules", str(UNIT_TESTS)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_unit_tests_cover_every_alert_firing_and_silent() -> None:
    fired: set[str] = set()
    silent: set[str] = set()
    for case in _load(UNIT_TESTS)["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {alert["alert"] for alert in _alerts()}
    assert names - fired == set(), "alerts without a firing unit test"
    assert names - silent == set(), "alerts without a healthy (silent) unit test"


@pytest.mark.parametrize(
    "script", ["deploy/prometheus/rules.py", "dashboards/generate.py"], ids=["rules", "dashboard"]
)
def test_generated_files_are_up_to_date(script: str) -> None:
    result = _run([sys.executable, str(ROOT / script), "--check"])
    assert result.returncode == 0, f"{result.stderr}\nregenerate with: python {script}"


def test_every_alert_is_actionable() -> None:
    alerts = _alerts()
    assert len(alerts) >= 7
    for alert in alerts:
        name = alert["alert"]
        assert alert.get("for"), f"{name}: no for:"
        assert alert.get("labels", {}).get("severity") in SEVERITIES, f"{name}: severity"
        annotations = alert.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            assert annotations.get(key, "").strip(), f"{name}: no {key} annotation"
        runbook = annotations["runbook"]
        # A runbook says what to do: numbered steps naming a flag or a command.
        assert "1." in runbook and ("--" in runbook or "kubectl" in runbook), name


def test_alerts_cover_the_required_symptoms() -> None:
    expressions = "\n".join(alert["expr"] for alert in _alerts())
    missing = {metric for metric in REQUIRED_METRICS if metric not in expressions}
    assert missing == set()


def test_alerts_keep_instance_and_job() -> None:
    for alert in _alerts():
        expr = alert["expr"]
        # One alert per sidecar (or vLLM server), never one for the whole fleet.
        assert "by (" in expr, alert["alert"]
        for clause in expr.split("by (")[1:]:
            labels = clause.split(")")[0]
            assert "instance" in labels and "job" in labels, (alert["alert"], labels)


def test_prometheus_rule_matches_the_plain_file() -> None:
    plain = _load(PLAIN)
    operator = _load(PROMETHEUS_RULE)
    assert operator["apiVersion"] == "monitoring.coreos.com/v1"
    assert operator["kind"] == "PrometheusRule"
    assert operator["metadata"]["name"] == "kvgate"
    assert operator["metadata"]["labels"]["app.kubernetes.io/name"] == "kvgate"
    assert operator["spec"]["groups"] == plain["groups"]
    assert _load(HELM_RULES) == plain


def test_helm_copy_embeds_under_spec() -> None:
    """The chart writes the file, trimmed, indented by 2 under ``spec:`` (nindent 2)."""
    text = HELM_RULES.read_text(encoding="utf-8").strip()
    embedded = "spec:\n" + "\n".join(f"  {line}" if line else line for line in text.splitlines())
    assert yaml.safe_load(embedded)["spec"] == _load(PLAIN)
    # Prometheus templates must reach the operator verbatim (no Helm `tpl`).
    assert "{{ $labels.instance }}" in text
