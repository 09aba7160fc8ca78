"""What pins a TPU host pod to its slice, and what a pod-template override changed of it.

A TPU host lands on its slice's nodes by the node selectors of the slice shape and capacity kind
(``cloud.google.com/gke-tpu-accelerator``, ``gke-tpu-topology``, spot, reservation, flex-start), tolerates
their taints, and asks for all of its host's chips (``google.com/tpu``). A ``worker_pod_template`` merged
over it could change or drop any of these while the cluster's slice annotation still states the shape:
the sensor would count hosts of another shape, or hosts on no TPU at all. :func:`placement_changes` lists
such changes; adding selectors, tolerations or containers without chips is not one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from airflow_provider_raytpu.tpu import TPU_RESOURCE


def _spec(template: Mapping[str, Any]) -> Mapping[str, Any]:
    return template.get("spec") or {}


def _chips(template: Mapping[str, Any]) -> dict[str, str | None]:
    """``container/requests`` and ``container/limits`` -> its ``google.com/tpu`` (``None`` when absent)."""
    found = {}
    for container in _spec(template).get("containers") or []:
        resources = container.get("resources") or {}
        for kind in ("requests", "limits"):
            found[f"{container.get('name')}/{kind}"] = (resources.get(kind) or {}).get(TPU_RESOURCE)
    return found


def placement_changes(rendered: Mapping[str, Any], merged: Mapping[str, Any]) -> list[str]:
    """What ``merged`` (the template with the user's override) changed of ``rendered``'s TPU placement.

    :param rendered: the TPU host pod template the slice shape renders.
    :param merged: the same after the user's ``worker_pod_template`` was merged over it.
    :returns: readable changes, e.g. ``nodeSelector['cloud.google.com/gke-tpu-topology']: '4x4' -> '2x2'``.
    """
    changes = []
    ours, theirs = _spec(rendered).get("nodeSelector") or {}, _spec(merged).get("nodeSelector") or {}
    for key, value in ours.items():
        if theirs.get(key) != value:
            changes.append(f"nodeSelector[{key!r}]: {value!r} -> {theirs.get(key)!r}")
    kept = {json.dumps(toleration, sort_keys=True) for toleration in _spec(merged).get("tolerations") or []}
    for toleration in _spec(rendered).get("tolerations") or []:
        if json.dumps(toleration, sort_keys=True) not in kept:
            changes.append(f"toleration {toleration.get('key')!r} ({toleration.get('effect')}) dropped or changed")
    before, after = _chips(rendered), _chips(merged)
    for where in sorted(set(before) | set(after)):
        if before.get(where) != after.get(where):
            changes.append(f"{where} {TPU_RESOURCE}: {before.get(where)!r} -> {after.get(where)!r}")
    return changes
