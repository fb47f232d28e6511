"""The Grafana dashboard: structure, variables, metric coverage and valid PromQL."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards.queries import (
    dashboard_queries,
    dashboard_variables,
    panel_targets,
    rule_expressions,
    substitute,
)
from support.prometheus import ToolMissing, promtool_path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "dashboards" / "kvgate.json"
HELM_DASHBOARD = ROOT / "helm" / "kvgate" / "files" / "kvgate-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "kvgate-rules.yaml"
CONTRACTS = ROOT / "docs" / "contracts.md"
DS_UID = "${datasource}"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def _contract_metrics(prefix: str) -> set[str]:
    """Metric names in docs/contracts.md: the metrics table, and the vLLM list below it."""
    text = CONTRACTS.read_text(encoding="utf-8")
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(rf"`({re.escape(prefix)}[a-z_:]+)`", section))


def _uses(metric: str, text: str) -> bool:
    pattern = rf"(?<![\w:]){re.escape(metric)}(_bucket|_count|_sum)?(?![\w:])"
    return re.search(pattern, text) is not None


def test_schema_and_import(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 39
    assert "__inputs" not in dashboard and "__requires" not in dashboard
    assert dashboard["uid"] == "kvgate"
    assert dashboard["id"] is None
    assert HELM_DASHBOARD.read_text(encoding="utf-8") == DASHBOARD.read_text(encoding="utf-8")


def test_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables["datasource"]
    assert datasource["type"] == "datasource"
    assert datasource["query"] == "prometheus"
    for name, source in (("model", "kvgate_info"), ("instance", "kvgate_info")):
        variable = variables[name]
        assert variable["type"] == "query"
        assert variable["datasource"]["uid"] == DS_UID
        assert variable["query"].startswith(f"label_values({source}")
        assert variable["query"].endswith(f", {name})")
    assert variables["vllm_instance"]["query"].startswith("label_values(vllm:")
    assert dashboard_variables(DASHBOARD) == {n: v["type"] for n, v in variables.items()}


def test_every_panel_queries_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert len(panels) >= 15
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels:
        title = panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": DS_UID}, title
        assert panel["targets"], title
        assert panel.get("description"), title
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, title
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), title
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == DS_UID, title
            assert target["expr"].strip(), title


def test_variables_and_intervals_are_used_properly() -> None:
    declared = set(dashboard_variables(DASHBOARD)) - {"datasource"}
    for title, expr in panel_targets(DASHBOARD):
        # Selections are multi-valued: only ever regex matchers.
        for name in re.findall(r"\$\{?(\w+)", expr):
            if name.startswith("__"):
                continue
            assert name in declared, (title, name)
            assert re.search(rf'=~"\$\{{?{name}\}}?"', expr), (title, expr)
        # Rates follow the scrape interval Grafana knows about.
        for window in re.findall(r"(?:rate|increase)\([^\[]*\[([^\]]+)\]", expr):
            assert window in ("$__rate_interval", "$__range"), (title, expr)


def test_contract_metrics_are_all_shown_or_alerted() -> None:
    kvgate = _contract_metrics("kvgate_")
    assert len(kvgate) == 41, sorted(kvgate)
    panels = "\n".join(expr for _, expr in panel_targets(DASHBOARD))
    rules = "\n".join(rule_expressions(RULES))
    missing = {m for m in kvgate if not _uses(m, panels) and not _uses(m, rules)}
    assert missing == set()
    # The server's own metrics, beside kvgate's.
    vllm = _contract_metrics("vllm:")
    assert "vllm:kv_cache_usage_perc" in vllm
    assert {m for m in vllm if not _uses(m, panels)} == set()


@pytest.mark.parametrize(
    ("topic", "metrics"),
    [
        ("decisions", ["kvgate_requests_total"]),
        (
            "kv",
            [
                "kvgate_kv_capacity_blocks",
                "kvgate_kv_reserved_blocks",
                "kvgate_kv_used_blocks",
                "kvgate_kv_forecast_peak_ratio",
            ],
        ),
        ("ttft", ["kvgate_predicted_ttft_seconds", "kvgate_observed_ttft_seconds"]),
        ("tpot", ["kvgate_predicted_tpot_seconds", "kvgate_observed_tpot_seconds"]),
        ("concurrency", ["kvgate_recommended_max_concurrency", "kvgate_inflight_requests"]),
        ("queue", ["kvgate_queue_requests"]),
        ("upstream", ["kvgate_upstream_up"]),
    ],
)
def test_panels_show_related_series_together(topic: str, metrics: list[str]) -> None:
    by_panel: dict[str, str] = {}
    for title, expr in panel_targets(DASHBOARD):
        by_panel[title] = by_panel.get(title, "") + "\n" + expr
    assert any(all(_uses(m, text) for m in metrics) for text in by_panel.values()), topic


def test_forecast_is_shown_in_blocks() -> None:
    exprs = [expr for _, expr in panel_targets(DASHBOARD)]
    assert any(
        "kvgate_kv_forecast_peak_ratio" in e and "* kvgate_kv_capacity_blocks" in e for e in exprs
    )


def test_substitution() -> None:
    assert substitute('rate(x{instance=~"$instance"}[$__rate_interval])') == (
        'rate(x{instance=~".*"}[1m])'
    )
    assert substitute('x{model=~"${model:regex}"}[$__interval]') == 'x{model=~".*"}[15s]'
    assert substitute('x{a=~"[[model]]"}', {"model": "m1"}) == 'x{a=~"m1"}'
    with pytest.raises(ValueError, match="__nonsense"):
        substitute("x[$__nonsense]")
    for expr in dashboard_queries(DASHBOARD):
        assert "$" not in expr and "[[" not in expr, expr


def test_every_query_parses(tmp_path: Path) -> None:
    """promtool parses every expression of a rules file: feed it the queries as records."""
    try:
        promtool = promtool_path()
    except ToolMissing as error:
        pytest.fail(str(error), pytrace=False)
    queries = dashboard_queries(DASHBOARD)
    assert len(queries) >= 30
    rules = [{"record": f"kvgate_dashboard:query_{i}", "expr": q} for i, q in enumerate(queries)]
    alerts = [
        {"record": f"kvgate_alert:expr_{i}", "expr": e}
        for i, e in enumerate(rule_expressions(RULES))
    ]
    path = tmp_path / "queries.yaml"
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules + alerts}]}),
        encoding="utf-8",
    )
    result = subprocess.run(
        [promtool, "check", "rules", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules) + len(alerts)} rules found" in result.stdout
