"""The service proxy: ``/api/v1/namespaces/<ns>/services/<svc>:<port>/proxy/...`` forwarded to a
URL a test registered (e.g. a local Ray dashboard); 503 "no endpoints" until then."""

from __future__ import annotations

import threading
from dataclasses import replace

import aiohttp
from aiohttp import web

from ._errors import ApiError, status_body
from ._faults import FaultInjector
from ._http import json_response
from ._routing import Route
from ._store import ObjectStore

_NOT_FORWARDED = ("host", "authorization", "content-length", "transfer-encoding", "connection")


class ServiceProxy:
    """Forwards proxied requests of a Service that exists in ``store`` to its registered target."""

    def __init__(self, store: ObjectStore, faults: FaultInjector) -> None:
        self._store = store
        self._faults = faults
        self._lock = threading.Lock()
        self._targets: dict[tuple[str, str, str], str] = {}
        self._session: aiohttp.ClientSession | None = None

    def register(self, namespace: str, service: str, port: str | int, target_url: str) -> None:
        with self._lock:
            self._targets[(namespace, service, str(port))] = target_url.rstrip("/")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def forward(self, request: web.Request, route: Route) -> web.StreamResponse:
        parts = (route.name or "").split(":")
        if len(parts) == 3:
            _, svc, port = parts
        elif len(parts) == 2:
            svc, port = parts
        else:
            svc, port = parts[0], ""
        self._faults.check_denied("get" if request.method == "GET" else "create", replace(route, name=svc))
        assert route.res is not None and route.namespace is not None
        with self._store.lock:
            service = self._store.get(route.res, route.namespace, svc)
        with self._lock:
            target = self._targets.get((route.namespace, svc, port))
        if service is None:
            raise ApiError.not_found(route.res, svc)
        if target is None:
            raise ApiError(503, "ServiceUnavailable", f'no endpoints available for service "{route.name}"', {})
        if self._session is None:
            self._session = aiohttp.ClientSession()
        url = f"{target}/{route.proxy_rest}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        try:
            async with self._session.request(request.method, url, params=request.query,
                                             data=await request.read(), headers=headers,
                                             allow_redirects=False) as upstream:
                body = await upstream.read()
                out_headers = {k: v for k, v in upstream.headers.items()
                               if k.lower() in ("content-type", "location", "cache-control")}
                return web.Response(body=body, status=upstream.status, headers=out_headers)
        except aiohttp.ClientError as exc:
            return json_response(status_body(503, "ServiceUnavailable", f"error trying to reach service: {exc}"), 503)
