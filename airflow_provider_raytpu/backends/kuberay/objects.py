"""KubeRay custom objects (``rayclusters.ray.io``, ``rayservices.ray.io``): create, get, replace, delete, list.

Transient API answers (429 honouring Retry-After, 5xx, dropped connections) are retried;
a delete carries the checked object's uid as a precondition, so its retry never takes a successor;
other 4xx are not, and a 401 / 403 / 400 / 422 becomes an error a user can act on
(:func:`explain_api_error`). Reads are the cncf ``KubernetesHook``'s own ``get_custom_object``
(with its retry of transient answers). Create, replace and delete are not: the hook's
``create_custom_object`` cannot ask for strict field validation (a misspelt field in a manifest
must fail, not be pruned), the hook has no replace or list, and its ``delete_custom_object``
retries a 409, which for a delete with a precondition is the final answer "not that object".
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import tenacity
import urllib3
from airflow.providers.cncf.kubernetes.kubernetes_helper_functions import WaitRetryAfterOrExponential
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException
from kubernetes_asyncio import client as k8s_async
from kubernetes_asyncio.client.exceptions import ApiException as AsyncApiException

from airflow_provider_raytpu.backends.apply import AlreadyExists, StaleWrite
from airflow_provider_raytpu.backends.base import ChangedSinceChecked, Precondition
from airflow_provider_raytpu.backends.kuberay.clients import RETRY_AFTER_CAP
from airflow_provider_raytpu.errors import FatalError, PermissionDeniedError

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.kuberay.clients import KubeClients

log = logging.getLogger(__name__)

GROUP = "ray.io"
VERSION = "v1"
RAY_CLUSTERS = "rayclusters"
RAY_SERVICES = "rayservices"
KINDS = {RAY_CLUSTERS: "RayCluster", RAY_SERVICES: "RayService"}
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})

T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (ApiException, AsyncApiException)):
        return exc.status in TRANSIENT_STATUS
    return isinstance(exc, (urllib3.exceptions.HTTPError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                            ConnectionError, asyncio.TimeoutError))


class CappedWait(tenacity.wait.wait_base):
    """The cncf hook's wait (a 429's Retry-After, else exponential), never longer than ``cap`` seconds.

    :param cap: the longest wait.
    """

    def __init__(self, cap: float = RETRY_AFTER_CAP) -> None:
        self.cap = cap
        self.inner = WaitRetryAfterOrExponential()

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return min(float(self.inner(retry_state)), self.cap)


def api_retry(attempts: int = 6) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Retry transient API errors (429 honouring Retry-After up to :data:`RETRY_AFTER_CAP` seconds, 5xx, dropped
    connections); never other 4xx."""
    return tenacity.retry(
        stop=tenacity.stop_after_attempt(attempts),
        wait=CappedWait(),
        retry=tenacity.retry_if_exception(is_transient),
        reraise=True,
        before_sleep=tenacity.before_sleep_log(log, logging.WARNING),
    )


def _body(exc: ApiException | AsyncApiException) -> dict[str, Any]:
    try:
        body: dict[str, Any] = json.loads(exc.body or "{}")
        return body
    except (TypeError, ValueError):
        return {}


def explain_api_error(exc: ApiException | AsyncApiException, verb: str, resource: str,
                      namespace: str | None) -> Exception:
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


@contextmanager
def explained(verb: str, resource: str, namespace: str | None) -> Iterator[None]:
    """Raise :func:`explain_api_error`'s error instead of a fatal ``ApiException``."""
    try:
        yield
    except ApiException as exc:
        explanation = explain_api_error(exc, verb, resource, namespace)
        if explanation is exc:
            raise
        # The explanation carries the API server's message; chaining the client's
        # exception would put its traceback and HTTP headers first in the task log.
        raise explanation from None


