"""A local cluster's files as KubeRay would report them: a RayCluster ``status`` and pod-like objects.

:func:`airflow_provider_raytpu.status.read_ray_cluster` reads what :func:`synthesise_status`
makes, so READY / PROVISIONING / FAILED / GONE mean the same here as on Kubernetes.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from airflow_provider_raytpu.backends.local.state import SUPERVISOR_LOG, StoredCluster
from airflow_provider_raytpu.status import NODE_TYPE_LABEL, REPLICA_INDEX_LABEL, desired_hosts
from airflow_provider_raytpu.status.ray_nodes import pod_chips
from airflow_provider_raytpu.tpu import TPU_RESOURCE

CLUSTER_LABEL = "ray.io/cluster"
GROUP_LABEL = "ray.io/group"
REPLICA_NAME_LABEL = "ray.io/worker-group-replica-name"
HOST_INDEX_LABEL = "ray.io/replica-host-index"
_WAITING_REASONS = {
    "waiting": "WaitingForHead",
    "starting": "Starting",
    "restarting": "SliceRestarting",
    "failed": "SliceFailed",
}

#: The node every local host pod is on.
LOCAL_NODE = "localhost"


def _condition(kind: str, true: bool, reason: str = "", message: str = "") -> dict[str, str]:
    condition = {"type": kind, "status": "True" if true else "False"}
    if reason:
        condition["reason"] = reason
    if message:
        condition["message"] = message
    return condition


def _pod(name: str, namespace: str, labels: dict[str, str], host: Mapping[str, Any], alive: bool,
         waiting_reason: str, container: str, chips: int = 0) -> dict[str, Any]:
    ready = alive and bool(host.get("ready"))
    running = alive and bool(host.get("running"))
    status: dict[str, Any] = {
        "phase": "Running" if running else "Pending",
        "conditions": [_condition("Ready", ready)],
    }
    if not ready:
        status["containerStatuses"] = [
            {"name": container, "ready": False,
             "state": {"waiting": {"reason": waiting_reason, "message": host.get("message") or ""}}}
        ]
    annotations = {k: str(host[k]) for k in ("pid", "node_id", "log") if host.get(k) is not None}
    resources = {"limits": {TPU_RESOURCE: str(chips)}} if chips else {}
    metadata = {"name": name, "namespace": namespace, "labels": labels,
                "annotations": {f"raytpu.dev/{k}": v for k, v in annotations.items()}}
    if host.get("started_at"):  # a host started again is a pod made again, as KubeRay makes a preempted one
        metadata["creationTimestamp"] = host["started_at"]
    return {
        "metadata": metadata,
        # Every host of a local cluster is placed on this machine, as a scheduled pod is on its node.
        "spec": {"nodeName": LOCAL_NODE, "containers": [{"name": container, "resources": resources}]},
        "status": status,
    }


def synthesise_status(stored: StoredCluster) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The RayCluster with a KubeRay-like ``status``, and pod-like objects for its hosts.

    ``status`` has ``HeadPodReady`` and ``RayClusterProvisioned`` conditions, ``state: failed``
    with a ``reason`` when something failed for good or the supervisor is not running, ``desiredWorkerReplicas``
    and ``readyWorkerReplicas``; each host is a pod with the replica-index labels of KubeRay's
    multi-host indexing and a Ready condition that is true only once its raylet is ALIVE in the GCS.
    """
    cluster = copy.deepcopy(stored.manifest)
    metadata = cluster.setdefault("metadata", {})
    name, namespace = metadata.get("name", ""), metadata.get("namespace", "")
    state = stored.state or {}
    sup = stored.supervisor
    alive = stored.supervisor_alive
    starting = sup is None  # the backend is still starting the supervisor
    head = state.get("head") or {}
    slices = state.get("slices") or []
    head_ready = alive and bool(head.get("ready"))
    ready_hosts = sum(1 for s in slices for h in s.get("hosts", []) if h.get("ready")) if alive else 0
    want = desired_hosts(cluster)
    conditions = [
        _condition("HeadPodReady", head_ready, "HeadPodRunningAndReady" if head_ready else "HeadPodNotReady"),
        _condition("RayClusterProvisioned", head_ready and ready_hosts >= want,
                   "AllPodRunningAndReadyFirstTime" if head_ready and ready_hosts >= want
                   else "RayClusterPodsProvisioning"),
    ]
    failure = state.get("failure")
    if not failure and not alive and not starting and not stored.deleting:
        failure = {"reason": "SupervisorNotRunning", "message": (
            f"the local supervisor (pid {sup.get('pid') if sup else None}) of RayCluster {name!r} is not running, "
            f"so none of its Ray processes are; see {stored.path / SUPERVISOR_LOG}. Apply the cluster again to "
            "restart it, or delete it")}
    status: dict[str, Any] = {
        "desiredWorkerReplicas": want,
        "readyWorkerReplicas": ready_hosts,
        "availableWorkerReplicas": ready_hosts,
        "conditions": conditions,
        "observedGeneration": metadata.get("generation", 1),
    }
    if failure:
        # Fatal, unlike KubeRay's ReplicaFailure (a reconcile error that may clear): KubeRay's own
        # "failed" state, which v1.5 and newer never set.
        status["state"], status["reason"] = "failed", f"{failure.get('reason', 'Failed')}: {failure.get('message', '')}"
    elif state.get("suspended"):
        status["state"] = "suspended"
    elif head_ready and ready_hosts >= want:
        status["state"] = "ready"
    if state.get("ready_at"):
        status["stateTransitionTimes"] = {"ready": state["ready_at"]}
    if state.get("dashboard_url"):
        status["endpoints"] = {"dashboard": state["dashboard_url"].rsplit(":", 1)[1],
                               "gcs-server": state.get("gcs_address", ":").rsplit(":", 1)[1]}
    cluster["status"] = status

    def not_alive_reason(default: str) -> str:
        return default if alive or starting else "SupervisorNotRunning"

    base_labels = {CLUSTER_LABEL: name}
    pods = []
    if state:
        pods.append(_pod(
            f"{name}-head", namespace, {**base_labels, NODE_TYPE_LABEL: "head", GROUP_LABEL: "headgroup"}, head,
            alive, not_alive_reason("Starting"), "ray-head",
        ))
    worker_group = ((cluster.get("spec") or {}).get("workerGroupSpecs") or [{}])[0]
    group = worker_group.get("groupName", "workers")
    chips = pod_chips(worker_group.get("template") or {})
    for slice_ in slices:
        reason = not_alive_reason(_WAITING_REASONS.get(slice_.get("status", ""), "Starting"))
        for host in slice_.get("hosts", []):
            labels = {
                **base_labels,
                NODE_TYPE_LABEL: "worker",
                GROUP_LABEL: group,
                REPLICA_INDEX_LABEL: str(slice_["index"]),
                REPLICA_NAME_LABEL: slice_.get("name", ""),
                HOST_INDEX_LABEL: str(host.get("worker_id")),
            }
            message_host = dict(host)
            if not host.get("ready") and slice_.get("message") and slice_.get("status") != "ready":
                message_host["message"] = f"{host.get('message') or ''} ({slice_['message']})".strip()
            pods.append(_pod(
                f"{name}-{group}-s{slice_['index']}-h{host.get('worker_id')}", namespace, labels, message_host,
                alive, reason, "ray-worker", chips,
            ))
    return cluster, pods
