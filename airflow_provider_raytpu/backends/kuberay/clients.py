"""The authenticated Kubernetes clients of a ``raytpu`` connection, from the official Airflow hooks.

Backend ``kubernetes``: the cncf-kubernetes ``KubernetesHook`` / ``AsyncKubernetesHook`` of
the connection's ``kubernetes_conn_id`` (kubeconfig, in-cluster, exec plugins, ...).
Backend ``gke``: the Google provider's ``GKEKubernetesHook`` / ``GKEKubernetesAsyncHook``
on the control plane the GKE API names (tokens refresh on every request). No credential
handling is written here.

The sync client is one per backend (one per task in a worker). The async client is one per
connection per event loop, shared by every trigger of the triggerer
(:class:`~airflow_provider_raytpu.backends.kuberay.shared_client.SharedApiClient`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook, KubernetesHook
from kubernetes import client as k8s

from airflow_provider_raytpu.backends.kuberay.shared_client import SharedApiClient
from airflow_provider_raytpu.loop_shared import loop_shared

if TYPE_CHECKING:
    from kubernetes_asyncio import client as k8s_async

    from airflow_provider_raytpu.connection import ConnectionSettings


def _rest_gke_hook(settings: ConnectionSettings) -> Any:
    """The Google provider's GKEHook, talking REST to ``gke_api_endpoint`` when one is set."""
    from airflow.providers.google.cloud.hooks.kubernetes_engine import GKEHook
    from google.cloud.container_v1 import ClusterManagerClient

    class RestGKEHook(GKEHook):
        def get_cluster_manager_client(self) -> ClusterManagerClient:
            if self._client is None:
                if not settings.gke_api_endpoint:
                    return super().get_cluster_manager_client()
                self._client = ClusterManagerClient(
                    credentials=self.get_credentials(),
                    transport="rest",
                    client_options=self.get_client_options(api_endpoint_override=settings.gke_api_endpoint),
                )
            return self._client

    return RestGKEHook(
        gcp_conn_id=settings.gcp_conn_id,
        location=settings.location,
        impersonation_chain=settings.impersonation_chain,
    )


def gke_endpoint(settings: ConnectionSettings) -> tuple[str, str]:
    """The GKE control plane's URL and CA, read through the GKE API."""
    from airflow.providers.google.cloud.operators.kubernetes_engine import GKEClusterAuthDetails

    return GKEClusterAuthDetails(
        cluster_name=settings.cluster or "",
        project_id=settings.project_id or "",
        use_internal_ip=settings.use_internal_ip,
        use_dns_endpoint=settings.use_dns_endpoint,
        cluster_hook=_rest_gke_hook(settings),
    ).fetch_cluster_info()


def async_hook(settings: ConnectionSettings) -> AsyncKubernetesHook:
    """The connection's async hook (blocking: it may ask the GKE API for the control plane)."""
    if settings.backend == "gke":
        from airflow.providers.google.cloud.hooks.kubernetes_engine import GKEKubernetesAsyncHook

        url, ca = gke_endpoint(settings)
        return GKEKubernetesAsyncHook(
            cluster_url=url,
            ssl_ca_cert=ca,
            use_dns_endpoint=settings.use_dns_endpoint,
            gcp_conn_id=settings.gcp_conn_id,
            impersonation_chain=settings.impersonation_chain,
        )
    return AsyncKubernetesHook(conn_id=settings.kubernetes_conn_id or KubernetesHook.default_conn_name)


async def shared_api_client(settings: ConnectionSettings) -> SharedApiClient:
    """The running event loop's async client of this connection (made on first use, closed with the loop).

    When the connection's settings changed since it was made, its next client uses the new ones.
    """

    def make_hook() -> AsyncKubernetesHook:
        return async_hook(settings)

    async def make() -> SharedApiClient:
        return SharedApiClient(make_hook, source=settings)

    shared = await loop_shared().get(("kube-client", settings.conn_id), make, close=lambda c: c.aclose())
    if shared.source != settings:
        shared.replace_hook(make_hook, source=settings)
    return shared


class KubeClients:
    """The Kubernetes clients of one connection: one sync client, and the event loop's shared async one.

    :param settings: the parsed ``raytpu`` connection (backend ``kubernetes`` or ``gke``).
    """

    def __init__(self, settings: ConnectionSettings) -> None:
        self.settings = settings
        self._gke_endpoint: tuple[str, str] | None = None

    def gke_endpoint(self) -> tuple[str, str]:
        """The GKE control plane's URL and CA, read once through the GKE API."""
        if self._gke_endpoint is None:
            self._gke_endpoint = gke_endpoint(self.settings)
        return self._gke_endpoint

    @cached_property
    def hook(self) -> KubernetesHook:
        """The connection's Kubernetes hook (``GKEKubernetesHook`` is one too)."""
        if self.settings.backend == "gke":
            from airflow.providers.google.cloud.hooks.kubernetes_engine import GKEKubernetesHook

            url, ca = self.gke_endpoint()
            return GKEKubernetesHook(
                cluster_url=url,
                ssl_ca_cert=ca,
                use_dns_endpoint=self.settings.use_dns_endpoint,
                gcp_conn_id=self.settings.gcp_conn_id,
                impersonation_chain=self.settings.impersonation_chain,
            )
        return KubernetesHook(
            conn_id=self.settings.kubernetes_conn_id or KubernetesHook.default_conn_name,
            client_configuration=k8s.Configuration(),
        )

    @property
    def api_client(self) -> k8s.ApiClient:
        """The authenticated sync client (made once; GKE tokens refresh on every request)."""
        return self.hook.api_client

    def close(self) -> None:
        """Close the sync client, if one was made (its connection pool and thread pool)."""
        hook = self.__dict__.get("hook")
        if hook is not None and "api_client" in hook.__dict__:
            hook.api_client.close()

    @cached_property
    def custom_objects(self) -> k8s.CustomObjectsApi:
        return k8s.CustomObjectsApi(self.api_client)

    @cached_property
    def core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.api_client)

    async def shared(self) -> SharedApiClient:
        """The event loop's shared async client of this connection."""
        return await shared_api_client(self.settings)

    @contextlib.asynccontextmanager
    async def async_api_client(self) -> AsyncIterator[k8s_async.ApiClient]:
        """The event loop's shared async client, held for the caller's requests (not closed after them)."""
        async with (await self.shared()).lease() as api_client:
            yield api_client
