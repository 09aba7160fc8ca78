"""Ray's token authentication on KubeRay clusters: turned on at create, and the token on every dashboard request.

A RayCluster with ``spec.authOptions.mode: token`` (KubeRay 1.5.1+, Ray 2.52+) runs every Ray
container with ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` from a Secret: ``authOptions.secretName``,
or the one KubeRay makes for the cluster, named after it (``utils.CheckName``), key ``auth_token``
(ray-operator v1.6.2: ``raycluster_controller.go`` ``reconcileAuthSecret``, ``common/pod.go``
``SetContainerTokenAuthEnvVars``). Ray's dashboard then answers 401 without a token, 403 with a
wrong one, and takes it as ``Authorization: Bearer`` or ``X-Ray-Authorization: Bearer`` "for proxies
and KubeRay" (Ray 2.60 ``_private/authentication/http_token_authentication.py``). We send the
second, as KubeRay's own dashboard client does (``utils/dashboardclient/dashboard_httpclient.go``):
the API server authenticates us with ``Authorization`` and removes it before proxying
(k8s.io/apiserver ``pkg/endpoints/filters/authentication.go``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from kubernetes.client.rest import ApiException
from kubernetes_asyncio.client.exceptions import ApiException as AsyncApiException

from airflow_provider_raytpu.backends.kuberay.objects import is_transient
from airflow_provider_raytpu.dashboard.transport import HttpAnswer, HttpTransport
from airflow_provider_raytpu.errors import FatalError

if TYPE_CHECKING:
    import aiohttp
    from kubernetes_asyncio.client.models import V1Secret

    from airflow_provider_raytpu.backends.kuberay.objects import CustomObjects

#: The oldest Ray with token authentication (KubeRay refuses ``authOptions.mode: token`` below it).
MIN_RAY_VERSION = (2, 52)
TOKEN_KEY = "auth_token"
HEADER = "X-Ray-Authorization"


def add_token_auth(spec: dict[str, Any]) -> None:
    """Put ``authOptions.mode: token`` into a RayCluster spec whose ``rayVersion`` has token authentication
    and that has no ``authOptions`` of its own."""
    if "authOptions" not in spec and _has_token_auth(spec.get("rayVersion")):
        spec["authOptions"] = {"mode": "token"}


def _has_token_auth(ray_version: str | None) -> bool:
    numbers = re.match(r"(\d+)\.(\d+)", ray_version or "")
    return numbers is not None and (int(numbers[1]), int(numbers[2])) >= MIN_RAY_VERSION


def token_secret(cluster: Mapping[str, Any]) -> str | None:
    """The Secret that holds a RayCluster's Ray token; ``None`` when Ray runs without one."""
    auth = (cluster.get("spec") or {}).get("authOptions") or {}
    if auth.get("mode") != "token" or auth.get("enableK8sTokenAuth"):
        return None
    return auth.get("secretName") or check_name(cluster["metadata"]["name"])


def check_name(name: str) -> str:
    """KubeRay's ``utils.CheckName``: the last 50 characters, starting with a letter."""
    name = name[-50:]
    return "r" + name[1:] if name[0].isdigit() or not name[0].isalnum() else name


