"""Every PromQL expression of the dashboard and of the alert rules, ready to evaluate.

For tests that run them against a real Prometheus (syntax with ``promtool``, data with
the HTTP API). Grafana's template variables are replaced by something Prometheus
evaluates:

* ``$__rate_interval`` -> ``1m``, ``$__interval`` -> ``15s``, ``$__range`` -> ``1h``
  (and their ``_s`` / ``_ms`` forms);
* the dashboard's own variables (``$model``, ``$instance``, ...), which it uses only as
  regex matchers (``label=~"$var"``) -> ``.*``, i.e. "All".

    from dashboards.queries import dashboard_queries, rule_expressions
    for expr in dashboard_queries("dashboards/kvgate.json"): ...

Pure functions; PyYAML for the rules file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "BUILTIN_VALUES",
    "dashboard_queries",
    "dashboard_variables",
    "panel_targets",
    "rule_expressions",
    "substitute",
]

BUILTIN_VALUES = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__interval_ms": "15000",
    "__range": "1h",
    "__range_s": "3600",
    "__range_ms": "3600000",
}
ALL_VALUE = ".*"

# $var, ${var}, ${var:format}, [[var]], [[var:format]]
_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)(?::[^\]]*)?\]\]")


def substitute(expr: str, variables: dict[str, str] | None = None) -> str:
    """Replace Grafana variables in ``expr``.

    Built-in ``$__*`` variables get ``BUILTIN_VALUES`` (an unknown one raises
    ``ValueError``); others get ``variables[name]``, else ``.*``.
    """
    given = variables or {}

    def replace(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group is not None)
        if name in given:
            return given[name]
        if name.startswith("__"):
            if name not in BUILTIN_VALUES:
                raise ValueError(f"no value for Grafana's ${name} in {expr!r}")
            return BUILTIN_VALUES[name]
        return ALL_VALUE

    return _VARIABLE.sub(replace, expr)


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        # Collapsed rows keep their panels inside the row.
        yield from _panels(panel.get("panels", []))


def _load(path: str | Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
    return data


def panel_targets(path: str | Path) -> list[tuple[str, str]]:
    """(panel title, raw expression) for every query target of every panel, in order."""
    result = []
    for panel in _panels(_load(path).get("panels", [])):
        for target in panel.get("targets", []):
            if "expr" in target:
                result.append((str(panel.get("title", "")), str(target["expr"])))
    return result


def dashboard_queries(path: str | Path) -> list[str]:
    """Every panel query of the dashboard at ``path``, variables substituted."""
    return [substitute(expr) for _, expr in panel_targets(path)]


def dashboard_variables(path: str | Path) -> dict[str, str]:
    """The dashboard's template variables: name -> type (``datasource``, ``query``...)."""
    templating = _load(path).get("templating", {}).get("list", [])
    return {str(v["name"]): str(v.get("type", "")) for v in templating}


def rule_expressions(path: str | Path) -> list[str]:
    """Every ``expr`` (alerting and recording rules) of a plain Prometheus rules file."""
    document = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    return [
        str(rule["expr"]).strip()
        for group in document.get("groups", [])
        for rule in group.get("rules", [])
    ]
