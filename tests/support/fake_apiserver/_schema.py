"""Structural-schema defaulting and pruning of custom resources, as the real API server does.

Optional: enabled with ``FakeKubeApiServer(crd_dir=...)``. Only ``default`` and unknown-field
pruning are implemented (no type/enum/CEL validation): enough to see what a real server would
store for a manifest (e.g. ``numOfHosts: 1`` appears, a field the CRD does not declare vanishes).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=8)
def load_crd_schemas(crd_dir: str) -> dict[tuple[str, str, str], dict]:
    """Map (group, version, plural) -> openAPIV3Schema.

    ``crd_dir`` holds either CustomResourceDefinition YAML files (every served version is used,
    e.g. ../shared/kuberay-crds) or ``<plural>.json`` files that each hold one ray.io/v1
    openAPIV3Schema (the repo's tests/support/schemas/v1.7.0, much faster to load).
    """
    import json

    out: dict[tuple[str, str, str], dict] = {}
    for path in sorted(Path(crd_dir).glob("*.json")):
        with open(path, encoding="utf-8") as fh:
            out[("ray.io", "v1", path.stem)] = json.load(fh)
    if out:
        return out
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for path in sorted(Path(crd_dir).glob("*.yaml")):
        with open(path, encoding="utf-8") as fh:
            for doc in yaml.load_all(fh, Loader=loader):
                if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
                    continue
                spec = doc["spec"]
                for version in spec.get("versions", []):
                    schema = (version.get("schema") or {}).get("openAPIV3Schema")
                    if version.get("served") and schema:
                        out[(spec["group"], version["name"], spec["names"]["plural"])] = schema
    return out


def apply_defaults(schema: dict, value: Any) -> None:
    """Fill in ``default`` values in place (recursively, like apiextensions-apiserver)."""
    if isinstance(value, dict):
        props = schema.get("properties")
        if props:
            for key, sub in props.items():
                if key not in value and "default" in sub:
                    value[key] = copy.deepcopy(sub["default"])
                if key in value and isinstance(sub, dict):
                    apply_defaults(sub, value[key])
        addl = schema.get("additionalProperties")
        if isinstance(addl, dict):
            for item in value.values():
                apply_defaults(addl, item)
    elif isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for item in value:
                apply_defaults(items, item)


def prune(schema: dict, value: Any, path: str = "", *, root: bool = False) -> list[str]:
    """Drop fields the schema does not declare, in place; returns the dropped field paths."""
    dropped: list[str] = []
    if isinstance(value, dict):
        preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
        embedded = bool(schema.get("x-kubernetes-embedded-resource"))
        props = schema.get("properties") or {}
        addl = schema.get("additionalProperties")
        for key in list(value):
            child_path = f"{path}.{key}" if path else key
            if (root or embedded) and key in ("apiVersion", "kind", "metadata"):
                if key == "metadata" and key in props and not root:
                    dropped += prune(props[key], value[key], child_path)
                continue
            if key in props:
                dropped += prune(props[key], value[key], child_path)
            elif isinstance(addl, dict):
                dropped += prune(addl, value[key], child_path)
            elif addl is True or preserve:
                continue
            else:
                del value[key]
                dropped.append(child_path)
    elif isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                dropped += prune(items, item, f"{path}[{i}]")
    return dropped
