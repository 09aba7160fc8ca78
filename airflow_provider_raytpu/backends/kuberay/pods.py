"""The pods of RayClusters, read together: every trigger that needs its cluster's pods at the same moment
shares one list request (``ray.io/cluster in (a,b,...)``).

A RayCluster trigger reads its pods only to confirm a READY it read from the RayCluster object
(every host of every slice ready); when many clusters turn ready at once, their triggers' reads
are batched here instead of becoming one request each.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from kubernetes_asyncio.client.exceptions import ApiException

from airflow_provider_raytpu.backends.kuberay.watch import collection_path, list_pages
from airflow_provider_raytpu.loop_shared import loop_shared
from airflow_provider_raytpu.status.ray_nodes import container_chips
from airflow_provider_raytpu.tpu import TPU_RESOURCE

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.kuberay.shared_client import SharedApiClient

log = logging.getLogger(__name__)

CLUSTER_LABEL = "ray.io/cluster"
#: Cluster names in one label selector.
CLUSTERS_PER_LIST = 100
#: Readers handed their pods before other tasks get the loop.
WAKE_PER_TURN = 100


def slim_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """What a status reader uses of a pod: its metadata (no managedFields), phase, conditions and IP, and of
    each container its TPU chips and the names (not the values) of its environment variables."""
    metadata = {k: v for k, v in (pod.get("metadata") or {}).items() if k != "managedFields"}
    status = pod.get("status") or {}
    containers = [
        {"name": c.get("name"), "env": [{"name": var.get("name")} for var in c.get("env") or []],
         "resources": {"limits": {TPU_RESOURCE: chips}} if (chips := container_chips(c)) else {}}
        for c in (pod.get("spec") or {}).get("containers") or []
    ]
    return {"metadata": metadata, "spec": {"containers": containers},
            "status": {"phase": status.get("phase"), "conditions": status.get("conditions") or [],
                       "podIP": status.get("podIP")}}


def _digest(pods: list[dict[str, Any]]) -> list[tuple[str | None, dict[str, Any]]]:
    return [(((pod.get("metadata") or {}).get("labels") or {}).get(CLUSTER_LABEL), slim_pod(pod)) for pod in pods]


class PodReader:
    """Reads the pods of RayClusters in one namespace, batching the readers of the same moment.

    :param shared: the connection's shared async client.
    :param namespace: the namespace.
    """

    def __init__(self, shared: SharedApiClient, namespace: str) -> None:
        self.shared = shared
        self.namespace = namespace
        self.path = collection_path(namespace, "pods")
        self.lists = 0
        self._waiting: dict[str, list[asyncio.Future[list[dict[str, Any]]]]] = {}
        self._task: asyncio.Task[None] | None = None

    async def pods_of(self, cluster: str) -> list[dict[str, Any]]:
        """The pods of one RayCluster (none when the identity may not list pods: detail only)."""
        future: asyncio.Future[list[dict[str, Any]]] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(cluster, []).append(future)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name=f"raytpu-pods-{self.namespace}")
        return await future

    async def _drain(self) -> None:
        while self._waiting:
            await asyncio.sleep(0)  # readers woken in this turn of the loop join the batch
            batch, self._waiting = self._waiting, {}
            try:
                pods = await self._read(sorted(batch))
            except Exception as exc:  # handed to each reader
                for futures in batch.values():
                    for future in futures:
                        if not future.done():
                            future.set_exception(exc)
                continue
            told = 0
            for name, futures in batch.items():
                for future in futures:
                    if not future.done():
                        future.set_result(pods[name])
                        told += 1
                        if told % WAKE_PER_TURN == 0:  # a thousand readers do not all run in one turn
                            await asyncio.sleep(0)

    async def _read(self, names: list[str]) -> dict[str, list[dict[str, Any]]]:
        found: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        for start in range(0, len(names), CLUSTERS_PER_LIST):
            chunk = names[start:start + CLUSTERS_PER_LIST]
            selector = f"{CLUSTER_LABEL}={chunk[0]}" if len(chunk) == 1 else f"{CLUSTER_LABEL} in ({','.join(chunk)})"
            try:
                async for page, _ in list_pages(self.shared, self.path, [("labelSelector", selector)], digest=_digest):
                    for name, pod in page:
                        if name in found:
                            found[name].append(pod)
            except ApiException as exc:
                if exc.status != 403:
                    raise
                log.warning("Cannot list pods in %s for per-slice detail: %s", self.namespace, exc.reason)
                return found
            self.lists += 1
        return found


async def pod_reader(shared: SharedApiClient, conn_id: str, namespace: str) -> PodReader:
    """The running event loop's pod reader for ``namespace`` on this connection."""

    async def make() -> PodReader:
        return PodReader(shared, namespace)

    return await loop_shared().get(("pods", conn_id, namespace), make)
