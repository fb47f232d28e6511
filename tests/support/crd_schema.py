"""A published CustomResourceDefinition as a JSON Schema validator.

The CRD files under tests/data/crds are the projects' own, copied unchanged (their
README names each one's repository, path and version). A custom resource is checked as
the API server and `kubectl apply --validate=strict` check it: against the
`openAPIV3Schema` of its version, where a field the schema does not declare is an
error (unless the schema keeps unknown fields), plus the rules the API server applies
to every object (apiVersion and kind, a metadata.name that is a DNS subdomain).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

# OpenAPI v3 keywords that mean the same in JSON Schema (2020-12).
_SAME = ("type", "enum", "pattern", "minLength", "maxLength", "minimum", "maximum",
         "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems", "uniqueItems",
         "minProperties", "maxProperties", "required", "multipleOf")
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
# The ObjectMeta fields a manifest sets; the API server fills in the others.
OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 253, "pattern": _DNS_SUBDOMAIN},
        "namespace": {"type": "string", "maxLength": 63, "pattern": _DNS_LABEL},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}


def _pattern(go_pattern: str) -> str:
    """A Go (RE2) pattern for Python's re: inline flags such as `(?i)` go first (Go
    allows them anywhere, Python only at the start)."""
    flags = re.findall(r"\(\?[a-zA-Z]+\)", go_pattern)
    for flag in flags:
        go_pattern = go_pattern.replace(flag, "", 1)
    return "".join(flags) + go_pattern


def _convert(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {key: node[key] for key in _SAME if key in node}
    if "pattern" in out:
        out["pattern"] = _pattern(out["pattern"])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    for key in ("anyOf", "allOf", "oneOf"):
        if key in node:
            out[key] = [_convert(part) for part in node[key]]
    if "not" in node:
        out["not"] = _convert(node["not"])
    if "items" in node:
        out["items"] = _convert(node["items"])
    if "properties" in node:
        out["properties"] = {name: _convert(sub) for name, sub in node["properties"].items()}
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        out["additionalProperties"] = _convert(extra)
    elif isinstance(extra, bool):
        out["additionalProperties"] = extra
    elif "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False  # an undeclared field is an error (strict)
    return out


def crd_schema(path: Path, version: str) -> tuple[str, str, dict[str, Any]]:
    """(apiVersion, kind, JSON Schema) of one served version of the CRD at `path`."""
    crd = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert crd["kind"] == "CustomResourceDefinition", f"{path}: not a CRD"
    spec = crd["spec"]
    api_version = f"{spec['group']}/{version}"
    served = [v for v in spec["versions"] if v["name"] == version and v.get("served")]
    assert served, f"{path}: no served version {version}"
    schema = _convert(served[0]["schema"]["openAPIV3Schema"])
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["required"] = sorted({"apiVersion", "kind", "metadata", *schema.get("required", [])})
    properties = schema.setdefault("properties", {})
    properties["apiVersion"] = {"const": api_version}
    properties["kind"] = {"const": spec["names"]["kind"]}
    properties["metadata"] = OBJECT_META
    return api_version, spec["names"]["kind"], schema


def published_versions(path: Path) -> list[str]:
    """The versions a CRD file serves."""
    crd = yaml.safe_load(path.read_text(encoding="utf-8"))
    return [v["name"] for v in crd["spec"]["versions"] if v.get("served")]
