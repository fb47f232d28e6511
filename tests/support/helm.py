"""Render and lint a Helm chart with Helm's own engine, without a `helm` binary.

`helm-python-sdk` (import name `helm_python`) binds libhelm_c, a C ABI over Helm's
official Go SDK (v4), shipped inside the wheel. Everything used here is offline:
loading a chart, coalescing values, rendering templates (the `lookup` function
returns nothing, as in `helm template`) and linting.

What this module adds is the `helm template` command line around the SDK, so that
the result is what a user with a plain `helm` binary gets:

- values files are parsed by Helm's own YAML reader (`values_from_yaml`, so numbers
  and nulls come out as they do for `helm -f`) and merged left to right the way
  `helm -f a.yaml -f b.yaml` merges them (maps recursively, anything else replaced);
  the chart then coalesces them with its defaults and checks values.schema.json;
- the output drops NOTES.txt, partials and documents that render empty, and orders
  manifests as `helm template` prints them: by Helm's install order of kinds
  (unknown kinds last, alphabetically), then by template path, hooks (e.g.
  `helm test` pods) after everything else.

    render(chart_dir, [values_file])          -> [manifest dict, ...]
    render_templates(chart_dir, [values_file]) -> {template path: rendered text}
    render_text(chart_dir, [values_file])     -> the `helm template` stream
    lint(chart_dir, [values_file])            -> LintReport
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import yaml

__all__ = [
    "INSTALL_ORDER",
    "LintMessage",
    "LintReport",
    "lint",
    "load_values",
    "render",
    "render_notes",
    "render_templates",
    "render_text",
]

StrPath = str | os.PathLike[str]

# helm.sh/helm/v4/pkg/release/v1/util/kind_sorter.go: InstallOrder.
INSTALL_ORDER: tuple[str, ...] = (
    "PriorityClass",
    "Namespace",
    "NetworkPolicy",
    "ResourceQuota",
    "LimitRange",
    "PodSecurityPolicy",
    "PodDisruptionBudget",
    "ServiceAccount",
    "Secret",
    "SecretList",
    "ConfigMap",
    "StorageClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleList",
    "ClusterRoleBinding",
    "ClusterRoleBindingList",
    "Role",
    "RoleList",
    "RoleBinding",
    "RoleBindingList",
    "Service",
    "DaemonSet",
    "Pod",
    "ReplicationController",
    "ReplicaSet",
    "Deployment",
    "HorizontalPodAutoscaler",
    "StatefulSet",
    "Job",
    "CronJob",
    "IngressClass",
    "Ingress",
    "APIService",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
)
_SEVERITIES = {0: "UNKNOWN", 1: "INFO", 2: "WARNING", 3: "ERROR"}
# helm.sh/helm/v4/pkg/release/v1/util/manifest.go: SplitManifests.
_DOC_SEPARATOR = re.compile(r"(?:^|\s*\n)---\s*")


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's mergeMaps (pkg/cli/values): maps merge recursively, the rest is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def load_values(
    values_files: Sequence[StrPath] = (), values: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The user-supplied values of `helm -f file1 -f file2 ...`, then `values` on top
    (like `--set-json`)."""
    merged: dict[str, Any] = {}
    for path in values_files:
        text = Path(path).read_text(encoding="utf-8")
        merged = _merge(merged, helm_python.values_from_yaml(text))
    if values:
        merged = _merge(merged, values)
    return merged


def _raw_render(
    chart_dir: StrPath,
    values_files: Sequence[StrPath],
    values: Mapping[str, Any] | None,
    release: str,
    namespace: str,
) -> dict[str, str]:
    helm_python.validate_release_name(release)
    with helm_python.Chart.load(chart_dir) as chart:
        return chart.render(
            load_values(values_files, values),
            name=release,
            namespace=namespace,
            revision=1,
            is_install=True,
        )


