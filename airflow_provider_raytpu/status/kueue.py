"""Kueue's hold on a RayCluster, read from its Workload.

With Kueue's RayCluster integration, a RayCluster labelled ``kueue.x-k8s.io/queue-name`` is suspended
by Kueue's webhook when it is made, and Kueue makes a Workload for it (labelled
``kueue.x-k8s.io/job-uid=<the cluster's uid>``). While the Workload waits for quota its
``QuotaReserved`` condition is ``False`` with reason ``Pending`` (the message says which resource
lacks quota in which flavor) or ``Inadmissible`` (the LocalQueue or ClusterQueue does not exist or is
inactive); once admitted, ``status.admission.clusterQueue`` names the ClusterQueue and Kueue
unsuspends the cluster with the flavor's node labels. An eviction (preemption by a workload of
higher priority, a pods-ready timeout) suspends it again: ``Evicted=True``, and it queues again.
Sources: Kueue v0.17 ``apis/kueue/v1beta2/workload_types.go`` (conditions) and
``pkg/controller/core/workload_controller.go`` (the Inadmissible messages).

A cluster Kueue holds is PROVISIONING, never FAILED, because waiting for quota is what a queue is
for; an Inadmissible one is PROVISIONING with reason :data:`KUEUE_INADMISSIBLE`, which fails the wait
when it lasts longer than its grace (a misspelt ``queue_name`` would otherwise wait forever).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from airflow_provider_raytpu.status.cluster import KUEUE_INADMISSIBLE, ClusterStatus, Phase
from airflow_provider_raytpu.status.conditions import conditions, is_true

QUEUE_NAME_LABEL = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
WORKLOADS = "workloads"
LOCAL_QUEUES = "localqueues"


def queue_of(cluster: Mapping[str, Any] | None) -> str | None:
    """The Kueue LocalQueue a RayCluster is put in, or ``None``."""
    return (((cluster or {}).get("metadata") or {}).get("labels") or {}).get(QUEUE_NAME_LABEL)


def held_in(cluster: Mapping[str, Any] | None, status: ClusterStatus) -> str | None:
    """The LocalQueue of a cluster Kueue holds (queued and suspended), or ``None`` when Kueue does not hold it."""
    return queue_of(cluster) if status.phase is Phase.SUSPENDED else None


def admitted_to(workload: Mapping[str, Any] | None) -> str | None:
    """The ClusterQueue that admitted the Workload, or ``None`` while it waits."""
    status = (workload or {}).get("status") or {}
    if not is_true(conditions(status).get("QuotaReserved")):
        return None
    return ((status.get("admission") or {}).get("clusterQueue")) or None


def _flavors(workload: Mapping[str, Any]) -> list[str]:
    assignments = (((workload.get("status") or {}).get("admission") or {}).get("podSetAssignments")) or []
    return sorted({flavor for pod_set in assignments for flavor in (pod_set.get("flavors") or {}).values()})


def describe_hold(queue: str, workload: Mapping[str, Any] | None, cluster_queue: str | None, *,
                  held: bool = True) -> tuple[str, str, str]:
    """What Kueue does with the cluster, as ``(message, reason, since)``: the reason is
    :data:`KUEUE_INADMISSIBLE` (and ``since`` when that began) only when Kueue cannot admit it at all.

    :param queue: the LocalQueue's name.
    :param workload: the cluster's Workload, ``None`` when Kueue has made none (yet) or it cannot be read.
    :param cluster_queue: the LocalQueue's ClusterQueue, when it could be read.
    :param held: whether the cluster is still suspended (an admitted one is then starting, else provisioning).
    """
    where = f"ClusterQueue {cluster_queue}" if cluster_queue else f"LocalQueue {queue}"
    if workload is None:
        return f"queued in Kueue: {where}, no Workload for it yet", "", ""
    if admitted := admitted_to(workload):
        flavors = _flavors(workload)
        return (f"admitted by Kueue to ClusterQueue {admitted}" + (f" (flavor {', '.join(flavors)})" if flavors else "")
                + ("; starting" if held else "; provisioning"), "", "")
    by_type = conditions(workload.get("status") or {})
    reserved = by_type.get("QuotaReserved") or {}
    reason = reserved.get("reason") or "Pending"
    text = f"{reason}: {reserved.get('message')}" if reserved.get("message") else reason
    evicted = by_type.get("Evicted")
    if is_true(evicted):
        text = f"evicted ({evicted.get('reason')}: {evicted.get('message', '')}), queued again; {text}"
    if reason == "Inadmissible":
        return f"queued in Kueue: {where}, {text}", KUEUE_INADMISSIBLE, reserved.get("lastTransitionTime") or ""
    return f"queued in Kueue: {where}, {text}", "", ""


def held_status(status: ClusterStatus, queue: str, workload: Mapping[str, Any] | None,
                cluster_queue: str | None) -> ClusterStatus:
    """``status`` of a cluster Kueue holds (:func:`held_in`), read again with its Workload."""
    message, reason, since = describe_hold(queue, workload, cluster_queue)
    return dataclasses.replace(status, phase=Phase.PROVISIONING, message=message, reason=reason,
                               failing_since=since)
