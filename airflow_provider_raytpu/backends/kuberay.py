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
from collections.abc import AsyncIterator, Callable
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
    conflict_error,
    same_spec,
)
from airflow_provider_raytpu.errors import FatalError, PermissionDeniedError
from airflow_provider_raytpu.manifests.raycluster import DASHBOARD_PORT, MANAGED_BY, MANAGED_BY_LABEL
from airflow_provider_raytpu.status import ClusterStatus, diagnose_pods, read_ray_cluster

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.settings import ConnectionSettings

log = logging.getLogger(__name__)

GROUP = "ray.io"
VERSION = "v1"
RAY_CLUSTERS = "rayclusters"
CLUSTER_LABEL = "ray.io/cluster"
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
WATCH_SECONDS = 240
WATCH_FAILURES_BEFORE_POLLING = 3

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
    """RayClusters as KubeRay custom resources.

    :param settings: the parsed ``raytpu`` connection (backend ``kubernetes`` or ``gke``).
    """

    def __init__(self, settings: ConnectionSettings) -> None:
        super().__init__(settings)
        self._gke_endpoint: tuple[str, str] | None = None

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

    def _call(self, verb: str, namespace: str | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return api_retry()(fn)(*args, **kwargs)
        except ApiException as exc:
            explained = explain_api_error(exc, verb, f"{RAY_CLUSTERS}.{GROUP}", namespace)
            if explained is exc:
                raise
            raise explained from exc

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
        try:
            return self._call(
                "get", namespace, self.custom_objects.get_namespaced_custom_object, GROUP, VERSION, namespace,
                RAY_CLUSTERS, name,
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def delete_cluster(self, name: str, namespace: str) -> bool:
        try:
            self._call(
                "delete", namespace, self.custom_objects.delete_namespaced_custom_object, GROUP, VERSION, namespace,
                RAY_CLUSTERS, name, propagation_policy="Background",
            )
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise

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

    async def watch_cluster(self, name: str, namespace: str, poll_interval: float = 10.0) -> AsyncIterator[ClusterStatus]:
        """Watch the one RayCluster (field selector on its name) and yield its status on every change.

        Resumes from the last resourceVersion after a dropped stream, lists again on
        410 Gone, and falls back to polling every ``poll_interval`` seconds after
        repeated watch failures (e.g. a proxy that cuts streams).
        """
        failures = 0
        resource_version: str | None = None
        while True:
            try:
                async with self.async_api_client() as api_client:
                    api = k8s_async.CustomObjectsApi(api_client)
                    if resource_version is None:
                        listed = await api_retry()(api.list_namespaced_custom_object)(
                            GROUP, VERSION, namespace, RAY_CLUSTERS, field_selector=f"metadata.name={name}"
                        )
                        resource_version = listed["metadata"]["resourceVersion"]
                        items = listed.get("items") or []
                        yield await self._aread(api_client, name, namespace, items[0] if items else None)
                    if failures >= WATCH_FAILURES_BEFORE_POLLING:
                        await asyncio.sleep(poll_interval)
                        resource_version = None
                        continue
                    async with k8s_watch.Watch() as stream:
                        async for event in stream.stream(
                            api.list_namespaced_custom_object, GROUP, VERSION, namespace, RAY_CLUSTERS,
                            field_selector=f"metadata.name={name}", resource_version=resource_version,
                            timeout_seconds=WATCH_SECONDS, allow_watch_bookmarks=True,
                        ):
                            obj = event["raw_object"]
                            resource_version = obj.get("metadata", {}).get("resourceVersion", resource_version)
                            if event["type"] == "BOOKMARK":
                                continue
                            failures = 0
                            cluster = None if event["type"] == "DELETED" else obj
                            yield await self._aread(api_client, name, namespace, cluster)
            except AsyncApiException as exc:
                if exc.status == 410:
                    log.info("Watch of RayCluster %s expired (410 Gone); listing again", name)
                    resource_version = None
                    continue
                if exc.status in (401, 403):
                    raise explain_api_error(exc, "watch", f"{RAY_CLUSTERS}.{GROUP}", namespace) from exc
                failures += 1
                log.warning("Watch of RayCluster %s failed (%s); retry %d", name, exc.status, failures)
                await asyncio.sleep(min(2**failures * 0.25, poll_interval))
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
                failures += 1
                log.warning("Watch of RayCluster %s dropped (%s); retry %d", name, exc, failures)
                await asyncio.sleep(min(2**failures * 0.25, poll_interval))

    async def adiagnose(self, name: str, namespace: str) -> str:
        return await asyncio.to_thread(self.diagnose, name, namespace)
