"""A fault-injecting reverse proxy in front of the real kube-apiserver.

aiohttp, in a daemon thread with its own event loop. Upstream: TLS to the API server,
verified with the control plane's CA. Toward the client: TLS with a certificate of
its own CA (``trustme``; :attr:`FaultProxy.ca_pem` goes into the client's kubeconfig)
or plain HTTP (``tls=False``). Requests are streamed both ways, so watches work.

Faults match on method, a regex on the path and whether the request is a watch,
and apply to the next ``times`` matching requests, in the order they were added:

- ``answer``: answer ``status`` (a Kubernetes ``Status`` body, ``Retry-After`` if
  given) without forwarding;
- ``lose``: forward, then drop the real answer and send ``status`` instead (the
  change happened, the client does not know);
- ``cut``: forward and stream the answer, then abort the connection after the first
  chunk of the body (or after ``cut_after`` seconds): a watch cut mid-stream.

Every request is recorded (:class:`Seen`): method, path, query, whether it was a
watch, whether it was forwarded, the upstream status and the fault applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Not passed on: hop-by-hop headers, and what aiohttp recomputes (length, encoding).
_REQUEST_SKIP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}
_RESPONSE_SKIP = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


@dataclass
class Fault:
    action: str  # "answer", "lose" or "cut"
    method: str | None
    path: str
    watch: bool | None
    status: int = 503
    retry_after: int | None = None
    times: int = 1
    cut_after: float = 30.0
    used: int = 0

    def matches(self, method: str, path: str, watch: bool) -> bool:
        return (self.used < self.times and (self.method in (None, method)) and re.search(self.path, path) is not None
                and self.watch in (None, watch))


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    watch: bool
    forwarded: bool = False
    status: int | None = None  # upstream's answer, when forwarded
    fault: str | None = None
    at: float = field(default_factory=time.monotonic)


class FaultProxy:
    """``with FaultProxy(cp.server, cp.ca_path) as proxy: proxy.url, proxy.ca_pem, proxy.inject(...)``."""

    def __init__(self, upstream: str, upstream_ca: Path, *, tls: bool = True) -> None:
        self.upstream = upstream.rstrip("/")
        self.upstream_ca = Path(upstream_ca)
        self.tls = tls
        self.ca_pem: bytes | None = None
        self.port = 0
        self.requests: list[Seen] = []
        self.faults: list[Fault] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"fault proxy did not start: {self.errors}")
        if self.errors:
            raise RuntimeError(f"fault proxy did not start: {self.errors}")

    def stop(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(15)

    def _client_ssl(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        import trustme

        ca = trustme.CA()
        self.ca_pem = ca.cert_pem.bytes()
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1", "localhost").configure_cert(ctx)
        return ctx

    def _serve(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = session = None

        async def setup() -> None:
            nonlocal runner, session
            upstream_ssl = ssl.create_default_context(cafile=str(self.upstream_ca))
            session = self._session = ClientSession(connector=TCPConnector(ssl=upstream_ssl), auto_decompress=True,
                                                    timeout=ClientTimeout(total=None, sock_connect=10))
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", self._handle)
            runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=self._client_ssl())
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        try:
            loop.run_until_complete(setup())
        except Exception as exc:  # reported by start()
            self.errors.append(f"{type(exc).__name__}: {exc}")
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            with contextlib.suppress(Exception):
                loop.run_until_complete(runner.cleanup())
            with contextlib.suppress(Exception):
                loop.run_until_complete(session.close())
            loop.close()

    # -- faults and records ------------------------------------------------------------------------

    def inject(self, action: str, method: str | None, path: str, *, watch: bool | None = None, status: int = 503,
               retry_after: int | None = None, times: int = 1, cut_after: float = 30.0) -> None:
        if action not in ("answer", "lose", "cut"):
            raise ValueError(action)
        with self._lock:
            self.faults.append(Fault(action, method, path, watch, status, retry_after, times, cut_after))

    def seen(self, method: str | None = None, path: str = "", *, watch: bool | None = None,
             forwarded: bool | None = None) -> list[Seen]:
        with self._lock:
            return [r for r in self.requests if method in (None, r.method) and re.search(path, r.path)
                    and watch in (None, r.watch) and forwarded in (None, r.forwarded)]

    def wait_until(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """Return ``predicate()`` once truthy; re-checked on every request the proxy records."""
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"proxy: timed out after {timeout}s waiting for {what}; "
                                     f"saw {seen_summary(self.seen())}")
            with self._changed:
                self._changed.wait(min(left, 0.5))

    def _record(self, seen: Seen) -> Fault | None:
        with self._changed:
            self.requests.append(seen)
            fault = next((f for f in self.faults if f.matches(seen.method, seen.path, seen.watch)), None)
            if fault is not None:
                fault.used += 1
                seen.fault = fault.action if fault.action == "cut" else f"{fault.action} {fault.status}"
            self._changed.notify_all()
            return fault

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # -- the handler -------------------------------------------------------------------------------

    @staticmethod
    def _status(fault: Fault):
        from aiohttp import web

        reasons = {429: "TooManyRequests", 500: "InternalError", 502: "BadGateway", 503: "ServiceUnavailable",
                   504: "Timeout"}
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": f"injected by the fault proxy ({fault.action} {fault.status})",
                "reason": reasons.get(fault.status, "InternalError"), "code": fault.status}
        headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
        return web.json_response(body, status=fault.status, headers=headers)

    async def _handle(self, request):
        from aiohttp import web

        body = await request.read()
        query = dict(request.query)
        seen = Seen(request.method, request.path, query, query.get("watch", "").lower() in ("true", "1"))
        fault = self._record(seen)
        if fault is not None and fault.action == "answer":
            return self._status(fault)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _REQUEST_SKIP}
        try:
            async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                             data=body or None, allow_redirects=False) as upstream:
                seen.forwarded, seen.status = True, upstream.status
                self._notify()
                if fault is not None and fault.action == "lose":
                    await upstream.read()
                    return self._status(fault)
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers={
                    k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_SKIP})
                await response.prepare(request)
                if fault is not None and fault.action == "cut":
                    with contextlib.suppress(asyncio.TimeoutError):
                        chunk = await asyncio.wait_for(upstream.content.readany(), fault.cut_after)
                        await response.write(chunk)
                        await asyncio.sleep(0.5)  # give the client a moment to read it
                    request.transport.abort()
                    # aiohttp ends a handler that raises CancelledError quietly (as a client
                    # disconnection); returning would make it try to finish the response.
                    raise asyncio.CancelledError
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (ConnectionResetError, asyncio.CancelledError):  # the client went away (e.g. a closed watch)
            raise
        except Exception as exc:
            self.errors.append(f"{request.method} {request.path_qs}: {type(exc).__name__}: {exc}")
            raise


def seen_summary(requests: list[Seen]) -> str:
    return json.dumps([(r.method, r.path, r.query.get("resourceVersion"), r.watch, r.forwarded, r.status, r.fault)
                       for r in requests])
