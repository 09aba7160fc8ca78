"""RayClusters on Kubernetes (any kubeconfig) or GKE, through the KubeRay operator.

All Kubernetes access goes through the cncf-kubernetes hooks (backend ``kubernetes``)
or the Google provider's GKE hooks (backend ``gke``), so every auth method they
support works here and no credential handling is written twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import tenacity
import urllib3
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException
from kubernetes_asyncio import client as k8s_async
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException as AsyncApiException

from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook, KubernetesHook
from airflow.providers.cncf.kubernetes.kubernetes_helper_functions import WaitRetryAfterOrExponential
from airflow_provider_raytpu.backends.base import (
    Applied,
    ApplyResult,
    ClusterBackend,
    ServiceBackend,
    conflict_error,
    foreign_service_error,
    is_managed,
    same_service,
    same_spec,
    service_config_problems,
)
from airflow_provider_raytpu.errors import FatalError, PermissionDeniedError
from airflow_provider_raytpu.manifests.raycluster import DASHBOARD_PORT, MANAGED_BY, MANAGED_BY_LABEL, SERVE_PORT
from airflow_provider_raytpu.manifests.rayservice import IN_PLACE, SERVE_PORT_NAME, serve_service_name, update_kind
from airflow_provider_raytpu.status import (
    ClusterStatus,
    ServiceStatus,
    diagnose_pods,
    diagnose_ray_service,
    read_ray_cluster,
    read_ray_service,
)

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.settings import ConnectionSettings

log = logging.getLogger(__name__)

GROUP = "ray.io"
VERSION = "v1"
RAY_CLUSTERS = "rayclusters"
RAY_SERVICES = "rayservices"
KINDS = {RAY_CLUSTERS: "RayCluster", RAY_SERVICES: "RayService"}
CLUSTER_LABEL = "ray.io/cluster"
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
WATCH_SECONDS = 240
WATCH_FAILURES_BEFORE_POLLING = 3
POLL_BEFORE_WATCHING_AGAIN_SECONDS = 120.0
APPLY_CONFLICT_ATTEMPTS = 5
SERVE_APPLICATIONS_ENDPOINT = "/api/serve/applications/"

T = TypeVar("T")


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (ApiException, AsyncApiException)):
        return exc.status in TRANSIENT_STATUS
    return isinstance(
        exc, (urllib3.exceptions.HTTPError, aiohttp.ClientConnectionError, ConnectionError, asyncio.TimeoutError)
    )


def api_retry(attempts: int = 6) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Retry transient API errors (429 honouring Retry-After, 5xx, dropped connections); never other 4xx."""
    return tenacity.retry(
        stop=tenacity.stop_after_attempt(attempts),
        wait=WaitRetryAfterOrExponential(),
        retry=tenacity.retry_if_exception(_is_transient),
        reraise=True,
        before_sleep=tenacity.before_sleep_log(log, logging.WARNING),
    )


def _body(exc: ApiException | AsyncApiException) -> dict[str, Any]:
    try:
        return json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        return {}


def explain_api_error(exc: ApiException | AsyncApiException, verb: str, resource: str, namespace: str | None) -> Exception:
    """Turn a fatal API answer into an error a user can act on (403 -> the missing RBAC rule)."""
    message = _body(exc).get("message") or exc.reason
    where = f"in namespace {namespace!r}" if namespace else "cluster-wide"
    if exc.status == 403:
        return PermissionDeniedError(
            f"The connection's Kubernetes identity may not {verb} {resource} {where}: {message}. "
            f"Grant it the provider's Role (docs/gke.md, 'RBAC'), which includes '{verb}' on {resource}."
        )
    if exc.status == 401:
        return PermissionDeniedError(f"The Kubernetes API server rejected the connection's credentials: {message}")
    if exc.status in (400, 422):
        return FatalError(f"The Kubernetes API server refused to {verb} {resource} {where}: {message}")
    return exc


class _RestGKEHook:
    """The Google provider's GKEHook, talking REST to a configurable endpoint when one is set."""

    @staticmethod
    def create(settings: ConnectionSettings) -> Any:
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


