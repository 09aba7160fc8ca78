"""A KubeRay RayCluster's pods and events: its status with per-slice detail, and why it is not ready."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kubernetes.client.rest import ApiException

from airflow_provider_raytpu.backends.kuberay.kueue import kueue_record
from airflow_provider_raytpu.backends.kuberay.objects import api_retry
from airflow_provider_raytpu.backends.kuberay.pods import CLUSTER_LABEL
from airflow_provider_raytpu.status import ClusterStatus, diagnose_pods, read_ray_cluster
from airflow_provider_raytpu.status.kueue import held_in, queue_of

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.kuberay.clients import KubeClients

log = logging.getLogger(__name__)

#: ``(status, pods) -> status``: a status read again with what else is known (e.g. Ray's node list).
Judge = Callable[[ClusterStatus, list[dict[str, Any]]], ClusterStatus]


def _list_core(method: Callable[..., Any], namespace: str, **kwargs: Any) -> list[dict[str, Any]]:
    """Items of a core list call as plain dicts; none when the identity may not read them (detail only)."""
    try:
        answer = api_retry()(method)(namespace, _preload_content=False, **kwargs)
    except ApiException as exc:
        if exc.status == 403:
            log.warning("Cannot read %s in %s for detail: %s", method.__name__, namespace, exc.reason)
            return []
        raise
    items: list[dict[str, Any]] = json.loads(answer.data).get("items", [])
    return items


def cluster_pods(clients: KubeClients, name: str, namespace: str) -> list[dict[str, Any]]:
    """The pods KubeRay made for a RayCluster."""
    return _list_core(clients.core.list_namespaced_pod, namespace, label_selector=f"{CLUSTER_LABEL}={name}")


def diagnose_on_kubernetes(clients: KubeClients, cluster: dict[str, Any] | None,
                              judge: Judge = lambda status, pods: status) -> str:
    """Why a RayCluster is not ready: whether Kueue holds it (queued: for which ClusterQueue and why) or admitted
    it, which hosts are missing, what the pods' events say holds them (unschedulable: why), and (``judge``) what
    else its status lacks, e.g. the TPU hosts Ray does not list."""
    if cluster is None:
        return read_ray_cluster(None).message
    metadata = cluster["metadata"]
    pods = cluster_pods(clients, metadata["name"], metadata["namespace"])
    events = _list_core(clients.core.list_namespaced_event, metadata["namespace"],
                        field_selector="involvedObject.kind=Pod")
    status = read_ray_cluster(cluster, pods)
    if (queue := queue_of(cluster)) is None:
        return diagnose_pods(judge(status, pods), pods, events)
    record = kueue_record(clients, cluster, queue)
    if held_in(cluster, status) is not None:
        return diagnose_pods(record.held(status), pods, events)
    head, _, rest = diagnose_pods(judge(status, pods), pods, events).partition("\n")
    return "\n".join(filter(None, (head, f"- Kueue: {record.line(held=False)}", rest)))
