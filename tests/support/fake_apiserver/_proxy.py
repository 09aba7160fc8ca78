"""The service proxy: ``/api/v1/namespaces/<ns>/services/<svc>:<port>/proxy/...`` forwarded to a
URL a test registered (e.g. a local Ray dashboard); 503 "no endpoints" until then.

WebSocket upgrades are passed through as the real API server's proxy does (its
UpgradeAwareHandler): the target's refusal comes back as its HTTP answer, an accepted upgrade
relays every message both ways. ``bytes_forwarded`` counts the bodies and messages sent back.
"""

from __future__ import annotations

import asyncio
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
_WEBSOCKET_HEADERS = ("upgrade", "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                      "sec-websocket-accept")


class ServiceProxy:
    """Forwards proxied requests of a Service that exists in ``store`` to its registered target."""

    def __init__(self, store: ObjectStore, faults: FaultInjector) -> None:
        self._store = store
        self._faults = faults
        self._lock = threading.Lock()
        self._targets: dict[tuple[str, str, str], str] = {}
        self._session: aiohttp.ClientSession | None = None
        #: Body and message bytes sent back to clients through the proxy.
        self.bytes_forwarded = 0
        #: WebSocket upgrades relayed so far.
        self.websockets = 0
        #: Answer upgrade requests with 400, as a proxy without WebSocket support would.
        self.refuse_upgrades = False

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
            target = self._targets.get((route.namespace, svc, port)) or self._targets.get((route.namespace, "*", port))
        if service is None:
            raise ApiError.not_found(route.res, svc)
        if target is None:
            raise ApiError(503, "ServiceUnavailable", f'no endpoints available for service "{route.name}"', {})
        if self._session is None:  # no cap on connections to the endpoints, as kube-apiserver's proxy
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        url = f"{target}/{route.proxy_rest}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._relay_websocket(request, url, headers)
        try:
            async with self._session.request(request.method, url, params=request.query,
                                             data=await request.read(), headers=headers,
                                             allow_redirects=False) as upstream:
                body = await upstream.read()
                self.bytes_forwarded += len(body)
                out_headers = {k: v for k, v in upstream.headers.items()
                               if k.lower() in ("content-type", "location", "cache-control")}
                return web.Response(body=body, status=upstream.status, headers=out_headers)
        except aiohttp.ClientError as exc:
            return json_response(status_body(503, "ServiceUnavailable", f"error trying to reach service: {exc}"), 503)

    async def _relay_websocket(self, request: web.Request, url: str, headers: dict) -> web.StreamResponse:
        if self.refuse_upgrades:
            return json_response(status_body(400, "BadRequest", "Upgrade request required"), 400)
        assert self._session is not None
        headers = {k: v for k, v in headers.items() if k.lower() not in _WEBSOCKET_HEADERS}
        try:
            upstream = await self._session.ws_connect(url, params=request.query, headers=headers, max_msg_size=0)
        except aiohttp.WSServerHandshakeError as exc:
            return web.Response(status=exc.status, text=exc.message)
        except aiohttp.ClientError as exc:
            return json_response(status_body(503, "ServiceUnavailable", f"error trying to reach service: {exc}"), 503)
        self.websockets += 1
        client = web.WebSocketResponse(max_msg_size=0)
        await client.prepare(request)

        async def to_client() -> None:
            async for message in upstream:
                if message.type == aiohttp.WSMsgType.TEXT:
                    self.bytes_forwarded += len(message.data.encode())
                    await client.send_str(message.data)
                elif message.type == aiohttp.WSMsgType.BINARY:
                    self.bytes_forwarded += len(message.data)
                    await client.send_bytes(message.data)
            await client.close()

        async def to_target() -> None:
            async for message in client:
                if message.type == aiohttp.WSMsgType.TEXT:
                    await upstream.send_str(message.data)
                elif message.type == aiohttp.WSMsgType.BINARY:
                    await upstream.send_bytes(message.data)
            await upstream.close()

        async with upstream:
            relays = [asyncio.ensure_future(to_client()), asyncio.ensure_future(to_target())]
            try:
                await asyncio.wait(relays, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for relay in relays:
                    relay.cancel()
                await asyncio.gather(*relays, return_exceptions=True)
                await client.close()
        return client
