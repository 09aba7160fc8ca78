"""Whether GKE's TPU webhook gave a RayCluster's TPU pods their slice identity.

KubeRay sets none of the TPU variables. On GKE, a mutating admission webhook (installed by the Ray
Operator add-on; elsewhere ai-on-gke's ``kuberay-tpu-webhook``) adds ``TPU_WORKER_ID`` and
``TPU_NAME`` to every KubeRay pod that requests ``google.com/tpu``, and ``TPU_WORKER_HOSTNAMES`` to the
hosts of a multi-host slice, when the pod is created. A pod created without them never gets them:
its host cannot find the others of its slice, and Ray lists it with chips but no slice. So a ready
pod without them fails the wait at once, with the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from airflow_provider_raytpu.status.cluster import (
    NODE_TYPE_LABEL,
    REPLICA_INDEX_LABEL,
    TPU_WEBHOOK_MISSING,
    ClusterStatus,
    Phase,
)
from airflow_provider_raytpu.status.ray_nodes import container_chips, named_list, pod_chips

GROUP_LABEL = "ray.io/group"
WORKER_ID_VAR = "TPU_WORKER_ID"
HOSTNAMES_VAR = "TPU_WORKER_HOSTNAMES"

HOW_TO_FIX = (
    "Check that the webhook is installed: `kubectl get mutatingwebhookconfigurations` lists a TPU webhook "
    "(GKE's Ray Operator add-on installs it: `gcloud container clusters update CLUSTER --location LOCATION "
    "--update-addons=RayOperator=ENABLED`; on other clusters install ai-on-gke's kuberay-tpu-webhook) and that "
    "its namespaceSelector and objectSelector match this namespace and KubeRay's pods. Pods are mutated only "
    "when they are created: then delete the RayCluster and create it again (clear the create task)."
)


def _env_names(pod: Mapping[str, Any]) -> set[str]:
    names: set[str] = set()
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container_chips(container):
            names.update(var.get("name", "") for var in container.get("env") or [])
    return names


def hosts_per_slice(cluster: Mapping[str, Any]) -> dict[str, int]:
    """``numOfHosts`` of each worker group, by group name."""
    return {str(group.get("groupName", "")): int(group.get("numOfHosts", 1))
            for group in (cluster.get("spec") or {}).get("workerGroupSpecs") or []}


def unmutated_pods(cluster: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """TPU worker pods without the variables the webhook adds (``TPU_WORKER_ID``; and
    ``TPU_WORKER_HOSTNAMES`` in a multi-host slice), each as ``slice <i> (pod <name>)``.

    Pods whose containers are not known (no ``spec``) are not judged.

    :param cluster: the RayCluster (its worker groups' ``numOfHosts``).
    :param pods: its pods.
    """
    hosts = hosts_per_slice(cluster)
    found = []
    for pod in pods:
        metadata = pod.get("metadata") or {}
        labels = metadata.get("labels") or {}
        if labels.get(NODE_TYPE_LABEL) != "worker" or not pod_chips(pod):
            continue
        needed = {WORKER_ID_VAR} | ({HOSTNAMES_VAR} if hosts.get(labels.get(GROUP_LABEL, ""), 1) > 1 else set())
        if needed - _env_names(pod):
            found.append(f"slice {labels.get(REPLICA_INDEX_LABEL, '?')} (pod {metadata.get('name', '?')})")
    return sorted(found)


def check_tpu_webhook(status: ClusterStatus, cluster: Mapping[str, Any] | None,
                      pods: Iterable[Mapping[str, Any]]) -> ClusterStatus:
    """``status``, FAILED (reason :data:`TPU_WEBHOOK_MISSING`) when a TPU pod lacks what the webhook adds."""
    if cluster is None or status.phase in (Phase.FAILED, Phase.GONE):
        return status
    missing = unmutated_pods(cluster, pods)
    if not missing:
        return status
    variables = WORKER_ID_VAR + (f" or {HOSTNAMES_VAR}" if max(hosts_per_slice(cluster).values()) > 1 else "")
    return dataclasses.replace(
        status, phase=Phase.FAILED, reason=TPU_WEBHOOK_MISSING,
        message=f"the GKE TPU webhook did not mutate these pods: {named_list(missing)} have no {variables}, so Ray "
                f"cannot group their hosts into slices. {HOW_TO_FIX}",
    )