class RayTokenTransport(HttpTransport):
    """A RayCluster's dashboard that carries the cluster's Ray token on every request and WebSocket.

    The token is read when first needed (constructing does no I/O) and again when Ray refuses it
    (the cluster was made again under its name, with a new Secret). A cluster without token
    authentication gets no header; one whose Secret KubeRay has not made yet gets none until it has.
    While the API server cannot be read, requests answer 503 (a WebSocket raises ``ConnectionError``),
    as when the dashboard itself is unreachable.

    :param inner: the way to the dashboard (the API server's proxy, or directly).
    :param clusters: the connection's RayCluster objects (their client also reads the Secret).
    :param cluster: the RayCluster's name.
    :param namespace: its namespace.
    """

    def __init__(self, inner: HttpTransport, clusters: CustomObjects, cluster: str, namespace: str) -> None:
        self.inner = inner
        self.clusters = clusters
        self.cluster = cluster
        self.namespace = namespace
        self._headers: dict[str, str] | None = None
        self._reading = asyncio.Lock()

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def browser_url(self) -> str | None:
        return self.inner.browser_url

    @property
    def ray_auth_errors(self) -> bool:
        return self.inner.ray_auth_errors

    def _where(self, secret: str) -> str:
        return f"Secret {self.namespace}/{secret} (the Ray token of RayCluster {self.namespace}/{self.cluster})"

    def _found(self, cluster: Mapping[str, Any] | None) -> str | None:
        """The Secret to read; without one, what is known is kept (no token; or nothing, no cluster yet)."""
        secret = token_secret(cluster) if cluster is not None else None
        if secret is None and cluster is not None:
            self._headers = {}
        return secret

    def _absent(self, exc: ApiException | AsyncApiException, secret: str) -> None:
        """A failed read of the Secret: ``None`` when KubeRay has not made it yet (it does right after the
        cluster); a refusal names the missing RBAC rule; anything else is raised again."""
        if exc.status == 404:
            return None
        if exc.status == 403:
            raise FatalError(
                f"Reading {self._where(secret)} was refused: grant 'get' on secrets in namespace "
                f"{self.namespace!r} (docs/rbac.yaml), or set the connection's ray_auth to false"
            ) from exc
        raise exc

    def _remember(self, found: Any, secret: str) -> dict[str, str]:
        if found is None:
            return {}
        data = found.data or {}
        if TOKEN_KEY not in data:
            raise FatalError(f"{self._where(secret)} has no {TOKEN_KEY!r} key; KubeRay's authOptions.secretName "
                             "must name a Secret with one")
        self._headers = {HEADER: f"Bearer {base64.b64decode(data[TOKEN_KEY]).decode()}"}
        return self._headers

    def headers(self) -> dict[str, str]:
        """The token header, read through the sync client the first time."""
        if self._headers is not None or not (secret := self._found(self.clusters.get(self.cluster, self.namespace))):
            return self._headers or {}
        try:
            found = self.clusters.clients.core.read_namespaced_secret(secret, self.namespace)
        except ApiException as exc:
            self._absent(exc, secret)
            found = None
        return self._remember(found, secret)

    async def aheaders(self) -> dict[str, str]:
        """:meth:`headers` through the event loop's shared client; the followers that ask at once share one read."""
        if self._headers is not None:
            return self._headers
        async with self._reading:
            return self._headers if self._headers is not None else await self._aread()

    async def _aread(self) -> dict[str, str]:
        from kubernetes_asyncio import client as k8s_async

        shared = await self.clusters.clients.shared()
        if not (secret := self._found(await shared.call(
                lambda client: self.clusters.aget(client, self.cluster, self.namespace)))):
            return self._headers or {}
        found: V1Secret | None
        try:
            found = await shared.call(
                lambda client: k8s_async.CoreV1Api(client).read_namespaced_secret(secret, self.namespace))
        except AsyncApiException as exc:
            self._absent(exc, secret)
            found = None
        return self._remember(found, secret)

    def _unreadable(self, exc: BaseException) -> HttpAnswer:
        return HttpAnswer(503, f"reading the Ray token of RayCluster {self.namespace}/{self.cluster}: {exc}".encode())

    def request(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                headers: Mapping[str, str] | None = None, timeout: float | None = 30.0) -> HttpAnswer:
        for attempt in (1, 2):
            try:
                token = self.headers()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                return self._unreadable(exc)
            answer = self.inner.request(method, path, json=json, data=data, timeout=timeout,
                                        headers={**(headers or {}), **token})
            if attempt == 2 or not answer.ray_refused:
                return answer
            self._headers = None
        return answer

    async def arequest(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                       headers: Mapping[str, str] | None = None, timeout: float | None = 30.0) -> HttpAnswer:
        for attempt in (1, 2):
            try:
                token = await self.aheaders()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                return self._unreadable(exc)
            answer = await self.inner.arequest(method, path, json=json, data=data, timeout=timeout,
                                               headers={**(headers or {}), **token})
            if attempt == 2 or not answer.ray_refused:
                return answer
            self._headers = None
        return answer

    @contextlib.asynccontextmanager
    async def websocket(self, path: str, headers: Mapping[str, str] | None = None,
                        ) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
        try:
            token = await self.aheaders()
        except Exception as exc:
            if not is_transient(exc):
                raise
            raise ConnectionError(self._unreadable(exc).text()) from exc
        async with self.inner.websocket(path, {**(headers or {}), **token}) as ws:
            yield ws
