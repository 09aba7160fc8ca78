"""A small, stateful fake Kubernetes API server over real HTTP.

Tests talk to it with the official clients (``kubernetes`` and ``kubernetes_asyncio``) configured
from :meth:`FakeKubeApiServer.kubeconfig_dict`. It is faithful where our code depends on it:
Status bodies and messages of the real API server, resourceVersion/uid/generation bookkeeping,
the status subresource, merge/JSON patch (a JSON *object* sent as a JSON patch is rejected with
400 as a real server does), optimistic concurrency, finalizers, label/field selectors, and watches
with resume, 410 Expired after compaction, bookmarks and timeouts. Fault injection (HTTP errors,
connection resets, cut watch streams, latency) and a request log make retry and load tests easy.

This module holds the server's lifecycle (its event loop thread, the listening socket, TLS) and
its public API; each concern behind it has a module of its own (see README.md): ``_registry``
(API semantics) over ``_store`` (objects, resourceVersions), ``_watches`` (history, watch streams,
``on_change``), ``_faults``, ``_proxy`` (service proxy), ``_handler`` (HTTP routing), ``_routing``
(paths, verbs, request log), ``_discovery``, ``_defaults`` (core defaults, CRD schemas), ``_errors``.
The fault-injection and state parts of the public API are the mixins ``_fault_api.FaultApi`` and
``_state_api.StateApi``.

Threading: the aiohttp app runs on its own event loop in a background thread. Objects, history and
watches sit behind one re-entrant lock, so the test helpers (``put_object``, ``set_status``,
``inject``...) may be called from any thread. Change callbacks (``on_change``) run on the server's
loop, in commit order; :class:`tests.support.fake_apiserver.kuberay.KubeRayReactor` relies on that.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import json
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from ._discovery import KUBERNETES_GIT_VERSION
from ._errors import ApiError
from ._fault_api import FaultApi
from ._faults import FaultInjector
from ._handler import ApiHandler
from ._proxy import ServiceProxy
from ._registry import Registry
from ._resources import RESOURCE_TYPES, ResourceType, now_rfc3339, resolve_resource
from ._routing import LoggedRequest, RequestLog
from ._state_api import StateApi
from ._store import ObjectStore
from ._watches import ChangeEvent, ChangeFeed

# Structural schemas of the KubeRay v1.7.0 CRDs kept in this repo (tests/support/schemas/make_structural.py):
# pass as ``FakeKubeApiServer(crd_dir=KUBERAY_SCHEMAS)`` for CRD defaulting and pruning.
KUBERAY_SCHEMAS = str(Path(__file__).resolve().parents[1] / "schemas" / "v1.7.0")

__all__ = [
    "ApiError",
    "ChangeEvent",
    "FakeKubeApiServer",
    "KUBERAY_SCHEMAS",
    "KUBERNETES_GIT_VERSION",
    "LoggedRequest",
    "RESOURCE_TYPES",
    "ResourceType",
    "now_rfc3339",
    "resolve_resource",
]


class FakeKubeApiServer(FaultApi, StateApi):
    """A fake Kubernetes API server on 127.0.0.1 (plain HTTP, or HTTPS with ``tls``; bearer token auth).

    :param history_limit: how many change events are kept for watch resume; older
        resourceVersions get ``410 Expired``.
    :param bookmark_interval: seconds between BOOKMARK events on watches that asked for them
        (``allowWatchBookmarks=true``); None disables bookmarks.
    :param crd_dir: a directory of CustomResourceDefinition YAML files or of ``<plural>.json``
        structural schemas (e.g. :data:`KUBERAY_SCHEMAS`); when given, custom resources are
        defaulted and pruned with their schemas like a real server does (unknown fields dropped
        with a ``Warning`` header, or 400 with ``fieldValidation=Strict``). No type validation.
    :param user: the user name in Forbidden messages.
    :param tls: serve HTTPS with a certificate of a fresh CA (``trustme``); see :attr:`ca_pem`.
    """

    def __init__(self, *, history_limit: int = 1000, bookmark_interval: float | None = None,
                 crd_dir: str | None = None, user: str = "system:serviceaccount:default:fakekube",
                 tls: bool = False):
        self._ca = None
        if tls:
            import trustme

            self._ca = trustme.CA()
        schemas: dict = {}
        if crd_dir is not None:
            from ._schema import load_crd_schemas

            schemas = load_crd_schemas(str(crd_dir))
        self._feed = ChangeFeed(threading.RLock(), history_limit, bookmark_interval)
        self._registry = Registry(ObjectStore(self._feed), schemas)
        self._faults = FaultInjector(user)
        self._proxy = ServiceProxy(self._registry.store, self._faults)
        self._log = RequestLog()
        self._handler = ApiHandler(self._registry, self._feed, self._faults, self._proxy, self._log)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._connections_opened = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FakeKubeApiServer:
        if self._thread is not None:
            return self
        self._loop = asyncio.new_event_loop()
        self._feed.loop = self._loop
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._astart())
            except BaseException as exc:  # pragma: no cover - startup failure
                failure.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

        self._thread = threading.Thread(target=run, name="fakekube-apiserver", daemon=True)
        self._thread.start()
        started.wait(10)
        if failure:
            raise failure[0]
        return self

    async def _astart(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handler.handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        server = self._runner.server
        assert server is not None
        made = server.connection_made

        def counted(handler: Any, transport: Any) -> None:
            self._connections_opened += 1
            made(handler, transport)

        server.connection_made = counted  # type: ignore[method-assign]
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self._port = self._handler.port = sock.getsockname()[1]
        ssl_context = None
        if self._ca is not None:
            import ssl

            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            self._ca.issue_cert("127.0.0.1", "localhost").configure_cert(ssl_context)
        site = web.SockSite(self._runner, sock, ssl_context=ssl_context)
        await site.start()

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return

        async def shutdown() -> None:
            self._feed.end_all()
            await asyncio.sleep(0)
            await self._proxy.close()
            if self._runner is not None:
                await self._runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> FakeKubeApiServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "server not started"
        return self._loop

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def call_soon(self, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)`` on the server's event loop (thread-safe)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def call_later(self, delay: float, fn: Callable, *args: Any) -> asyncio.TimerHandle | None:
        """Schedule ``fn(*args)`` on the server loop after ``delay`` s (must be called on the loop)."""
        return self.loop.call_later(delay, fn, *args)

    # -- connection details ------------------------------------------------------------------

    @property
    def port(self) -> int:
        assert self._port is not None, "server not started"
        return self._port

    @property
    def url(self) -> str:
        return f"{'https' if self._ca else 'http'}://127.0.0.1:{self.port}"

    @property
    def ca_pem(self) -> bytes:
        """The CA certificate (PEM) that signed the server's certificate, when started with ``tls=True``."""
        assert self._ca is not None, "server not started with tls=True"
        return self._ca.cert_pem.bytes()

    @property
    def token(self) -> str:
        return self._handler.token

    @property
    def user(self) -> str:
        return self._faults.user

    def accept_token(self, token: str) -> None:
        """Also accept ``token`` as a bearer token (e.g. one issued by a test OAuth server)."""
        self._handler.accept_token(token)

    def rotate_token(self) -> str:
        """Issue a new bearer token and reject the old one from now on (401, as for an expired token);
        :meth:`kubeconfig_dict` and :meth:`airflow_connection` carry the new one. Returns it."""
        import secrets

        self._handler.token = secrets.token_urlsafe(24)
        return self._handler.token

    # -- connections -------------------------------------------------------------------------

    @property
    def open_connections(self) -> int:
        """TCP connections from clients open now."""
        server = self._runner.server if self._runner is not None else None
        return len(server.connections) if server is not None else 0

    @property
    def connections_opened(self) -> int:
        """TCP connections clients opened since the server started."""
        return self._connections_opened

    @property
    def proxy(self) -> ServiceProxy:
        """The service proxy (``bytes_forwarded``, ``websockets``, ``refuse_upgrades``)."""
        return self._proxy

    def kubeconfig_dict(self, namespace: str = "default", *, context: str = "fakekube") -> dict:
        """A kubeconfig (as a dict) for ``kubernetes.config.load_kube_config_from_dict`` and friends."""
        ca = {"certificate-authority-data": base64.b64encode(self.ca_pem).decode()} if self._ca else {}
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": context, "cluster": {"server": self.url, **ca}}],
            "users": [{"name": context, "user": {"token": self.token}}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": context, "namespace": namespace}}],
            "current-context": context,
            "preferences": {},
        }

    def airflow_connection(self, namespace: str = "default") -> str:
        """A cncf-kubernetes Airflow connection (JSON, for an ``AIRFLOW_CONN_<ID>`` env var) whose
        ``kube_config`` extra points at this server."""
        return json.dumps({"conn_type": "kubernetes",
                           "extra": {"kube_config": json.dumps(self.kubeconfig_dict(namespace)),
                                     "namespace": namespace}})

    def write_kubeconfig(self, path: Any, namespace: str = "default") -> str:
        """Write :meth:`kubeconfig_dict` to ``path`` (JSON is valid YAML); returns the path."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.kubeconfig_dict(namespace), fh, indent=2)
        return str(path)

    # -- request log -------------------------------------------------------------------------

    @property
    def requests(self) -> list[LoggedRequest]:
        return self._log.requests

    @property
    def counters(self) -> collections.Counter:
        """Requests per Kubernetes verb ("get", "list", "watch", "patch", ...)."""
        return self._log.counters

    def count(self, method: str | None = None, path_regex: str | None = None, *, watch: bool | None = None,
              verb: str | None = None) -> int:
        """How many logged requests match ``method``, ``path_regex`` (``re.search``), ``watch`` and ``verb``."""
        return self._log.count(method, path_regex, watch=watch, verb=verb)

    def clear_log(self) -> None:
        self._log.clear()
