"""A queued RayCluster's Kueue Workload and its LocalQueue's ClusterQueue, read with the sync or the async client.

Only for what a person reads: an identity that may not read Kueue's objects, or a cluster without
Kueue's CRDs, gets ``None`` (with one warning), never an error that ends a wait.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kubernetes.client.rest import ApiException
from kubernetes_asyncio.client.exceptions import ApiException as AsyncApiException

from airflow_provider_raytpu.backends.kuberay.objects import api_retry
from airflow_provider_raytpu.backends.kuberay.watch import collection_path, get_json
from airflow_provider_raytpu.status.kueue import (
    GROUP,
    JOB_UID_LABEL,
    LOCAL_QUEUES,
    VERSION,
    WORKLOADS,
    describe_hold,
    held_status,
)

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.kuberay.clients import KubeClients
    from airflow_provider_raytpu.backends.kuberay.shared_client import SharedApiClient
    from airflow_provider_raytpu.status import ClusterStatus

log = logging.getLogger(__name__)
_warned: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class KueueRecord:
    """What Kueue records for one queued RayCluster.

    :param queue: the LocalQueue named by the cluster's label.
    :param workload: the cluster's Workload, ``None`` when there is none (yet) or it cannot be read.
    :param cluster_queue: the LocalQueue's ClusterQueue, ``None`` when it cannot be read.
    """

    queue: str
    workload: Mapping[str, Any] | None
    cluster_queue: str | None

    def held(self, status: ClusterStatus) -> ClusterStatus:
        """The status of a cluster Kueue holds, read again with this record."""
        return held_status(status, self.queue, self.workload, self.cluster_queue)

    def line(self, held: bool) -> str:
        """One line for a diagnosis: queued where, or admitted where."""
        return describe_hold(self.queue, self.workload, self.cluster_queue, held=held)[0]


def _unreadable(exc: ApiException | AsyncApiException, what: str, namespace: str) -> None:
    if exc.status not in (403, 404):
        raise exc
    if (what, namespace) not in _warned:  # once per process: a thousand waits read it every few seconds
        _warned.add((what, namespace))
        log.warning("Cannot read Kueue's %s in %s for detail: %s", what, namespace, exc.reason)


def _workload_selector(cluster: Mapping[str, Any]) -> str:
    return f"{JOB_UID_LABEL}={cluster['metadata'].get('uid', '')}"


def kueue_record(clients: KubeClients, cluster: Mapping[str, Any], queue: str) -> KueueRecord:
    """The Kueue record of a cluster queued in LocalQueue ``queue``, with the sync client."""
    namespace = cluster["metadata"]["namespace"]
    api = clients.custom_objects
    workload = cluster_queue = None
    try:
        items = api_retry()(api.list_namespaced_custom_object)(
            GROUP, VERSION, namespace, WORKLOADS, label_selector=_workload_selector(cluster)).get("items") or []
        workload = items[0] if items else None
    except ApiException as exc:
        _unreadable(exc, WORKLOADS, namespace)
    try:
        local_queue = api_retry()(api.get_namespaced_custom_object)(GROUP, VERSION, namespace, LOCAL_QUEUES, queue)
        cluster_queue = (local_queue.get("spec") or {}).get("clusterQueue")
    except ApiException as exc:
        _unreadable(exc, f"LocalQueue {queue}", namespace)
    return KueueRecord(queue, workload, cluster_queue)


async def akueue_record(shared: SharedApiClient, cluster: Mapping[str, Any], queue: str) -> KueueRecord:
    """:func:`kueue_record` with the event loop's shared async client."""
    namespace = cluster["metadata"]["namespace"]
    workloads = collection_path(namespace, WORKLOADS, GROUP, VERSION)
    workload = cluster_queue = None
    try:
        answer = await api_retry()(shared.call)(
            lambda client: get_json(client, workloads, [("labelSelector", _workload_selector(cluster))]))
        workload = (answer.get("items") or [None])[0]
    except AsyncApiException as exc:
        _unreadable(exc, WORKLOADS, namespace)
    try:
        path = f"{collection_path(namespace, LOCAL_QUEUES, GROUP, VERSION)}/{queue}"
        local_queue = await api_retry()(shared.call)(lambda client: get_json(client, path))
        cluster_queue = (local_queue.get("spec") or {}).get("clusterQueue")
    except AsyncApiException as exc:
        _unreadable(exc, f"LocalQueue {queue}", namespace)
    return KueueRecord(queue, workload, cluster_queue)
