"""Deterministic merge of a user's pod-template fragment into a rendered template."""

from __future__ import annotations

import copy
from typing import Any

# Lists whose items Kubernetes identifies by name; others are replaced whole.
_KEYED_LISTS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "name",
    "ports": "name",
    "imagePullSecrets": "name",
    "tolerations": "key",
}


def merge_fragment(base: dict[str, Any], fragment: dict[str, Any] | None) -> dict[str, Any]:
    """Merge ``fragment`` over ``base`` like a strategic merge patch, without mutating either.

    Mappings merge key by key; lists of named items (containers, env, volumes, ...)
    merge item by item on their name, new items appended in the fragment's order;
    every other value in the fragment replaces the base's. ``None`` deletes a key.

    :param base: the rendered object.
    :param fragment: the user's partial object.
    """
    result = copy.deepcopy(base)
    for key, value in (fragment or {}).items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge_fragment(result[key], value)
        elif key in _KEYED_LISTS and isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _merge_keyed(result[key], value, _KEYED_LISTS[key])
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_keyed(base: list[Any], fragment: list[Any], key: str) -> list[Any]:
    merged = [copy.deepcopy(item) for item in base]
    index = {item.get(key): i for i, item in enumerate(merged) if isinstance(item, dict)}
    for item in fragment:
        name = item.get(key) if isinstance(item, dict) else None
        if name is not None and name in index:
            merged[index[name]] = merge_fragment(merged[index[name]], item)
        else:
            merged.append(copy.deepcopy(item))
    return merged
