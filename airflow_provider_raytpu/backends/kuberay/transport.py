"""How a KubeRay backend reaches a Ray cluster's dashboard or Serve proxy: the API server's service proxy, or directly.

The connection's ``dashboard`` field decides, here and nowhere else (:func:`reach`):
``proxy`` (the default) goes through ``/api/v1/namespaces/<ns>/services/<svc>:<port>/proxy``
on the API server with the Kubernetes client's own authentication (tokens, exec plugins,
client certificates, refreshed GKE tokens; no public LoadBalancer and no copied
credential); ``dns`` and ``url`` go to the address directly.

Async requests and WebSockets through the proxy use the event loop's shared Kubernetes client
(:mod:`~airflow_provider_raytpu.backends.kuberay.shared_client`): its connection pool and its
credentials, refreshed as they require.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from kubernetes.client.rest import ApiException
from kubernetes_asyncio.client.exceptions import ApiException as AsyncApiException

from airflow_provider_raytpu.dashboard.transport import DirectTransport, HttpAnswer, HttpTransport

if TYPE_CHECKING:
    import aiohttp
    from kubernetes_asyncio import client as k8s_async

    from airflow_provider_raytpu.backends.kuberay.clients import KubeClients
    from airflow_provider_raytpu.connection import ConnectionSettings


def _bytes(body: Any) -> bytes:
    return body if isinstance(body, bytes) else (body or "").encode()


class ApiServerProxyTransport(HttpTransport):
    """A port of a Kubernetes Service, through the API server's service proxy, with the connection's own auth.

    :param clients: the connection's Kubernetes clients.
    :param namespace: the Service's namespace.
    :param service: the Service's name.
    :param port: the port's name (or number).
    """

    # A 401/403 here is the API server's (RBAC on services/proxy), not Ray's token authentication.
    ray_auth_errors = False

    def __init__(self, clients: KubeClients, namespace: str, service: str, port: str | int) -> None:
        self.clients = clients
        self.path = f"/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy"

    @property
    def url(self) -> str:
        host: str = self.clients.api_client.configuration.host
        return host.rstrip("/") + self.path

    @property
    def browser_url(self) -> str | None:
        """The proxy URL itself. A browser needs its own access to the API server to open it (with
        ``kubectl proxy`` running, the same path below ``http://127.0.0.1:8001``); the connection's
        credentials are never put in a link."""
        return self.url

    def _call(self, path: str, json: Any, data: bytes | None,
              headers: Mapping[str, str] | None) -> tuple[str, dict[str, str], Any]:
        sent = {"Accept": "application/json", **(headers or {})}
        if json is not None and data is None:
            sent.setdefault("Content-Type", "application/json")
        return self.path + "/" + path.lstrip("/"), sent, data if data is not None else json

    def request(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                headers: Mapping[str, str] | None = None, timeout: float | None = 30.0) -> HttpAnswer:
        resource, sent, body = self._call(path, json, data, headers)
        try:
            raw = self.clients.api_client.call_api(
                resource, method, header_params=sent, body=body, auth_settings=["BearerToken"],
                _preload_content=False, _return_http_data_only=True, _request_timeout=timeout,
            )
            return HttpAnswer(raw.status, raw.data)
        except ApiException as exc:
            return HttpAnswer(exc.status, _bytes(exc.body))

    @contextlib.asynccontextmanager
    async def aclient(self) -> AsyncIterator[k8s_async.ApiClient]:
        """The event loop's shared async Kubernetes client, held for one request."""
        async with self.clients.async_api_client() as api_client:
            yield api_client

    async def arequest(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                       headers: Mapping[str, str] | None = None, timeout: float | None = 30.0) -> HttpAnswer:
        resource, sent, body = self._call(path, json, data, headers)

        async def send(api_client: k8s_async.ApiClient) -> HttpAnswer:
            try:
                raw = await api_client.call_api(
                    resource, method, header_params=dict(sent), body=body, auth_settings=["BearerToken"],
                    _preload_content=False, _return_http_data_only=True, _request_timeout=timeout,
                )
                try:
                    answer = HttpAnswer(raw.status, await raw.read())
                finally:
                    raw.release()
            except AsyncApiException as exc:
                answer = HttpAnswer(exc.status, _bytes(exc.body))
            if answer.status == 401:  # the API server's (proxied errors of the endpoint are 502/503)
                raise AsyncApiException(status=401, reason=answer.text(200))
            return answer

        shared = await self.clients.shared()
        try:
            return await shared.call(send)
        except AsyncApiException as exc:
            if exc.status != 401:
                raise
            return HttpAnswer(401, (exc.reason or "").encode())

    @contextlib.asynccontextmanager
    async def websocket(self, path: str, headers: Mapping[str, str] | None = None,
                        ) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
        shared = await self.clients.shared()
        async with shared.stream() as (api_client, session):
            host = api_client.configuration.host
            if host is None:  # only if set to None by hand: a kubeconfig always names the API server
                raise ValueError("the Kubernetes client has no API server host")
            url = host.rstrip("/") + self.path + "/" + path.lstrip("/")
            headers = {**(headers or {}), **await shared.auth_headers(api_client)}
            async with session.ws_connect(url, headers=headers, max_msg_size=0,
                                          server_hostname=api_client.rest_client.server_hostname) as ws:
                yield ws


def reach(settings: ConnectionSettings, clients: KubeClients, namespace: str, service: str, port: str,
          direct_url: str) -> HttpTransport:
    """The transport to a Service port of a Ray cluster, as the connection's ``dashboard`` field says.

    :param namespace: the Service's namespace.
    :param service: the Service's name.
    :param port: the port's name, for the API server's service proxy.
    :param direct_url: the URL for ``dashboard`` ``dns`` or ``url``.
    """
    if settings.dashboard == "proxy":
        return ApiServerProxyTransport(clients, namespace, service, port)
    return DirectTransport(direct_url)
