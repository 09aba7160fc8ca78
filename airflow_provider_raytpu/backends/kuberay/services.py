"""RayServices as KubeRay custom resources: apply, read with their clusters and Serve's own record, watch, diagnose."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from kubernetes_asyncio import client as k8s_async

from airflow_provider_raytpu.backends.apply import SERVICE_OWNER, OnChange, apply_object, same_service
from airflow_provider_raytpu.backends.base import ApplyResult, Precondition, ServiceBackend
from airflow_provider_raytpu.backends.kuberay.informer import informer
from airflow_provider_raytpu.backends.kuberay.objects import RAY_SERVICES, CustomObjects
from airflow_provider_raytpu.backends.kuberay.transport import reach
from airflow_provider_raytpu.dashboard.serve import aserve_details, serve_details
from airflow_provider_raytpu.manifests.raycluster import SERVE_PORT
from airflow_provider_raytpu.manifests.rayservice import (
    IN_PLACE,
    SERVE_PORT_NAME,
    serve_service_name,
    service_config_problems,
    update_kind,
)
from airflow_provider_raytpu.status import ServiceStatus, diagnose_ray_service, read_ray_service

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.base import ClusterBackend
    from airflow_provider_raytpu.backends.kuberay.clients import KubeClients
    from airflow_provider_raytpu.dashboard.transport import HttpTransport

log = logging.getLogger(__name__)

Manifest = dict[str, Any]
#: ``with_token_auth(apply, manifest, spec_of)``: apply the manifest, with Ray token authentication in the
#: RayCluster spec ``spec_of`` finds where the cluster has it (the RayCluster backend's rule).
TokenAuthApply = Callable[[Callable[[Manifest], ApplyResult], Manifest, Callable[[Manifest], Manifest]], ApplyResult]

def cluster_names(service: dict[str, Any] | None) -> tuple[str, str]:
    """The active and pending RayClusters a RayService's status names ('' for none)."""
    status = (service or {}).get("status") or {}
    return (
        (status.get("activeServiceStatus") or {}).get("rayClusterName") or "",
        (status.get("pendingServiceStatus") or {}).get("rayClusterName") or "",
    )


def needs_serve_record(service: dict[str, Any]) -> bool:
    """After an in-place update only Serve itself can say whether the active cluster runs the new config."""
    active, pending = cluster_names(service)
    return update_kind(service) == IN_PLACE and bool(active) and not pending


