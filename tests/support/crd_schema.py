"""Validate rendered manifests against KubeRay's CRD schemas, strictly.

An object schema with ``properties`` and neither ``additionalProperties`` nor
``x-kubernetes-preserve-unknown-fields`` is treated as closed, so an unknown field
fails validation instead of being silently pruned by the API server.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

SCHEMAS = Path(__file__).parent / "schemas"
KUBERAY_VERSIONS = ("v1.5.0", "v1.7.0")


def _closed(node: Any) -> Any:
    if isinstance(node, list):
        return [_closed(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _closed(value) for key, value in node.items()}
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def validator(kuberay_version: str, plural: str) -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMAS / kuberay_version / f"{plural}.json").read_text())
    return jsonschema.Draft7Validator(_closed(schema))


def schema_errors(manifest: dict[str, Any], plural: str, kuberay_version: str) -> list[str]:
    """Every schema violation of ``manifest``, as ``path: message`` lines."""
    errors = validator(kuberay_version, plural).iter_errors(manifest)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)