class KubeRayBackend(ClusterBackend):
    """RayClusters and RayServices as KubeRay custom resources.

    :param settings: the parsed ``raytpu`` connection (backend ``kubernetes`` or ``gke``).
    """

    def __init__(self, settings: ConnectionSettings) -> None:
        super().__init__(settings)
        self._gke_endpoint: tuple[str, str] | None = None
        self.services = KubeRayServices(self)

    # -- clients ---------------------------------------------------------------------------

    def _gke_cluster_endpoint(self) -> tuple[str, str]:
        """The GKE control plane's URL and CA, read once through the GKE API."""
        if self._gke_endpoint is None:
            from airflow.providers.google.cloud.operators.kubernetes_engine import GKEClusterAuthDetails

            self._gke_endpoint = GKEClusterAuthDetails(
                cluster_name=self.settings.cluster or "",
                project_id=self.settings.project_id or "",
                use_internal_ip=self.settings.use_internal_ip,
                use_dns_endpoint=self.settings.use_dns_endpoint,
                cluster_hook=_RestGKEHook.create(self.settings),
            ).fetch_cluster_info()
        return self._gke_endpoint

    @cached_property
    def api_client(self) -> k8s.ApiClient:
        """The authenticated Kubernetes client (GKE tokens refresh on every request)."""
        if self.settings.backend == "gke":
            from airflow.providers.google.cloud.hooks.kubernetes_engine import GKEKubernetesHook

            url, ca = self._gke_cluster_endpoint()
            return GKEKubernetesHook(
                cluster_url=url,
                ssl_ca_cert=ca,
                use_dns_endpoint=self.settings.use_dns_endpoint,
                gcp_conn_id=self.settings.gcp_conn_id,
                impersonation_chain=self.settings.impersonation_chain,
            ).get_conn()
        hook = KubernetesHook(
            conn_id=self.settings.kubernetes_conn_id or KubernetesHook.default_conn_name,
            client_configuration=k8s.Configuration(),
        )
        return hook.get_conn()

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

            url, ca = await asyncio.to_thread(self._gke_cluster_endpoint)
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

    def check(self) -> str:
        try:
            ours = self.list_clusters(self.namespace, f"{MANAGED_BY_LABEL}={MANAGED_BY}")
        except ApiException as exc:
            if exc.status == 404:
                raise FatalError(
                    "The Kubernetes API server has no rayclusters.ray.io: install the KubeRay operator "
                    "(on GKE, enable the Ray operator add-on)"
                ) from exc
            raise
        return (
            f"Reached {self.api_client.configuration.host}: RayClusters can be listed in namespace "
            f"{self.namespace!r} ({len(ours)} made by this provider)"
        )

    # -- RayCluster CRUD -------------------------------------------------------------------

    def _call(self, verb: str, namespace: str | None, fn: Callable[..., T], *args: Any,
              plural: str = RAY_CLUSTERS, **kwargs: Any) -> T:
        try:
            return api_retry()(fn)(*args, **kwargs)
        except ApiException as exc:
            explained = explain_api_error(exc, verb, f"{plural}.{GROUP}", namespace)
            if explained is exc:
                raise
            # The explanation carries the API server's message; chaining the client's
            # exception would put its traceback and HTTP headers first in the task log.
            raise explained from None

    def apply_cluster(self, manifest: dict[str, Any], *, update_if_exists: bool = False) -> ApplyResult:
        name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
        existing = self.get_cluster(name, namespace)
        if existing is None:
            try:
                created = self._call(
                    "create", namespace, self.custom_objects.create_namespaced_custom_object,
                    GROUP, VERSION, namespace, RAY_CLUSTERS, manifest, field_validation="Strict",
                )
                return ApplyResult(Applied.CREATED, created)
            except ApiException as exc:
                if exc.status != 409:
                    raise
            # Created meanwhile, e.g. by our own first attempt whose answer was lost.
            existing = self.get_cluster(name, namespace)
            if existing is None:
                raise FatalError(f"RayCluster {name!r} in {namespace!r} was created and deleted by someone else")
        if same_spec(existing, manifest):
            return ApplyResult(Applied.ADOPTED, existing)
        if not update_if_exists:
            raise conflict_error(existing, manifest)
        replacement = {
            **manifest,
            "metadata": {
                **existing["metadata"],
                "labels": {**(existing["metadata"].get("labels") or {}), **manifest["metadata"]["labels"]},
                "annotations": {
                    **(existing["metadata"].get("annotations") or {}),
                    **manifest["metadata"]["annotations"],
                },
            },
        }
        updated = self._call(
            "update", namespace, self.custom_objects.replace_namespaced_custom_object,
            GROUP, VERSION, namespace, RAY_CLUSTERS, name, replacement, field_validation="Strict",
        )
        return ApplyResult(Applied.UPDATED, updated)

    def get_cluster(self, name: str, namespace: str) -> dict[str, Any] | None:
        return self._get_object(RAY_CLUSTERS, name, namespace)

    def delete_cluster(self, name: str, namespace: str) -> bool:
        return self._delete_object(RAY_CLUSTERS, name, namespace)

    def list_clusters(self, namespace: str | None, label_selector: str) -> list[dict[str, Any]]:
        if namespace is None:
            answer = self._call(
                "list", None, self.custom_objects.list_cluster_custom_object, GROUP, VERSION, RAY_CLUSTERS,
                label_selector=label_selector,
            )
        else:
            answer = self._call(
                "list", namespace, self.custom_objects.list_namespaced_custom_object, GROUP, VERSION, namespace,
                RAY_CLUSTERS, label_selector=label_selector,
            )
        return answer.get("items", [])

    def _get_object(self, plural: str, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            return self._call(
                "get", namespace, self.custom_objects.get_namespaced_custom_object, GROUP, VERSION, namespace,
                plural, name, plural=plural,
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _delete_object(self, plural: str, name: str, namespace: str) -> bool:
        """Delete a ray.io object; ``False`` when it was already gone."""
        try:
            self._call(
                "delete", namespace, self.custom_objects.delete_namespaced_custom_object, GROUP, VERSION, namespace,
                plural, name, propagation_policy="Background", plural=plural,
            )
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

    async def _aget(self, api_client: k8s_async.ApiClient, plural: str, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            return await api_retry()(k8s_async.CustomObjectsApi(api_client).get_namespaced_custom_object)(
                GROUP, VERSION, namespace, plural, name
            )
        except AsyncApiException as exc:
            if exc.status == 404:
                return None
            raise

    # -- status ----------------------------------------------------------------------------

    def _list_core(self, method: Callable[..., Any], namespace: str, **kwargs: Any) -> list[dict[str, Any]]:
        try:
            answer = api_retry()(method)(namespace, _preload_content=False, **kwargs)
        except ApiException as exc:
            if exc.status == 403:
                log.warning("Cannot read %s in %s for detail: %s", method.__name__, namespace, exc.reason)
                return []
            raise
        return json.loads(answer.data).get("items", [])

    def cluster_pods(self, name: str, namespace: str) -> list[dict[str, Any]]:
        return self._list_core(self.core.list_namespaced_pod, namespace, label_selector=f"{CLUSTER_LABEL}={name}")

    def cluster_status(self, name: str, namespace: str) -> ClusterStatus:
        cluster = self.get_cluster(name, namespace)
        return read_ray_cluster(cluster, self.cluster_pods(name, namespace) if cluster else None)

    def diagnose(self, name: str, namespace: str) -> str:
        cluster = self.get_cluster(name, namespace)
        if cluster is None:
            return read_ray_cluster(None).message
        pods = self.cluster_pods(name, namespace)
        events = self._list_core(self.core.list_namespaced_event, namespace, field_selector="involvedObject.kind=Pod")
        return diagnose_pods(read_ray_cluster(cluster, pods), pods, events)

    @staticmethod
    def dashboard_proxy_path(name: str, namespace: str) -> str:
        """The head service's dashboard port, on the API server's service proxy."""
        return f"/api/v1/namespaces/{namespace}/services/{name}-head-svc:dashboard/proxy"

    def dashboard_url(self, name: str, namespace: str) -> str:
        if self.settings.dashboard == "url":
            return (self.settings.dashboard_url or "").format(cluster_name=name, namespace=namespace)
        if self.settings.dashboard == "dns":
            return f"http://{name}-head-svc.{namespace}.svc.cluster.local:{DASHBOARD_PORT}"
        return self.api_client.configuration.host.rstrip("/") + self.dashboard_proxy_path(name, namespace)

    # -- async -----------------------------------------------------------------------------

    async def _aread(self, api_client: k8s_async.ApiClient, name: str, namespace: str,
                     cluster: dict[str, Any] | None) -> ClusterStatus:
        if cluster is None:
            return read_ray_cluster(None)
        pods = await k8s_async.CoreV1Api(api_client).list_namespaced_pod(
            namespace, label_selector=f"{CLUSTER_LABEL}={name}", _preload_content=False
        )
        return read_ray_cluster(cluster, json.loads(await pods.read()).get("items", []))

    async def _watch(
        self,
        plural: str,
        name: str,
        namespace: str,
        poll_interval: float,
        read: Callable[[k8s_async.ApiClient, dict[str, Any] | None], Awaitable[T]],
    ) -> AsyncIterator[T]:
        """Watch one custom object (field selector on its name) and yield ``read(client, object)`` on every change.

        ``object`` is ``None`` when it does not exist or was deleted. Resumes from the last
        resourceVersion after a dropped stream, lists again on 410 Gone, and after repeated
        watch failures (e.g. a proxy that cuts streams) polls every ``poll_interval`` seconds
        for a while before it tries watching again.
        """
        kind = KINDS[plural]
        failures = 0
        polling_until = 0.0
        resource_version: str | None = None
        while True:
            try:
                async with self.async_api_client() as api_client:
                    api = k8s_async.CustomObjectsApi(api_client)
                    if resource_version is None:
                        listed = await api_retry()(api.list_namespaced_custom_object)(
                            GROUP, VERSION, namespace, plural, field_selector=f"metadata.name={name}"
                        )
                        resource_version = listed["metadata"]["resourceVersion"]
                        items = listed.get("items") or []
                        yield await read(api_client, items[0] if items else None)
                    if failures >= WATCH_FAILURES_BEFORE_POLLING:
                        log.warning("Watching %s %s failed %d times; polling every %s s for %s s, then watching again",
                                    kind, name, failures, poll_interval, POLL_BEFORE_WATCHING_AGAIN_SECONDS)
                        failures, polling_until = 0, time.monotonic() + POLL_BEFORE_WATCHING_AGAIN_SECONDS
                    if time.monotonic() < polling_until:
                        await asyncio.sleep(poll_interval)
                        resource_version = None
                        continue
                    async with k8s_watch.Watch() as stream:
                        async for event in stream.stream(
                            api.list_namespaced_custom_object, GROUP, VERSION, namespace, plural,
                            field_selector=f"metadata.name={name}", resource_version=resource_version,
                            timeout_seconds=WATCH_SECONDS, allow_watch_bookmarks=True,
                        ):
                            obj = event["raw_object"]
                            resource_version = obj.get("metadata", {}).get("resourceVersion", resource_version)
                            if event["type"] == "BOOKMARK":
                                continue
                            failures = 0
                            yield await read(api_client, None if event["type"] == "DELETED" else obj)
            except AsyncApiException as exc:
                if exc.status == 410:
                    log.info("Watch of %s %s expired (410 Gone); listing again", kind, name)
                    resource_version = None
                    continue
                if exc.status in (401, 403):
                    raise explain_api_error(exc, "watch", f"{plural}.{GROUP}", namespace) from exc
                failures += 1
                log.warning("Watch of %s %s failed (%s); retry %d", kind, name, exc.status, failures)
                await asyncio.sleep(min(2**failures * 0.25, poll_interval))
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
                failures += 1
                log.warning("Watch of %s %s dropped (%s); retry %d", kind, name, exc, failures)
                await asyncio.sleep(min(2**failures * 0.25, poll_interval))

    def watch_cluster(self, name: str, namespace: str, poll_interval: float = 10.0) -> AsyncIterator[ClusterStatus]:
        """Watch the one RayCluster and yield its status on every change (see :meth:`_watch`).

        Returns the watch generator itself (no wrapping generator, so closing it closes everything).
        """

        async def read(api_client: k8s_async.ApiClient, cluster: dict[str, Any] | None) -> ClusterStatus:
            return await self._aread(api_client, name, namespace, cluster)

        return self._watch(RAY_CLUSTERS, name, namespace, poll_interval, read)

    async def adiagnose(self, name: str, namespace: str) -> str:
        return await asyncio.to_thread(self.diagnose, name, namespace)


class KubeRayServices(ServiceBackend):
    """RayServices as KubeRay custom resources, next to the RayClusters of :class:`KubeRayBackend`.

    :param backend: the backend whose clients and RayClusters it uses.
    """

    def __init__(self, backend: KubeRayBackend) -> None:
        self.backend = backend

    def apply_service(self, manifest: dict[str, Any]) -> ApplyResult:
        name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
        for _ in range(APPLY_CONFLICT_ATTEMPTS):
            existing = self.get_service(name, namespace)
            if existing is None:
                try:
                    created = self.backend._call(
                        "create", namespace, self.backend.custom_objects.create_namespaced_custom_object,
                        GROUP, VERSION, namespace, RAY_SERVICES, manifest, field_validation="Strict",
                        plural=RAY_SERVICES,
                    )
                    return ApplyResult(Applied.CREATED, created)
                except ApiException as exc:
                    if exc.status != 409:
                        raise
                    continue  # created meanwhile, e.g. by our own first attempt whose answer was lost
            if not is_managed(existing):
                raise foreign_service_error(existing)
            if same_service(existing, manifest):
                return ApplyResult(Applied.ADOPTED, existing)
            replacement = {
                **manifest,
                "metadata": {
                    **existing["metadata"],
                    "labels": {**(existing["metadata"].get("labels") or {}), **manifest["metadata"]["labels"]},
                    "annotations": {
                        **(existing["metadata"].get("annotations") or {}),
                        **manifest["metadata"]["annotations"],
                    },
                },
            }
            try:
                updated = self.backend._call(
                    "update", namespace, self.backend.custom_objects.replace_namespaced_custom_object,
                    GROUP, VERSION, namespace, RAY_SERVICES, name, replacement, field_validation="Strict",
                    plural=RAY_SERVICES,
                )
                return ApplyResult(Applied.UPDATED, updated)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                # KubeRay wrote the status since we read it (stale resourceVersion): read again.
                log.info("RayService %s/%s changed while being updated; reading it again", namespace, name)
        raise FatalError(
            f"RayService {namespace}/{name} kept changing while being updated ({APPLY_CONFLICT_ATTEMPTS} attempts)"
        )

    def get_service(self, name: str, namespace: str) -> dict[str, Any] | None:
        return self.backend._get_object(RAY_SERVICES, name, namespace)

    def delete_service(self, name: str, namespace: str) -> bool:
        return self.backend._delete_object(RAY_SERVICES, name, namespace)

    @staticmethod
    def _cluster_names(service: dict[str, Any] | None) -> tuple[str, str]:
        status = (service or {}).get("status") or {}
        return (
            (status.get("activeServiceStatus") or {}).get("rayClusterName") or "",
            (status.get("pendingServiceStatus") or {}).get("rayClusterName") or "",
        )

    @staticmethod
    def _needs_serve_record(service: dict[str, Any]) -> bool:
        """After an in-place update only Serve itself can say whether the active cluster runs the new config."""
        active, pending = KubeRayServices._cluster_names(service)
        return update_kind(service) == IN_PLACE and bool(active) and not pending

    def serve_applications(self, cluster_name: str, namespace: str) -> dict[str, Any] | None:
        """Serve's ``applications`` on a cluster (``GET /api/serve/applications/``); ``None`` if unreachable."""
        try:
            if self.backend.settings.dashboard == "proxy":
                raw = self.backend.api_client.call_api(
                    self.backend.dashboard_proxy_path(cluster_name, namespace) + SERVE_APPLICATIONS_ENDPOINT, "GET",
                    header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
                    _preload_content=False, _return_http_data_only=True,
                )
                return json.loads(raw.data).get("applications") or {}
            import requests

            answer = requests.get(self.backend.dashboard_url(cluster_name, namespace) + SERVE_APPLICATIONS_ENDPOINT, timeout=10)
            answer.raise_for_status()
            return answer.json().get("applications") or {}
        except Exception as exc:  # the dashboard restarts, the proxy has no endpoints yet, RBAC
            log.warning("Cannot read Serve applications of RayCluster %s/%s: %s", namespace, cluster_name, exc)
            return None

    def _read_service(self, service: dict[str, Any] | None, version: str | None) -> ServiceStatus:
        if service is None:
            return read_ray_service(None, version=version)
        namespace = service["metadata"]["namespace"]
        active, pending = self._cluster_names(service)
        return read_ray_service(
            service,
            active_cluster=self.backend.get_cluster(active, namespace) if active else None,
            pending_cluster=self.backend.get_cluster(pending, namespace) if pending else None,
            serve_applications=self.serve_applications(active, namespace) if self._needs_serve_record(service) else None,
            version=version,
        )

    def service_status(self, name: str, namespace: str, version: str | None = None) -> ServiceStatus:
        return self._read_service(self.get_service(name, namespace), version)

    async def aservice_status(self, name: str, namespace: str, version: str | None = None) -> ServiceStatus:
        async with self.backend.async_api_client() as api_client:
            service = await self.backend._aget(api_client, RAY_SERVICES, name, namespace)
            return await self._aread_service(api_client, service, version)

    async def _aserve_applications(self, api_client: k8s_async.ApiClient, cluster_name: str,
                                   namespace: str) -> dict[str, Any] | None:
        try:
            if self.backend.settings.dashboard == "proxy":
                raw = await api_client.call_api(
                    self.backend.dashboard_proxy_path(cluster_name, namespace) + SERVE_APPLICATIONS_ENDPOINT, "GET",
                    header_params={"Accept": "application/json"}, auth_settings=["BearerToken"],
                    _preload_content=False, _return_http_data_only=True,
                )
                return json.loads(await raw.read()).get("applications") or {}
            url = await asyncio.to_thread(self.backend.dashboard_url, cluster_name, namespace)
            async with aiohttp.ClientSession() as session:
                async with session.get(url + SERVE_APPLICATIONS_ENDPOINT) as answer:
                    answer.raise_for_status()
                    return (await answer.json(content_type=None)).get("applications") or {}
        except Exception as exc:  # the dashboard restarts, the proxy has no endpoints yet, RBAC
            log.warning("Cannot read Serve applications of RayCluster %s/%s: %s", namespace, cluster_name, exc)
            return None

    async def _aread_service(self, api_client: k8s_async.ApiClient, service: dict[str, Any] | None,
                             version: str | None) -> ServiceStatus:
        if service is None:
            return read_ray_service(None, version=version)
        namespace = service["metadata"]["namespace"]
        active, pending = self._cluster_names(service)
        return read_ray_service(
            service,
            active_cluster=await self.backend._aget(api_client, RAY_CLUSTERS, active, namespace) if active else None,
            pending_cluster=await self.backend._aget(api_client, RAY_CLUSTERS, pending, namespace) if pending else None,
            serve_applications=(await self._aserve_applications(api_client, active, namespace)
                                if self._needs_serve_record(service) else None),
            version=version,
        )

    def watch_service(
        self, name: str, namespace: str, version: str | None = None, poll_interval: float = 10.0
    ) -> AsyncIterator[ServiceStatus]:
        """Watch the one RayService and yield its status on every change (the RayCluster watch loop, :meth:`_watch`).

        Each status also reads the active and pending RayClusters the service names (their
        pod templates carry the version each was made for).
        """

        async def read(api_client: k8s_async.ApiClient, service: dict[str, Any] | None) -> ServiceStatus:
            return await self._aread_service(api_client, service, version)

        return self.backend._watch(RAY_SERVICES, name, namespace, poll_interval, read)

    def diagnose_service(self, name: str, namespace: str, version: str | None = None,
                         waited: float | None = None) -> str:
        service = self.get_service(name, namespace)
        status = self._read_service(service, version)
        if service is None:
            return status.message
        target = status.target_cluster
        return diagnose_ray_service(
            status,
            waited=waited,
            serve_applications=self.serve_applications(target, namespace) if target else None,
            cluster_diagnosis=self.backend.diagnose(target, namespace) if target else "",
            config_problems=service_config_problems(service),
        )

    async def adiagnose_service(self, name: str, namespace: str, version: str | None = None,
                                waited: float | None = None) -> str:
        return await asyncio.to_thread(self.diagnose_service, name, namespace, version, waited)

    @staticmethod
    def serve_proxy_path(name: str, namespace: str) -> str:
        """The Serve service's ``serve`` port, on the API server's service proxy."""
        return f"/api/v1/namespaces/{namespace}/services/{serve_service_name(name)}:{SERVE_PORT_NAME}/proxy"

    def serve_url(self, name: str, namespace: str) -> str:
        if self.backend.settings.dashboard == "proxy":
            return self.backend.api_client.configuration.host.rstrip("/") + self.serve_proxy_path(name, namespace)
        return f"http://{serve_service_name(name)}.{namespace}.svc.cluster.local:{SERVE_PORT}"

    def serve_request(self, name: str, namespace: str, method: str, path: str,
                      body: Any = None, timeout: float = 30.0) -> tuple[int, bytes]:
        """One request to the Serve proxy; through the API server's service proxy with the client's own auth."""
        path = "/" + path.lstrip("/")
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.backend.settings.dashboard != "proxy":
            import requests

            answer = requests.request(method, self.serve_url(name, namespace) + path, json=body, timeout=timeout)
            return answer.status_code, answer.content
        try:
            raw = self.backend.api_client.call_api(
                self.serve_proxy_path(name, namespace) + path, method, header_params=headers, body=body,
                auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True,
                _request_timeout=timeout,
            )
            return raw.status, raw.data
        except ApiException as exc:
            data = exc.body if isinstance(exc.body, bytes) else (exc.body or "").encode()
            return exc.status, data