class KubeRayServices(ServiceBackend):
    """RayServices as KubeRay custom resources, next to the RayClusters of a
    :class:`~airflow_provider_raytpu.backends.kuberay.KubeRayBackend`.

    :param clusters: the backend of the RayClusters the services run on.
    :param clients: its Kubernetes clients.
    :param cluster_objects: its RayCluster objects.
    :param with_token_auth: how it applies a manifest with Ray token authentication where the cluster has it.
    """

    def __init__(self, clusters: ClusterBackend, clients: KubeClients, cluster_objects: CustomObjects,
                 with_token_auth: TokenAuthApply) -> None:
        self.clusters = clusters
        self.clients = clients
        self.cluster_objects = cluster_objects
        self.with_token_auth = with_token_auth
        self.objects = CustomObjects(clients, RAY_SERVICES)

    # -- apply / get / delete ------------------------------------------------------------------

    def apply_service(self, manifest: dict[str, Any]) -> ApplyResult:
        def apply(manifest: dict[str, Any]) -> ApplyResult:
            return apply_object(self.objects, manifest, same=same_service, owner=SERVICE_OWNER,
                                on_change=OnChange.REPLACE)

        return self.with_token_auth(apply, manifest, lambda service: service["spec"]["rayClusterConfig"])

    def get_service(self, name: str, namespace: str) -> dict[str, Any] | None:
        return self.objects.get(name, namespace)

    def delete_service(self, name: str, namespace: str, precondition: Precondition | None = None) -> bool:
        return self.objects.delete(name, namespace, precondition)

    def list_services(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return self.objects.list(namespace, label_selector)

    # -- status --------------------------------------------------------------------------------

    def serve_applications(self, cluster_name: str, namespace: str) -> dict[str, Any] | None:
        """Serve's ``applications`` on a cluster (``GET /api/serve/applications/``); ``None`` if unreachable."""
        details = serve_details(self.clusters.dashboard(cluster_name, namespace),
                                f"RayCluster {namespace}/{cluster_name}")
        return None if details is None else details.get("applications") or {}

    def _read(self, service: dict[str, Any] | None, version: str | None) -> ServiceStatus:
        if service is None:
            return read_ray_service(None, version=version)
        namespace = service["metadata"]["namespace"]
        active, pending = cluster_names(service)
        return read_ray_service(
            service,
            active_cluster=self.clusters.get_cluster(active, namespace) if active else None,
            pending_cluster=self.clusters.get_cluster(pending, namespace) if pending else None,
            serve_applications=self.serve_applications(active, namespace) if needs_serve_record(service) else None,
            version=version,
        )

    def service_status(self, name: str, namespace: str, version: str | None = None) -> ServiceStatus:
        return self._read(self.get_service(name, namespace), version)

    async def _aread(self, api_client: k8s_async.ApiClient, service: dict[str, Any] | None,
                     version: str | None) -> ServiceStatus:
        if service is None:
            return read_ray_service(None, version=version)
        namespace = service["metadata"]["namespace"]
        active, pending = cluster_names(service)
        clusters = self.cluster_objects
        applications = None
        if needs_serve_record(service):
            details = await aserve_details(self.clusters.dashboard(active, namespace),
                                           f"RayCluster {namespace}/{active}")
            applications = None if details is None else details.get("applications") or {}
        return read_ray_service(
            service,
            active_cluster=await clusters.aget(api_client, active, namespace) if active else None,
            pending_cluster=await clusters.aget(api_client, pending, namespace) if pending else None,
            serve_applications=applications,
            version=version,
        )

    async def aservice_status(self, name: str, namespace: str, version: str | None = None) -> ServiceStatus:
        async with self.clients.async_api_client() as api_client:
            service = await self.objects.aget(api_client, name, namespace)
            return await self._aread(api_client, service, version)

    async def watch_service(
        self, name: str, namespace: str, version: str | None = None, poll_interval: float = 10.0
    ) -> AsyncGenerator[ServiceStatus, None]:
        """The RayService's status now and after every change, from the event loop's informer of
        RayServices in ``namespace`` (:mod:`~airflow_provider_raytpu.backends.kuberay.informer`).

        Each status also reads the active and pending RayClusters the service names (their
        pod templates carry the version each was made for).
        """
        shared = await self.clients.shared()
        services = await informer(shared, self.objects, namespace)
        async with services.subscribe(name, poll_interval) as subscription:
            async for service in subscription:
                async with shared.lease() as api_client:
                    status = await self._aread(api_client, service, version)
                yield status

    def diagnose_service(self, name: str, namespace: str, version: str | None = None,
                         waited: float | None = None) -> str:
        service = self.get_service(name, namespace)
        status = self._read(service, version)
        if service is None:
            return status.message
        target = status.target_cluster
        return diagnose_ray_service(
            status,
            waited=waited,
            serve_applications=self.serve_applications(target, namespace) if target else None,
            cluster_diagnosis=self.clusters.diagnose_cluster(target, namespace) if target else "",
            config_problems=service_config_problems(service),
        )

    async def adiagnose_service(self, name: str, namespace: str, version: str | None = None,
                                waited: float | None = None) -> str:
        return await asyncio.to_thread(self.diagnose_service, name, namespace, version, waited)

    def serve_endpoint(self, name: str, namespace: str) -> HttpTransport:
        """The Serve service's ``serve`` port (``<name>-serve-svc``)."""
        service = serve_service_name(name)
        return reach(self.clusters.settings, self.clients, namespace, service, SERVE_PORT_NAME,
                     f"http://{service}.{namespace}.svc.cluster.local:{SERVE_PORT}")

    def dashboard(self, name: str, namespace: str) -> HttpTransport:
        """KubeRay's ``<name>-head-svc``: it follows the active cluster's head through every switch."""
        return self.clusters.dashboard(name, namespace)