class CustomObjects:
    """One kind of ray.io object, through the connection's clients (an
    :class:`~airflow_provider_raytpu.backends.apply.ObjectStore`).

    :param clients: the connection's Kubernetes clients.
    :param plural: ``rayclusters`` or ``rayservices``.
    """

    def __init__(self, clients: KubeClients, plural: str) -> None:
        self.clients = clients
        self.plural = plural
        self.kind = KINDS[plural]
        self.resource = f"{plural}.{GROUP}"

    def get(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The object, or ``None`` when it does not exist."""
        try:
            with explained("get", self.resource, namespace):
                found: dict[str, Any] = self.clients.hook.get_custom_object(GROUP, VERSION, self.plural, name,
                                                                            namespace)
                return found
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create the object (fields the schema does not know are an error).

        :raises AlreadyExists: an object of that name exists.
        """
        namespace = manifest["metadata"]["namespace"]
        try:
            with explained("create", self.resource, namespace):
                created: dict[str, Any] = api_retry()(self.clients.custom_objects.create_namespaced_custom_object)(
                    GROUP, VERSION, namespace, self.plural, manifest, field_validation="Strict"
                )
                return created
        except ApiException as exc:
            if exc.status == 409:
                raise AlreadyExists(f"{self.kind} {namespace}/{manifest['metadata']['name']}") from None
            raise

    def replace(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Replace the object (its ``metadata.resourceVersion`` must be the stored one).

        :raises StaleWrite: the object changed since it was read.
        """
        name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
        try:
            with explained("update", self.resource, namespace):
                replaced: dict[str, Any] = api_retry()(self.clients.custom_objects.replace_namespaced_custom_object)(
                    GROUP, VERSION, namespace, self.plural, name, manifest, field_validation="Strict"
                )
                return replaced
        except ApiException as exc:
            if exc.status == 409:
                raise StaleWrite(f"{self.kind} {namespace}/{name}") from None
            raise

    def annotate(self, name: str, namespace: str, annotations: dict[str, str]) -> dict[str, Any]:
        """Set annotations on the object (a JSON merge patch of its metadata; nothing else changes)."""
        with explained("patch", self.resource, namespace):
            patched: dict[str, Any] = api_retry()(self.clients.custom_objects.patch_namespaced_custom_object)(
                GROUP, VERSION, namespace, self.plural, name, {"metadata": {"annotations": annotations}}
            )
            return patched

    def delete(self, name: str, namespace: str, precondition: Precondition | None = None) -> bool:
        """Delete the object (its dependents in the background); ``False`` when it was already gone.

        :param precondition: delete only the checked object (``DeleteOptions.preconditions``).
        :raises ChangedSinceChecked: the API server's 409: the stored object is not the checked one.
        """
        checked = precondition and k8s.V1Preconditions(uid=precondition.uid,
                                                        resource_version=precondition.resource_version)
        options = k8s.V1DeleteOptions(propagation_policy="Background", preconditions=checked)
        try:
            with explained("delete", self.resource, namespace):
                # The uid precondition makes a retry of a lost answer safe: it deletes the same object or none.
                api_retry()(self.clients.custom_objects.delete_namespaced_custom_object)(
                    GROUP, VERSION, namespace, self.plural, name, body=options)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            if exc.status == 409:
                raise ChangedSinceChecked(self.kind, name, namespace,
                                          _body(exc).get("message") or str(exc.reason)) from None
            raise

    def list(self, namespace: str | None, label_selector: str) -> list[dict[str, Any]]:
        """Objects matching a label selector, in one namespace or all (``None``)."""
        api = self.clients.custom_objects
        with explained("list", self.resource, namespace):
            if namespace is None:
                answer = api_retry()(api.list_cluster_custom_object)(
                    GROUP, VERSION, self.plural, label_selector=label_selector
                )
            else:
                answer = api_retry()(api.list_namespaced_custom_object)(
                    GROUP, VERSION, namespace, self.plural, label_selector=label_selector
                )
        items: list[dict[str, Any]] = answer.get("items", [])
        return items

    async def aget(self, api_client: k8s_async.ApiClient, name: str, namespace: str) -> dict[str, Any] | None:
        """:meth:`get` through an async client."""
        try:
            found: dict[str, Any] = await api_retry()(
                k8s_async.CustomObjectsApi(api_client).get_namespaced_custom_object
            )(GROUP, VERSION, namespace, self.plural, name)
            return found
        except AsyncApiException as exc:
            if exc.status == 404:
                return None
            raise
