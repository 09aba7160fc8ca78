"""What a RayCluster used, read when it is deleted: chip-hours from ready to gone by capacity kind, the slices
made again meanwhile (a preempted spot slice, a repaired host), and a cost estimate where the user gave prices.

Ready is when the cluster first became ready: KubeRay's ``status.stateTransitionTimes.ready``, which it sets
when ``state`` becomes ``ready`` and, as ``state`` is never reset from ``ready``, only once (the local backend
records it alike). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from airflow_provider_raytpu.status.cluster import NODE_TYPE_LABEL, REPLICA_INDEX_LABEL
from airflow_provider_raytpu.status.conditions import parse_time
from airflow_provider_raytpu.tpu import TpuSlice

#: The XCom key (and asset-event extra) of a teardown's usage records.
USAGE_XCOM_KEY = "tpu_usage"


def ready_at(cluster: Mapping[str, Any]) -> datetime | None:
    """When the cluster first became ready, or ``None`` when it never did."""
    text = ((cluster.get("status") or {}).get("stateTransitionTimes") or {}).get("ready")
    return parse_time(text) if text else None


def slices_made_again(pods: Iterable[Mapping[str, Any]], since: datetime) -> dict[str, datetime]:
    """The slices (by replica index) with a host pod made after ``since``, each with its first such pod's creation.

    Each was made again at least once after the cluster was ready (a preempted spot slice, a repaired host); only
    the last time shows, as the pods of an earlier one are gone.
    """
    made_again: dict[str, datetime] = {}
    for pod in pods:
        metadata = pod.get("metadata") or {}
        labels = metadata.get("labels") or {}
        created = metadata.get("creationTimestamp")
        if labels.get(NODE_TYPE_LABEL) == "worker" and created and (when := parse_time(created)) > since:
            index = str(labels.get(REPLICA_INDEX_LABEL))
            made_again[index] = min(when, made_again.get(index, when))
    return made_again


def slice_timeline(num_slices: int, made_again: Mapping[str, datetime]) -> list[dict[str, Any]]:
    """One entry per slice: its index and when it was made again after ready (``None``: never)."""
    return [{"index": index, "made_again_at": made_again[str(index)].isoformat() if str(index) in made_again else None}
            for index in range(num_slices)]


def tpu_usage(cluster: Mapping[str, Any], pods: Iterable[Mapping[str, Any]], tpu: TpuSlice, gone: datetime,
              prices: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, Any]:
    """The usage record of a cluster that is gone at ``gone`` (plain JSON).

    :param cluster: the RayCluster as last read before its deletion.
    :param pods: its pods as last read before its deletion.
    :param tpu: its slice shape and capacity.
    :param gone: when the cluster and its pods were gone.
    :param prices: checked by :func:`~airflow_provider_raytpu.values.check_prices`; no estimate without a price
        for the generation and kind.
    """
    metadata = cluster.get("metadata") or {}
    ready = ready_at(cluster)
    hours = max(0.0, (gone - ready).total_seconds() / 3600) if ready else 0.0
    kind = tpu.capacity.kind
    chip_hours = round(hours * tpu.total_chips, 6)
    created = metadata.get("creationTimestamp")
    made_again = slices_made_again(pods, ready) if ready else {}
    usage: dict[str, Any] = {
        "cluster_name": metadata.get("name"),
        "namespace": metadata.get("namespace"),
        "accelerator": tpu.accelerator,
        "topology": tpu.topology,
        "num_slices": tpu.num_slices,
        "chips": tpu.total_chips,
        "capacity": str(tpu.capacity),
        "created_at": parse_time(created).isoformat() if created else None,
        "ready_at": ready.isoformat() if ready else None,
        "gone_at": gone.isoformat(),
        "hours": round(hours, 6),
        "chip_hours": {kind: chip_hours},
        "slices_recreated": len(made_again),
        "slices": slice_timeline(tpu.num_slices, made_again),
    }
    price = (prices or {}).get(tpu.accelerator, {}).get(kind)
    if price is not None:
        usage["estimated_cost"] = {kind: round(chip_hours * price, 4)}
    return usage


def describe_usage(usage: Mapping[str, Any]) -> str:
    """One line for the task log."""
    if usage["ready_at"] is None:
        return f"RayCluster {usage['namespace']}/{usage['cluster_name']} was never ready: no chip-hours"
    hours = sum(usage["chip_hours"].values())
    cost = usage.get("estimated_cost")
    return (f"RayCluster {usage['namespace']}/{usage['cluster_name']} used {hours:.4g} chip-hours of "
            f"{usage['capacity']} ({usage['chips']} chips for {_span(usage['hours'] * 3600)} from ready to gone)"
            + (f", {usage['slices_recreated']} slice(s) made again meanwhile" if usage["slices_recreated"] else "")
            + (f"; estimated cost {sum(cost.values()):.4g}" if cost else ""))


def _span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"