def _is_manifest_template(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return not name.startswith("_") and name != "NOTES.txt"


def render_templates(
    chart_dir: StrPath,
    values_files: Sequence[StrPath] = (),
    *,
    values: Mapping[str, Any] | None = None,
    release: str = "kvgate",
    namespace: str = "kvgate",
) -> dict[str, str]:
    """Rendered text of each template that produced something, by template path
    (e.g. ``kvgate/templates/deployment.yaml``), in template path order."""
    rendered = _raw_render(chart_dir, values_files, values, release, namespace)
    return {
        path: text
        for path, text in sorted(rendered.items())
        if _is_manifest_template(path) and text.strip()
    }


def render_notes(
    chart_dir: StrPath,
    values_files: Sequence[StrPath] = (),
    *,
    values: Mapping[str, Any] | None = None,
    release: str = "kvgate",
    namespace: str = "kvgate",
) -> str:
    """The rendered NOTES.txt (what `helm install` prints)."""
    rendered = _raw_render(chart_dir, values_files, values, release, namespace)
    return next((t for p, t in rendered.items() if p.endswith("/NOTES.txt")), "")


@dataclass(frozen=True)
class _Doc:
    path: str
    index: int
    text: str
    manifest: dict[str, Any]

    @property
    def is_hook(self) -> bool:
        annotations = (self.manifest.get("metadata") or {}).get("annotations") or {}
        return "helm.sh/hook" in annotations


def _order_key(doc: _Doc) -> tuple[int, str, str, int]:
    kind = str(doc.manifest.get("kind", ""))
    if kind in INSTALL_ORDER:
        return (INSTALL_ORDER.index(kind), "", doc.path, doc.index)
    return (len(INSTALL_ORDER), kind, doc.path, doc.index)


def _documents(templates: Mapping[str, str]) -> list[_Doc]:
    docs: list[_Doc] = []
    for path, text in templates.items():
        for index, part in enumerate(_DOC_SEPARATOR.split(text)):
            body = part.strip()
            loaded = yaml.safe_load(body) if body else None
            if loaded is None:
                continue
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: document {index} is not a mapping: {loaded!r}")
            docs.append(_Doc(path, index, body, loaded))
    regular = sorted((d for d in docs if not d.is_hook), key=_order_key)
    hooks = [d for d in docs if d.is_hook]
    return regular + hooks


def render(
    chart_dir: StrPath,
    values_files: Sequence[StrPath] = (),
    *,
    values: Mapping[str, Any] | None = None,
    release: str = "kvgate",
    namespace: str = "kvgate",
) -> list[dict[str, Any]]:
    """The manifests `helm template <release> <chart_dir> -n <namespace> -f ...` prints,
    parsed, in its order. Raises helm_python.HelmError (HelmValuesError for values
    that break values.schema.json, HelmRenderError for a failing template)."""
    templates = render_templates(
        chart_dir, values_files, values=values, release=release, namespace=namespace
    )
    return [doc.manifest for doc in _documents(templates)]


def render_text(
    chart_dir: StrPath,
    values_files: Sequence[StrPath] = (),
    *,
    values: Mapping[str, Any] | None = None,
    release: str = "kvgate",
    namespace: str = "kvgate",
) -> str:
    """The `helm template` stream: ``---\\n# Source: <path>\\n<document>`` per manifest,
    for comparing with the output of a real `helm` binary."""
    templates = render_templates(
        chart_dir, values_files, values=values, release=release, namespace=namespace
    )
    return "".join(f"---\n# Source: {doc.path}\n{doc.text}\n" for doc in _documents(templates))


@dataclass(frozen=True)
class LintMessage:
    severity: str
    path: str
    text: str

    def __str__(self) -> str:
        return f"[{self.severity}] {self.path}: {self.text}"


@dataclass(frozen=True)
class LintReport:
    messages: tuple[LintMessage, ...]
    errors: tuple[str, ...]

    @property
    def problems(self) -> list[str]:
        """Warnings, errors and failures: what `helm lint --strict` fails on."""
        found = [str(m) for m in self.messages if m.severity in ("WARNING", "ERROR", "UNKNOWN")]
        return found + list(self.errors)


def lint(
    chart_dir: StrPath,
    values_files: Sequence[StrPath] = (),
    *,
    values: Mapping[str, Any] | None = None,
    strict: bool = True,
    namespace: str = "kvgate",
    kube_version: str | None = None,
) -> LintReport:
    """`helm lint [--strict] <chart_dir> -f ...` through Helm's linter."""
    report = helm_python.lint(
        chart_dir,
        load_values(values_files, values),
        strict=strict,
        namespace=namespace,
        kube_version=kube_version,
    )
    messages = tuple(
        LintMessage(
            _SEVERITIES.get(int(m.get("severity", 0)), "UNKNOWN"),
            str(m.get("path", "")),
            str(m.get("error", "")),
        )
        for m in report.get("messages") or []
    )
    return LintReport(messages, tuple(str(e) for e in report.get("errors") or []))
