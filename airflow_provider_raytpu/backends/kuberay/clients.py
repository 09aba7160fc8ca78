"""The authenticated Kubernetes clients of a ``raytpu`` connection, from the official Airflow hooks.

Backend ``kubernetes``: the cncf-kubernetes ``KubernetesHook`` / ``AsyncKubernetesHook`` of
the connection's ``kubernetes_conn_id`` (kubeconfig, in-cluster, exec plugins, ...).
Backend ``gke``: the Google provider's ``GKEKubernetesHook`` / ``GKEKubernetesAsyncHook``
on the control plane the GKE API names (tokens refresh on every request). No credential
handling is written here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

from kubernetes import client as k8s

from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook, KubernetesHook

if TYPE_CHECKING:
    from kubernetes_asyncio import client as k8s_async

    from airflow_provider_raytpu.backends.settings import ConnectionSettings


def _rest_gke_hook(settings: ConnectionSettings) -> Any:
    """The Google provider's GKEHook, talking REST to ``gke_api_endpoint`` when one is set."""
    from google.cloud.container_v1 import ClusterManagerClient

    from airflow.providers.google.cloud.hooks.kubernetes_engine import GKEHook

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


class KubeClients:
    """The Kubernetes clients of one connection: one sync client, and an async one per wait.

    :param settings: the parsed ``raytpu`` connection (backend ``kubernetes`` or ``gke``).
    """

    def __init__(self, settings: ConnectionSettings) -> None:
        self.settings = settings
        self._gke_endpoint: tuple[str, str] | None = None

    def gke_endpoint(self) -> tuple[str, str]:
        """The GKE control plane's URL and CA, read once through the GKE API."""
        if self._gke_endpoint is None:
            from airflow.providers.google.cloud.operators.kubernetes_engine import GKEClusterAuthDetails

            self._gke_endpoint = GKEClusterAuthDetails(
                cluster_name=self.settings.cluster or "",
                project_id=self.settings.project_id or "",
                use_internal_ip=self.settings.use_internal_ip,
                use_dns_endpoint=self.settings.use_dns_endpoint,
                cluster_hook=_rest_gke_hook(self.settings),
            ).fetch_cluster_info()
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

    @contextlib.asynccontextmanager
    async def async_api_client(self) -> AsyncIterator[k8s_async.ApiClient]:
        """An async client for one wait; opened anew each time so short-lived tokens refresh."""
        if self.settings.backend == "gke":
            from airflow.providers.google.cloud.hooks.kubernetes_engine import GKEKubernetesAsyncHook

            url, ca = await asyncio.to_thread(self.gke_endpoint)
            hook: AsyncKubernetesHook = GKEKubernetesAsyncHook(
                cluster_url=url,
                ssl_ca_cert=ca,
                use_dns_endpoint=self.settings.use_dns_endpoint,
                gcp_conn_id=self.settings.gcp_conn_id,
                impersonation_chain=self.settings.impersonation_chain,
            )
        else:
            hook = AsyncKubernetesHook(conn_id=self.settings.kubernetes_conn_id or KubernetesHook.default_conn_name)
        async with hook.get_conn() as api_client:
            yield api_client
