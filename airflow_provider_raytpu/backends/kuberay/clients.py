"""The authenticated Kubernetes clients of a ``raytpu`` connection, from the official Airflow hooks.

Backend ``kubernetes``: the cncf-kubernetes ``KubernetesHook`` / ``AsyncKubernetesHook`` of
the connection's ``kubernetes_conn_id`` (kubeconfig, in-cluster, exec plugins, ...).
Backend ``gke``: the Google provider's ``GKEKubernetesHook`` / ``GKEKubernetesAsyncHook``
on the control plane the GKE API names (tokens refresh on every request). No credential
handling is written here.

The sync client is one per backend (one per task in a worker). The async client is one per
connection per event loop, shared by every trigger of the triggerer
(:class:`~airflow_provider_raytpu.backends.kuberay.shared_client.SharedApiClient`).

Every request names the provider in its ``User-Agent`` (:data:`USER_AGENT`), so that an API server's audit
log tells its requests from other clients'.

Every sync request has a timeout on both backends (the cncf hook's ``API_TIMEOUT``, as its own client
sets; the GKE hook's client sets none, so a half-open connection would hang a teardown for ever), and the
Retry-After that urllib3 obeys under the sync client is capped at :data:`RETRY_AFTER_CAP` seconds (urllib3's
own cap is 6 hours).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook, KubernetesHook
from airflow.providers.cncf.kubernetes.kubernetes_helper_functions import API_TIMEOUT
from kubernetes import client as k8s
from urllib3.util.retry import Retry

from airflow_provider_raytpu.backends.kuberay.shared_client import USER_AGENT, SharedApiClient
from airflow_provider_raytpu.loop_shared import loop_shared

if TYPE_CHECKING:
    from kubernetes_asyncio import client as k8s_async

    from airflow_provider_raytpu.connection import ConnectionSettings


#: The longest wait a Retry-After answer gets, in seconds: the API server's own 429s ask for 1 s; a proxy's
#: "come back in an hour" must not hold a teardown that long.
RETRY_AFTER_CAP = 30


def capped_retries() -> Retry:
    """urllib3's default retries under the sync client (3), with Retry-After capped at :data:`RETRY_AFTER_CAP`."""
    return Retry(total=3, retry_after_max=RETRY_AFTER_CAP)


class TimeoutApiClient(k8s.ApiClient):  # type: ignore[misc]  # kubernetes ships no types
    """A sync client whose every request has a timeout, as the cncf hook's own client has (its private
    ``_TimeoutK8sApiClient``): ``request_timeout`` seconds. (The sync client never watches: watches are the
    triggers', on the async client.)

    :param configuration: the authenticated configuration.
    :param request_timeout: seconds a request may take.
    """

    def __init__(self, configuration: k8s.Configuration, request_timeout: float = API_TIMEOUT) -> None:
        super().__init__(configuration)
        self.request_timeout = request_timeout
        self.user_agent = USER_AGENT

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        # The generated methods pass _request_timeout=None explicitly: None means "for ever".
        if kwargs.get("_request_timeout") is None:
            kwargs["_request_timeout"] = self.request_timeout
        return super().call_api(*args, **kwargs)


Hook = TypeVar("Hook", bound=KubernetesHook)


def timed(hook_class: type[Hook], request_timeout: float) -> type[Hook]:
    """``hook_class`` whose client is a :class:`TimeoutApiClient` with :func:`capped_retries`, on the
    configuration (credentials, CA, token refresh) the hook made."""

    class TimedHook(hook_class):  # type: ignore[valid-type,misc]  # a class made at run time
        def get_conn(self) -> k8s.ApiClient:
            configuration = super().get_conn().configuration
            configuration.retries = capped_retries()
            return TimeoutApiClient(configuration, request_timeout)

    return TimedHook


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


def async_hook(settings: ConnectionSettings,
               endpoint: Callable[[], tuple[str, str]] | None = None) -> AsyncKubernetesHook:
    """The connection's async hook (blocking: it may ask the GKE API for the control plane).

    :param endpoint: the GKE control plane's URL and CA, when already known (else read now).
    """
    if settings.backend == "gke":
        from airflow.providers.google.cloud.hooks.kubernetes_engine import GKEKubernetesAsyncHook

        url, ca = endpoint() if endpoint is not None else gke_endpoint(settings)
        return GKEKubernetesAsyncHook(
            cluster_url=url,
            ssl_ca_cert=ca,
            use_dns_endpoint=settings.use_dns_endpoint,
            gcp_conn_id=settings.gcp_conn_id,
            impersonation_chain=settings.impersonation_chain,
        )
    return AsyncKubernetesHook(conn_id=settings.kubernetes_conn_id or KubernetesHook.default_conn_name)


async def shared_api_client(settings: ConnectionSettings,
                            endpoint: Callable[[], tuple[str, str]] | None = None) -> SharedApiClient:
    """The running event loop's async client of this connection (made on first use, closed with the loop).

    When the connection's settings changed since it was made, its next client uses the new ones.

    :param endpoint: the GKE control plane's URL and CA as the caller knows it, for the first client (a later
        one, made an hour on or after a 401, reads them again from the GKE API).
    """
    known = [endpoint] if endpoint is not None else []

    def make_hook() -> AsyncKubernetesHook:
        return async_hook(settings, known.pop() if known else None)

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

    def __init__(self, settings: ConnectionSettings, request_timeout: float = API_TIMEOUT) -> None:
        self.settings = settings
        self.request_timeout = request_timeout
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
            return timed(GKEKubernetesHook, self.request_timeout)(
                cluster_url=url,
                ssl_ca_cert=ca,
                use_dns_endpoint=self.settings.use_dns_endpoint,
                gcp_conn_id=self.settings.gcp_conn_id,
                impersonation_chain=self.settings.impersonation_chain,
            )
        return timed(KubernetesHook, self.request_timeout)(
            conn_id=self.settings.kubernetes_conn_id or KubernetesHook.default_conn_name,
            client_configuration=k8s.Configuration())

    @property
    def api_client(self) -> k8s.ApiClient:
        """The authenticated sync client (made once; GKE tokens refresh on every request), a
        :class:`TimeoutApiClient`."""
        return self.hook.api_client

    def close(self) -> None:
        """Close the sync client, if one was made: its thread pool and its open connections (a request
        made afterwards opens a new one)."""
        hook = self.__dict__.get("hook")
        if hook is not None and "api_client" in hook.__dict__:
            hook.api_client.close()
            hook.api_client.rest_client.pool_manager.clear()

    @cached_property
    def custom_objects(self) -> k8s.CustomObjectsApi:
        return k8s.CustomObjectsApi(self.api_client)

    @cached_property
    def core(self) -> k8s.CoreV1Api:
        return k8s.CoreV1Api(self.api_client)

    async def shared(self) -> SharedApiClient:
        """The event loop's shared async client of this connection."""
        return await shared_api_client(self.settings, self.gke_endpoint)

    @contextlib.asynccontextmanager
    async def async_api_client(self) -> AsyncIterator[k8s_async.ApiClient]:
        """The event loop's shared async client, held for the caller's requests (not closed after them)."""
        async with (await self.shared()).lease() as api_client:
            yield api_client
