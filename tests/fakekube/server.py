"""A small, stateful fake Kubernetes API server over real HTTP.

Tests talk to it with the official clients (``kubernetes`` and ``kubernetes_asyncio``) configured
from :meth:`FakeKubeApiServer.kubeconfig_dict`. It is faithful where our code depends on it:
Status bodies and messages of the real API server, resourceVersion/uid/generation bookkeeping,
the status subresource, merge/JSON patch (a JSON *object* sent as a JSON patch is rejected with
400 as a real server does), optimistic concurrency, finalizers, label/field selectors, and watches
with resume, 410 Expired after compaction, bookmarks and timeouts. Fault injection (HTTP errors,
connection resets, cut watch streams, latency) and a request log make retry and load tests easy.

Threading: the aiohttp app runs on its own event loop in a background thread. All state sits
behind one re-entrant lock, so the test helpers (``put_object``, ``set_status``, ``inject``...)
may be called from any thread. Change callbacks (``on_change``) run on the server's loop, in
commit order; :class:`tests.fakekube.kuberay.KubeRayReactor` relies on that.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import copy
import datetime as _dt
import json
import logging
import math
import random
import re
import secrets as _secrets
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from aiohttp import web

from ._patching import PatchDecodeError, PatchError, json_patch, merge_patch
from ._selectors import (
    SelectorError,
    fields_match,
    labels_match,
    parse_field_selector,
    parse_label_selector,
)

log = logging.getLogger(__name__)

KUBERNETES_GIT_VERSION = "v1.37.2"
# Structural schemas of the KubeRay v1.7.0 CRDs kept in this repo (tests/schemas/make_structural.py):
# pass as ``FakeKubeApiServer(crd_dir=KUBERAY_SCHEMAS)`` for CRD defaulting and pruning.
KUBERAY_SCHEMAS = str(Path(__file__).resolve().parents[1] / "schemas" / "v1.7.0")

__all__ = [
    "ApiError",
    "ChangeEvent",
    "FakeKubeApiServer",
    "KUBERAY_SCHEMAS",
    "LoggedRequest",
    "RESOURCE_TYPES",
    "ResourceType",
    "now_rfc3339",
]


def now_rfc3339() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------------------------------
# Resource types
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    singular: str
    status_subresource: bool = False
    tracks_generation: bool = False
    # Custom resources refuse an update (PUT) without metadata.resourceVersion.
    unconditional_update: bool = True
    # Core registries answer DELETE with the object, custom resources with a Status.
    return_deleted_object: bool = True
    short_names: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def custom(self) -> bool:
        return self.group not in ("",)

    @property
    def qualified(self) -> str:
        """How the real server names the resource in messages: ``rayclusters.ray.io``, ``pods``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind

    def details(self, name: str | None = None, **extra: Any) -> dict:
        d: dict[str, Any] = {}
        if name is not None:
            d["name"] = name
        if self.group:
            d["group"] = self.group
        d["kind"] = self.plural
        d.update(extra)
        return d


def _ray(plural: str, kind: str, short: tuple[str, ...] = ()) -> ResourceType:
    return ResourceType(
        "ray.io", "v1", plural, kind, kind.lower(),
        status_subresource=True, tracks_generation=True,
        unconditional_update=False, return_deleted_object=False, short_names=short,
    )


RESOURCE_TYPES: tuple[ResourceType, ...] = (
    _ray("rayclusters", "RayCluster"),
    _ray("rayservices", "RayService"),
    _ray("rayjobs", "RayJob"),
    ResourceType("", "v1", "pods", "Pod", "pod", status_subresource=True, tracks_generation=True, short_names=("po",)),
    ResourceType("", "v1", "events", "Event", "event", short_names=("ev",)),
    ResourceType("", "v1", "services", "Service", "service", status_subresource=True, short_names=("svc",),
                 verbs=("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")),
    ResourceType("", "v1", "secrets", "Secret", "secret"),
    ResourceType("", "v1", "configmaps", "ConfigMap", "configmap", short_names=("cm",)),
)

_BY_GVR = {(r.group, r.version, r.plural): r for r in RESOURCE_TYPES}
_BY_PLURAL = {r.plural: r for r in RESOURCE_TYPES}


def resolve_resource(spec: str | ResourceType) -> ResourceType:
    """``"rayclusters"``, ``"ray.io/v1/rayclusters"``, ``"v1/pods"`` or ``"pods"`` -> ResourceType."""
    if isinstance(spec, ResourceType):
        return spec
    parts = spec.strip("/").split("/")
    if len(parts) == 1 and parts[0] in _BY_PLURAL:
        return _BY_PLURAL[parts[0]]
    if len(parts) == 2 and ("", parts[0], parts[1]) in _BY_GVR:
        return _BY_GVR[("", parts[0], parts[1])]
    if len(parts) == 3 and (parts[0], parts[1], parts[2]) in _BY_GVR:
        return _BY_GVR[(parts[0], parts[1], parts[2])]
    raise KeyError(f"unknown resource {spec!r}")


# ------------------------------------------------------------------------------------------------
# Errors (Status bodies)
# ------------------------------------------------------------------------------------------------

class ApiError(Exception):
    """An API error answered as a ``Status`` body, exactly as the real server shapes it."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def body(self) -> dict:
        return status_body(self.code, self.reason, self.message, self.details)

    @classmethod
    def not_found(cls, res: ResourceType, name: str) -> "ApiError":
        return cls(404, "NotFound", f'{res.qualified} "{name}" not found', res.details(name))

    @classmethod
    def already_exists(cls, res: ResourceType, name: str) -> "ApiError":
        return cls(409, "AlreadyExists", f'{res.qualified} "{name}" already exists', res.details(name))

    @classmethod
    def conflict(cls, res: ResourceType, name: str, why: str | None = None) -> "ApiError":
        why = why or "the object has been modified; please apply your changes to the latest version and try again"
        return cls(409, "Conflict", f'Operation cannot be fulfilled on {res.qualified} "{name}": {why}',
                   res.details(name))

    @classmethod
    def forbidden(cls, res: ResourceType | None, verb: str, namespace: str | None, name: str | None,
                  user: str, subresource: str | None = None) -> "ApiError":
        plural = res.plural if res else ""
        group = res.group if res else ""
        qualified = f"{plural}.{group}" if group else plural
        resource = f"{plural}/{subresource}" if subresource else plural
        subject = f'{qualified} "{name}"' if name else qualified
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        msg = (f'{subject} is forbidden: User "{user}" cannot {verb} resource "{resource}" '
               f'in API group "{group}" {scope}')
        details: dict[str, Any] = {}
        if name:
            details["name"] = name
        if group:
            details["group"] = group
        details["kind"] = plural
        return cls(403, "Forbidden", msg, details)

    @classmethod
    def invalid(cls, res: ResourceType, name: str, causes: list[tuple[str, str, str]]) -> "ApiError":
        """``causes``: (reason, field, message) like ("FieldValueRequired", "metadata.name", "Required value: ...")."""
        text = ", ".join(f"{f}: {m}" for _, f, m in causes)
        if len(causes) > 1:
            text = f"[{text}]"
        details = {"name": name}
        if res.group:
            details["group"] = res.group
        details["kind"] = res.kind
        details["causes"] = [{"reason": r, "message": m, "field": f} for r, f, m in causes]
        return cls(422, "Invalid", f'{res.qualified_kind} "{name}" is invalid: {text}', details)

    @classmethod
    def bad_request(cls, message: str) -> "ApiError":
        return cls(400, "BadRequest", message)

    @classmethod
    def unprocessable(cls, server_message: str) -> "ApiError":
        return cls(422, "Invalid", "the server rejected our request due to an error in our request",
                   {"causes": [{"reason": "UnexpectedServerResponse", "message": server_message}]})

    @classmethod
    def unsupported_media_type(cls, content_type: str, res: ResourceType | None) -> "ApiError":
        accepted = ["application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml"]
        if res is not None and not res.custom:
            accepted.insert(2, "application/strategic-merge-patch+json")
        return cls(415, "UnsupportedMediaType",
                   "the body of the request was in an unknown format - accepted media types include: "
                   + ", ".join(accepted))

    @classmethod
    def not_found_path(cls) -> "ApiError":
        return cls(404, "NotFound", "the server could not find the requested resource", {})

    @classmethod
    def method_not_allowed(cls) -> "ApiError":
        return cls(405, "MethodNotAllowed", "the server does not allow this method on the requested resource", {})


def status_body(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": message, "reason": reason}
    if details is not None:
        body["details"] = details
    body["code"] = code
    return body


_GENERIC_STATUS = {
    400: ("BadRequest", "the server rejected our request for an unknown reason"),
    401: ("Unauthorized", "Unauthorized"),
    405: ("MethodNotAllowed", "the server does not allow this method on the requested resource"),
    406: ("NotAcceptable", "the server was unable to respond with a content type that the client supports"),
    410: ("Expired", "the server could not find the requested resource"),
    413: ("RequestEntityTooLarge", "the server has received a request that is too large"),
    415: ("UnsupportedMediaType", "the server was unable to respond with a content type that the client supports"),
    422: ("Invalid", "the server rejected our request due to an error in our request"),
    429: ("TooManyRequests", "Too many requests, please try again later."),
    500: ("InternalError", "Internal error occurred: injected fault"),
    502: ("InternalError", "an error on the server (\"\") has prevented the request from succeeding"),
    503: ("ServiceUnavailable", "the server is currently unable to handle the request"),
    504: ("Timeout", "Timeout: request did not complete within requested timeout - context deadline exceeded"),
}


# ------------------------------------------------------------------------------------------------
# Routing
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Route:
    kind: str  # "api", "apis", "group", "resources", "version", "health", "collection", "object",
    #           "namespaces", "namespace", "proxy", "unknown"
    res: ResourceType | None = None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None
    group: str = ""
    version: str = ""
    proxy_rest: str = ""


def _parse_path(path: str) -> _Route:
    if path in ("/version", "/version/"):
        return _Route("version")
    if path.rstrip("/") in ("/healthz", "/readyz", "/livez") or path.startswith(("/healthz/", "/readyz/", "/livez/")):
        return _Route("health")
    parts = [p for p in path.split("/") if p != ""]
    if not parts:
        return _Route("unknown")
    if parts[0] == "api":
        if len(parts) == 1:
            return _Route("api")
        group, version, rest = "", parts[1], parts[2:]
    elif parts[0] == "apis":
        if len(parts) == 1:
            return _Route("apis")
        if len(parts) == 2:
            return _Route("group", group=parts[1])
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return _Route("unknown")
    if not any(r.group == group and r.version == version for r in RESOURCE_TYPES):
        return _Route("unknown")
    if not rest:
        return _Route("resources", group=group, version=version)
    if rest[0] == "namespaces":
        if len(rest) == 1:
            return _Route("namespaces", group=group, version=version) if not group else _Route("unknown")
        ns = rest[1]
        if len(rest) == 2:
            return _Route("namespace", namespace=ns, group=group, version=version) if not group else _Route("unknown")
        res = _BY_GVR.get((group, version, rest[2]))
        if res is None:
            return _Route("unknown")
        if len(rest) == 3:
            return _Route("collection", res=res, namespace=ns, group=group, version=version)
        name = rest[3]
        if len(rest) == 4:
            return _Route("object", res=res, namespace=ns, name=name, group=group, version=version)
        if res.plural == "services" and rest[4] == "proxy":
            return _Route("proxy", res=res, namespace=ns, name=name, subresource="proxy",
                          proxy_rest="/".join(rest[5:]) + ("/" if path.endswith("/") and len(rest) > 5 else ""),
                          group=group, version=version)
        if len(rest) == 5:
            return _Route("object", res=res, namespace=ns, name=name, subresource=rest[4], group=group, version=version)
        return _Route("unknown")
    res = _BY_GVR.get((group, version, rest[0]))
    if res is not None and len(rest) == 1:
        return _Route("collection", res=res, namespace=None, group=group, version=version)
    return _Route("unknown")


def _verb_of(method: str, route: _Route, watch: bool) -> str:
    if route.kind == "proxy":
        return "proxy"
    if route.kind == "collection":
        return {"GET": "watch" if watch else "list", "POST": "create", "DELETE": "deletecollection"}.get(method, method.lower())
    if route.kind == "object":
        return {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())
    if route.kind in ("namespaces",):
        return "watch" if watch else "list"
    return "get" if method == "GET" else method.lower()


class LoggedRequest(NamedTuple):
    """One request the server received: ``(method, path, query, watch)``."""

    method: str
    path: str
    query: dict
    watch: bool

    @property
    def verb(self) -> str:
        """Kubernetes verb: get, list, watch, create, update, patch, delete, deletecollection, proxy..."""
        return _verb_of(self.method, _parse_path(self.path), self.watch)

    @property
    def resource(self) -> str | None:
        route = _parse_path(self.path)
        if route.res is None:
            return None
        return f"{route.res.plural}/{route.subresource}" if route.subresource else route.res.plural


@dataclass(frozen=True)
class ChangeEvent:
    """A committed change, as seen by watches and ``on_change`` callbacks."""

    type: str  # ADDED, MODIFIED, DELETED
    resource: ResourceType
    namespace: str
    name: str
    object: dict
    old_object: dict | None
    resource_version: int

    @property
    def plural(self) -> str:
        return self.resource.plural


@dataclass
class _Fault:
    method: str | None
    regex: re.Pattern
    status: int | None
    times: int | None
    retry_after: float | int | None = None
    body: Any = None
    message: str | None = None
    reset: bool = False
    watch: bool | None = None

    def matches(self, method: str, path: str, watch: bool) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.method not in (None, "*") and self.method.upper() != method:
            return False
        if self.watch is not None and self.watch != watch:
            return False
        return self.regex.search(path) is not None


@dataclass
class _Denial:
    verb: str
    plural: str
    namespace: str | None
    times: int | None


class _Watch:
    """One open watch stream (state lives on the server loop)."""

    def __init__(self, server: "FakeKubeApiServer", res: ResourceType, namespace: str | None,
                 label_reqs, field_reqs, start_rv: int, request: web.Request):
        self.server = server
        self.res = res
        self.namespace = namespace
        self.label_reqs = label_reqs
        self.field_reqs = field_reqs
        self.start_rv = start_rv
        self.progress_rv = start_rv
        self.request = request
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cut = False

    def _selected(self, obj: dict | None) -> bool:
        if obj is None:
            return False
        if self.namespace is not None and obj.get("metadata", {}).get("namespace") != self.namespace:
            return False
        return labels_match(self.label_reqs, obj) and fields_match(self.field_reqs, obj)

    def translate(self, ev: ChangeEvent) -> tuple[str, dict] | None:
        if ev.resource is not self.res:
            return None
        now = self._selected(ev.object)
        if ev.type == "ADDED":
            return ("ADDED", ev.object) if now else None
        if ev.type == "DELETED":
            return ("DELETED", ev.object) if now else None
        before = self._selected(ev.old_object)
        if now and before:
            return ("MODIFIED", ev.object)
        if now:
            return ("ADDED", ev.object)
        if before:
            return ("DELETED", ev.object)
        return None

    def offer(self, ev: ChangeEvent) -> None:
        if ev.resource_version <= self.start_rv:
            return
        self.progress_rv = ev.resource_version
        item = self.translate(ev)
        if item is not None:
            self.queue.put_nowait(item)

    def stop(self, cut: bool) -> None:
        self.cut = cut
        self.queue.put_nowait(("__cut__" if cut else "__stop__", None))


def _dns_subdomain_error(name: str) -> str | None:
    if len(name) > 253:
        return "must be no more than 253 characters"
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", name):
        return ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
                "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
    return None


_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand
_SYSTEM_META = ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp",
                "deletionGracePeriodSeconds", "generation", "selfLink")


def _qos_class(pod: dict) -> str:
    containers = (pod.get("spec") or {}).get("containers") or []
    any_set, guaranteed = False, bool(containers)
    for c in containers:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        if req or lim:
            any_set = True
        for key in ("cpu", "memory"):
            limit = lim.get(key)
            if limit is None or str(req.get(key, limit)) != str(limit):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


# ------------------------------------------------------------------------------------------------
# The server
# ------------------------------------------------------------------------------------------------

class FakeKubeApiServer:
    """A fake Kubernetes API server on 127.0.0.1 (plain HTTP, bearer token auth).

    :param history_limit: how many change events are kept for watch resume; older
        resourceVersions get ``410 Expired``.
    :param bookmark_interval: seconds between BOOKMARK events on watches that asked for them
        (``allowWatchBookmarks=true``); None disables bookmarks.
    :param crd_dir: a directory of CustomResourceDefinition YAML files or of ``<plural>.json``
        structural schemas (e.g. :data:`KUBERAY_SCHEMAS`); when given, custom resources are
        defaulted and pruned with their schemas like a real server does (unknown fields dropped
        with a ``Warning`` header, or 400 with ``fieldValidation=Strict``). No type validation.
    :param user: the user name in Forbidden messages.
    """

    def __init__(self, *, history_limit: int = 1000, bookmark_interval: float | None = None,
                 crd_dir: str | None = None, user: str = "system:serviceaccount:default:fakekube",
                 tls: bool = False):
        self.history_limit = history_limit
        self._ca = None
        if tls:
            import trustme

            self._ca = trustme.CA()
        self._extra_tokens: set[str] = set()
        self.bookmark_interval = bookmark_interval
        self.user = user
        self._schemas: dict = {}
        if crd_dir is not None:
            from ._schema import load_crd_schemas

            self._schemas = load_crd_schemas(str(crd_dir))
        self._token = _secrets.token_urlsafe(24)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._rv = 1  # like a fresh etcd: the first write gets 2
        self._commits = 0
        self._store: dict[ResourceType, dict[tuple[str, str], dict]] = {r: {} for r in RESOURCE_TYPES}
        self._history: collections.deque[ChangeEvent] = collections.deque()
        self._compacted_rv = 0
        self._callbacks: list[Callable[[ChangeEvent], None]] = []
        self._watches: set[_Watch] = set()
        self._faults: list[_Fault] = []
        self._denials: list[_Denial] = []
        self._latency = 0.0
        self._log: list[LoggedRequest] = []
        self._counters: collections.Counter = collections.Counter()
        self._proxies: dict[tuple[str, str, str], Any] = {}
        self._ip_counter = 10
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._client_session = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "FakeKubeApiServer":
        if self._thread is not None:
            return self
        self._loop = asyncio.new_event_loop()
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
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self._port = sock.getsockname()[1]
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
            with self._lock:
                watches = list(self._watches)
            for w in watches:
                w.stop(False)
            await asyncio.sleep(0)
            if self._client_session is not None:
                await self._client_session.close()
            if self._runner is not None:
                await self._runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> "FakeKubeApiServer":
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

    def accept_token(self, token: str) -> None:
        """Also accept ``token`` as a bearer token (e.g. one issued by a test OAuth server)."""
        with self._lock:
            self._extra_tokens.add(token)

    @property
    def token(self) -> str:
        return self._token

    def kubeconfig_dict(self, namespace: str = "default", *, context: str = "fakekube") -> dict:
        """A kubeconfig (as a dict) for ``kubernetes.config.load_kube_config_from_dict`` and friends."""
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": context, "cluster": {"server": self.url, **self._ca_data()}}],
            "users": [{"name": context, "user": {"token": self.token}}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": context, "namespace": namespace}}],
            "current-context": context,
            "preferences": {},
        }

    def _ca_data(self) -> dict:
        if self._ca is None:
            return {}
        import base64

        return {"certificate-authority-data": base64.b64encode(self.ca_pem).decode()}

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

    # -- fault injection ---------------------------------------------------------------------

    def inject(self, method: str | None, path_regex: str, status: int, *, times: int | None = 1,
               retry_after: float | int | None = None, body: Any = None, message: str | None = None,
               watch: bool | None = None) -> None:
        """Answer the next ``times`` requests matching ``method`` (None/"*" = any) and ``path_regex``
        (``re.search`` on the URL path) with ``status`` and a Status body (or ``body``: dict -> JSON,
        str/bytes verbatim). 429 always carries ``Retry-After`` (default 1; integer seconds).
        ``times=None``: forever. ``watch`` restricts to watch (True) or non-watch (False) requests.

        Note: urllib3 (the sync client) itself retries GET/PUT/DELETE answered 413/429/503 *with*
        a Retry-After header (up to 3 times, sleeping Retry-After), like it would against a real
        server; aiohttp (kubernetes_asyncio) does not."""
        if status == 429 and retry_after is None:
            retry_after = 1
        with self._lock:
            self._faults.append(_Fault(method, re.compile(path_regex), status, times, retry_after, body,
                                       message, watch=watch))

    def reset_connection(self, method: str | None, path_regex: str, times: int | None = 1, *,
                         watch: bool | None = None) -> None:
        """Close the TCP connection (RST) of the next ``times`` matching requests without a response.

        Note: urllib3 (the sync client) retries idempotent methods (GET, PUT, DELETE) up to 3 times
        on a reset, so a single reset of a GET is invisible to it."""
        with self._lock:
            self._faults.append(_Fault(method, re.compile(path_regex), None, times, reset=True, watch=watch))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            self._denials.clear()
            self._latency = 0.0

    def latency(self, seconds: float) -> None:
        """Delay every request by ``seconds`` before it is answered (0 disables)."""
        self._latency = float(seconds)

    def deny(self, verb: str, resource: str, namespace: str | None = None, *, times: int | None = None) -> None:
        """RBAC-style denial: matching requests get 403 Forbidden with the real server's message.
        ``verb``: get/list/watch/create/update/patch/delete/deletecollection or "*"; ``resource``:
        a plural, optionally with a subresource ("rayclusters/status")."""
        with self._lock:
            self._denials.append(_Denial(verb, resource, namespace, times))

    def cut_watches(self) -> int:
        """Abruptly close every open watch stream mid-stream (no terminating chunk); returns how many."""
        with self._lock:
            watches = list(self._watches)
        if self._loop is not None:
            for w in watches:
                self._loop.call_soon_threadsafe(w.stop, True)
        return len(watches)

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    # -- request log -------------------------------------------------------------------------

    @property
    def requests(self) -> list[LoggedRequest]:
        with self._lock:
            return list(self._log)

    @property
    def counters(self) -> collections.Counter:
        """Requests per Kubernetes verb ("get", "list", "watch", "patch", ...)."""
        with self._lock:
            return collections.Counter(self._counters)

    def count(self, method: str | None = None, path_regex: str | None = None, *, watch: bool | None = None,
              verb: str | None = None) -> int:
        rx = re.compile(path_regex) if path_regex else None
        return sum(
            1 for r in self.requests
            if (method is None or r.method == method.upper())
            and (rx is None or rx.search(r.path))
            and (watch is None or r.watch == watch)
            and (verb is None or r.verb == verb)
        )

    def clear_log(self) -> None:
        with self._lock:
            self._log.clear()
            self._counters.clear()

    # -- change subscription -----------------------------------------------------------------

    def on_change(self, callback: Callable[[ChangeEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` on the server loop after every committed change, in order.
        Returns a function that unsubscribes."""
        with self._lock:
            self._callbacks.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return unsubscribe

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Block until ``predicate()`` is truthy (re-checked after every commit and every watch
        opened/closed, at the latest every 0.5 s; never spins).
        The predicate runs without the server lock, so it may use an API client. Returns its value;
        raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                seen = self._commits
            value = predicate()
            if value:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"condition not met within {timeout} s")
            with self._cond:
                if self._commits == seen:
                    self._cond.wait(min(remaining, 0.5))

    # -- state helpers (thread-safe, go through the same event path as API writes) ------------

    @property
    def resource_version(self) -> str:
        with self._lock:
            return str(self._rv)

    def get_object(self, resource: str | ResourceType, namespace: str, name: str) -> dict | None:
        res = resolve_resource(resource)
        with self._lock:
            obj = self._store[res].get((namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list_objects(self, resource: str | ResourceType, namespace: str | None = None, *,
                     label_selector: str | dict | None = None, field_selector: str | None = None) -> list[dict]:
        res = resolve_resource(resource)
        if isinstance(label_selector, dict):
            label_selector = ",".join(f"{k}={v}" for k, v in label_selector.items())
        lreqs = parse_label_selector(label_selector)
        freqs = parse_field_selector(field_selector, res.plural, custom=res.custom)
        with self._lock:
            return [copy.deepcopy(o) for o in self._select(res, namespace, lreqs, freqs)]

    def put_object(self, obj: dict) -> dict:
        """Create or replace ``obj`` as given, status included (no API validation); emits ADDED or
        MODIFIED. uid/creationTimestamp of an existing object are kept; generation is bumped on a
        spec change."""
        res = self._resource_of(obj)
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        ns = meta.setdefault("namespace", "default")
        name = meta["name"]
        obj.setdefault("apiVersion", res.api_version)
        obj.setdefault("kind", res.kind)
        with self._lock:
            old = self._store[res].get((ns, name))
            if old is None:
                for k in ("resourceVersion", "deletionTimestamp"):
                    meta.pop(k, None)
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", now_rfc3339())
                if res.tracks_generation:
                    meta["generation"] = meta.get("generation") or 1
                return copy.deepcopy(self._commit_create(res, obj))
            self._carry_system_meta(res, old, obj, keep_deletion=("deletionTimestamp" not in meta))
            result = self._commit_update(res, old, obj)
            return copy.deepcopy(result)

    def create_object(self, obj: dict, *, namespace: str | None = None) -> dict:
        """Create like ``POST`` does (validation, generateName, status reset); raises ApiError."""
        res = self._resource_of(obj)
        ns = namespace or (obj.get("metadata") or {}).get("namespace") or "default"
        created, _ = self._create(res, ns, obj)
        return copy.deepcopy(created)

    def patch_object(self, resource: str | ResourceType, namespace: str, name: str, patch: dict, *,
                     subresource: str | None = None) -> dict:
        """Merge-patch like ``PATCH`` does (status ignored on the main resource); raises ApiError."""
        res = resolve_resource(resource)
        return copy.deepcopy(self._patch(res, namespace, name, patch, "application/merge-patch+json", subresource))

    def set_status(self, resource: str | ResourceType, namespace: str, name: str, status: dict | None) -> dict:
        """Replace ``.status`` through the status subresource path (watchers see MODIFIED)."""
        res = resolve_resource(resource)
        with self._lock:
            old = self._store[res].get((namespace, name))
            if old is None:
                raise ApiError.not_found(res, name)
            new = copy.deepcopy(old)
            if status is None:
                new.pop("status", None)
            else:
                new["status"] = copy.deepcopy(status)
            return copy.deepcopy(self._commit_update(res, old, new))

    def delete_object(self, resource: str | ResourceType, namespace: str, name: str, *,
                      force: bool = False) -> dict | None:
        """Delete like ``DELETE`` does (finalizers respected) or, with ``force``, remove at once.
        Returns the deleted/terminating object, or None if there was none."""
        res = resolve_resource(resource)
        with self._lock:
            old = self._store[res].get((namespace, name))
            if old is None:
                return None
            if force:
                return copy.deepcopy(self._commit_delete(res, old))
            obj, _ = self._delete(res, namespace, name, {})
            return copy.deepcopy(obj)

    def compact(self) -> None:
        """Drop the whole event history: any watch resuming from an older resourceVersion gets 410."""
        with self._lock:
            self._history.clear()
            self._compacted_rv = self._rv

    def register_service_proxy(self, namespace: str, service: str, port: str | int, target_url: str) -> None:
        """Serve ``/api/v1/namespaces/<ns>/services/<service>:<port>/proxy/...`` by forwarding to
        ``target_url`` (e.g. a local Ray dashboard). Without a registration the proxy answers 503
        ``no endpoints available for service``, like a service without ready endpoints."""
        with self._lock:
            self._proxies[(namespace, service, str(port))] = target_url.rstrip("/")

    # -- internals: storage ------------------------------------------------------------------

    def _resource_of(self, obj: dict) -> ResourceType:
        api_version, kind = obj.get("apiVersion", ""), obj.get("kind", "")
        for r in RESOURCE_TYPES:
            if r.kind == kind and (not api_version or r.api_version == api_version):
                return r
        raise KeyError(f"unknown object kind {api_version}/{kind}")

    def _select(self, res: ResourceType, namespace: str | None, lreqs, freqs) -> list[dict]:
        out = []
        for (ns, _name), obj in sorted(self._store[res].items()):
            if namespace is not None and ns != namespace:
                continue
            if labels_match(lreqs, obj) and fields_match(freqs, obj):
                out.append(obj)
        return out

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _emit(self, type_: str, res: ResourceType, obj: dict, old: dict | None) -> None:
        meta = obj["metadata"]
        ev = ChangeEvent(type_, res, meta.get("namespace", ""), meta["name"], obj, old, int(meta["resourceVersion"]))
        self._history.append(ev)
        while len(self._history) > self.history_limit:
            dropped = self._history.popleft()
            self._compacted_rv = max(self._compacted_rv, dropped.resource_version)
        self._changed()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._dispatch, ev)
            except RuntimeError:  # loop closing
                pass

    def _changed(self) -> None:
        """Wake :meth:`wait_for` callers (call with the lock held)."""
        self._commits += 1
        self._cond.notify_all()

    def _dispatch(self, ev: ChangeEvent) -> None:
        with self._lock:
            watches, callbacks = list(self._watches), list(self._callbacks)
        for w in watches:
            w.offer(ev)
        for cb in callbacks:
            try:
                cb(ev)
            except Exception:  # a broken subscriber must not break the server
                log.exception("fakekube on_change callback failed")

    def _commit_create(self, res: ResourceType, obj: dict) -> dict:
        meta = obj["metadata"]
        meta["resourceVersion"] = self._next_rv()
        self._store[res][(meta["namespace"], meta["name"])] = obj
        self._emit("ADDED", res, obj, None)
        return obj

    def _commit_update(self, res: ResourceType, old: dict, new: dict, *, bump_generation: bool = False) -> dict:
        """Store ``new`` over ``old`` (both complete objects); no-op if nothing changed; a
        terminating object whose finalizers are gone is deleted instead."""
        meta = new["metadata"]
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        if res.tracks_generation:
            meta["generation"] = old["metadata"].get("generation", 1)
            if bump_generation or self._spec_changed(old, new):
                meta["generation"] += 1
        ometa = old["metadata"]
        # registry.Store.shouldDeleteDuringUpdate: the last finalizer of a terminating object went
        if (ometa.get("finalizers") and not meta.get("finalizers") and ometa.get("deletionTimestamp")
                and not ometa.get("deletionGracePeriodSeconds")):
            meta.pop("finalizers", None)
            return self._commit_delete(res, new)
        if new == old:
            return old
        meta["resourceVersion"] = self._next_rv()
        self._store[res][(meta["namespace"], meta["name"])] = new
        self._emit("MODIFIED", res, new, old)
        return new

    def _commit_delete(self, res: ResourceType, obj: dict) -> dict:
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        self._store[res].pop(key, None)
        final = copy.copy(obj)
        final["metadata"] = dict(meta, resourceVersion=self._next_rv())
        self._emit("DELETED", res, final, obj)
        return final

    @staticmethod
    def _spec_changed(old: dict, new: dict) -> bool:
        strip = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
        return strip(old) != strip(new)

    @staticmethod
    def _carry_system_meta(res: ResourceType, old: dict, new: dict, *, keep_deletion: bool = True) -> None:
        ometa, nmeta = old["metadata"], new["metadata"]
        nmeta["name"], nmeta["namespace"] = ometa["name"], ometa["namespace"]
        for key in ("uid", "creationTimestamp"):
            nmeta[key] = ometa[key]
        if keep_deletion:
            for key in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                if key in ometa:
                    nmeta[key] = ometa[key]
                else:
                    nmeta.pop(key, None)
        nmeta.pop("selfLink", None)

    def _schema_for(self, res: ResourceType) -> dict | None:
        return self._schemas.get((res.group, res.version, res.plural))

    def _apply_schema(self, res: ResourceType, obj: dict, field_validation: str | None) -> list[str]:
        schema = self._schema_for(res)
        if schema is None:
            return []
        from ._schema import apply_defaults, prune

        dropped = prune(schema, obj, root=True)
        if dropped and (field_validation or "").lower() == "strict":
            raise ApiError.bad_request(
                "strict decoding error: " + ", ".join(f'unknown field "{p}"' for p in dropped))
        apply_defaults(schema, obj)
        return [f'unknown field "{p}"' for p in dropped] if (field_validation or "Warn").lower() == "warn" else []

    def _new_ip(self, prefix: str) -> str:
        self._ip_counter += 1
        return f"{prefix}.{self._ip_counter // 250}.{self._ip_counter % 250 + 2}"

    def _default_core(self, res: ResourceType, obj: dict) -> None:
        """The bits of core-type defaulting our code can observe."""
        spec = obj.get("spec")
        if res.plural == "pods":
            spec = obj.setdefault("spec", {})
            spec.setdefault("restartPolicy", "Always")
            spec.setdefault("schedulerName", "default-scheduler")
            spec.setdefault("dnsPolicy", "ClusterFirst")
            spec.setdefault("terminationGracePeriodSeconds", 30)
            spec.setdefault("serviceAccountName", "default")
            spec.setdefault("enableServiceLinks", True)
            for c in spec.get("containers") or []:
                c.setdefault("terminationMessagePath", "/dev/termination-log")
                c.setdefault("terminationMessagePolicy", "File")
                image = c.get("image", "")
                c.setdefault("imagePullPolicy", "Always" if image.endswith(":latest") or ":" not in image else "IfNotPresent")
                c.setdefault("resources", {})
            obj["status"] = {"phase": "Pending", "qosClass": _qos_class(obj)}
        elif res.plural == "services":
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            if not spec.get("clusterIP"):
                spec["clusterIP"] = self._new_ip("10.96")
            spec.setdefault("clusterIPs", [spec["clusterIP"]])
            spec.setdefault("sessionAffinity", "None")
            spec.setdefault("ipFamilies", ["IPv4"])
            spec.setdefault("ipFamilyPolicy", "SingleStack")
            spec.setdefault("internalTrafficPolicy", "Cluster")
            for p in spec.get("ports") or []:
                p.setdefault("protocol", "TCP")
                p.setdefault("targetPort", p.get("port"))
            obj["status"] = {"loadBalancer": {}}
        elif res.plural == "secrets":
            obj.setdefault("type", "Opaque")
            self._fold_string_data(obj)

    @staticmethod
    def _fold_string_data(obj: dict) -> None:
        string_data = obj.pop("stringData", None)
        if string_data:
            data = obj.setdefault("data", {})
            for k, v in string_data.items():
                data[k] = base64.b64encode(str(v).encode()).decode()

    # -- internals: operations ---------------------------------------------------------------

    def _check_type_meta(self, res: ResourceType, obj: dict) -> None:
        kind, api_version = obj.get("kind"), obj.get("apiVersion")
        if res.custom and (not kind or not api_version):
            missing = "Kind" if not kind else "apiVersion"
            raise ApiError.bad_request(f"Object '{missing}' is missing in '{json.dumps(obj, separators=(',', ':'))}'")
        if api_version and api_version != res.api_version:
            raise ApiError.bad_request(
                f"the API version in the data ({api_version}) does not match the expected API version ({res.api_version})")
        if kind and kind != res.kind:
            raise ApiError.bad_request(f"the kind in the data ({kind}) does not match the expected kind ({res.kind})")
        obj["kind"], obj["apiVersion"] = res.kind, res.api_version

    def _create(self, res: ResourceType, namespace: str, body: Any, *, dry_run: bool = False,
                field_validation: str | None = None) -> tuple[dict, list[str]]:
        if not isinstance(body, dict):
            raise ApiError.bad_request("the body of the request was in an unknown format")
        obj = copy.deepcopy(body)
        self._check_type_meta(res, obj)
        meta = obj.get("metadata")
        if meta is None:
            meta = obj["metadata"] = {}
        if not isinstance(meta, dict):
            raise ApiError.bad_request("metadata must be an object")
        if meta.get("namespace") not in (None, "", namespace):
            raise ApiError.bad_request("the namespace of the provided object does not match the namespace sent on the request")
        meta["namespace"] = namespace
        for key in _SYSTEM_META:
            meta.pop(key, None)
        name, generate = meta.get("name"), meta.get("generateName")
        if not name and not generate:
            raise ApiError.invalid(res, "", [("FieldValueRequired", "metadata.name",
                                               "Required value: name or generateName is required")])
        if name:
            err = _dns_subdomain_error(name)
            if err:
                raise ApiError.invalid(res, name, [("FieldValueInvalid", "metadata.name", f'Invalid value: "{name}": {err}')])
        if res.status_subresource and res.custom:
            obj.pop("status", None)
        warnings = self._apply_schema(res, obj, field_validation)
        if not res.custom:
            self._default_core(res, obj)
        with self._lock:
            if not name:
                for _ in range(20):
                    candidate = generate[:58] + "".join(random.choice(_GENERATE_ALPHABET) for _ in range(5))
                    if (namespace, candidate) not in self._store[res]:
                        break
                meta["name"] = name = candidate
                err = _dns_subdomain_error(name)
                if err:
                    raise ApiError.invalid(res, name, [("FieldValueInvalid", "metadata.generateName",
                                                         f'Invalid value: "{generate}": {err}')])
            if (namespace, name) in self._store[res]:
                raise ApiError.already_exists(res, name)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            if res.tracks_generation:
                meta["generation"] = 1
            if dry_run:
                return obj, warnings
            return self._commit_create(res, obj), warnings

    def _update(self, res: ResourceType, namespace: str, name: str, body: Any, subresource: str | None, *,
                dry_run: bool = False, field_validation: str | None = None, from_patch: bool = False) -> tuple[dict, list[str]]:
        if not isinstance(body, dict):
            raise ApiError.bad_request("the body of the request was in an unknown format")
        new = copy.deepcopy(body)
        if not from_patch:
            self._check_type_meta(res, new)
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            meta = new["metadata"] = {}
        if meta.get("name") not in (None, "", name):
            raise ApiError.bad_request(f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})")
        if meta.get("namespace") not in (None, "", namespace):
            raise ApiError.bad_request("the namespace of the provided object does not match the namespace sent on the request")
        given_rv = meta.get("resourceVersion")
        with self._lock:
            old = self._store[res].get((namespace, name))
            if old is None:
                raise ApiError.not_found(res, name)
            if not given_rv and not res.unconditional_update and not from_patch:
                raise ApiError.invalid(res, name, [("FieldValueInvalid", "metadata.resourceVersion",
                                                     "Invalid value: 0: must be specified for an update")])
            if given_rv and str(given_rv) != old["metadata"]["resourceVersion"]:
                raise ApiError.conflict(res, name)
            if subresource == "status":
                merged = copy.deepcopy(old)
                if "status" in new:
                    merged["status"] = new["status"]
                else:
                    merged.pop("status", None)
                new = merged
            else:
                self._carry_system_meta(res, old, new)
                if res.status_subresource:
                    if "status" in old:
                        new["status"] = copy.deepcopy(old["status"])
                    else:
                        new.pop("status", None)
                old_fin = set(old["metadata"].get("finalizers") or [])
                added = [f for f in new["metadata"].get("finalizers") or [] if f not in old_fin]
                if old["metadata"].get("deletionTimestamp") and added:
                    raise ApiError.invalid(res, name, [(
                        "FieldValueForbidden", "metadata.finalizers",
                        f"Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers {json.dumps(added)}")])
            if res.plural == "secrets":
                self._fold_string_data(new)
            warnings = self._apply_schema(res, new, field_validation)
            if dry_run:
                preview = copy.deepcopy(new)
                preview["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
                return preview, warnings
            return self._commit_update(res, old, new), warnings

    def _patch(self, res: ResourceType, namespace: str, name: str, patch: Any, content_type: str,
               subresource: str | None, *, dry_run: bool = False, field_validation: str | None = None) -> dict:
        obj, _ = self._patch_w(res, namespace, name, patch, content_type, subresource,
                               dry_run=dry_run, field_validation=field_validation)
        return obj

    def _patch_w(self, res: ResourceType, namespace: str, name: str, patch: Any, content_type: str,
                 subresource: str | None, *, dry_run: bool = False,
                 field_validation: str | None = None) -> tuple[dict, list[str]]:
        with self._lock:
            old = self._store[res].get((namespace, name))
            if old is None:
                raise ApiError.not_found(res, name)
            if content_type == "application/json-patch+json":
                try:
                    patched = json_patch(old, patch)
                except PatchDecodeError as exc:
                    raise ApiError.bad_request(str(exc)) from None
                except PatchError as exc:
                    raise ApiError.unprocessable(str(exc)) from None
            else:  # merge-patch (strategic merge patch of core types approximated by it)
                if not isinstance(patch, dict):
                    raise ApiError.bad_request(
                        f"json: cannot unmarshal {type(patch).__name__} into Go value of type map[string]interface {{}}")
                patched = merge_patch(old, patch)
            if not isinstance(patched, dict):
                raise ApiError.bad_request("the patched object is not a JSON object")
            meta = patched.setdefault("metadata", {})
            if not isinstance(meta, dict):
                raise ApiError.bad_request("metadata must be an object")
            meta["name"], meta["namespace"] = name, namespace
            patched["kind"], patched["apiVersion"] = res.kind, res.api_version
            if not meta.get("resourceVersion"):
                meta["resourceVersion"] = old["metadata"]["resourceVersion"]
            return self._update(res, namespace, name, patched, subresource, dry_run=dry_run,
                                field_validation=field_validation, from_patch=True)

    def _delete(self, res: ResourceType, namespace: str, name: str, options: dict, *,
                dry_run: bool = False) -> tuple[dict, bool]:
        """Returns (object, removed_now)."""
        with self._lock:
            old = self._store[res].get((namespace, name))
            if old is None:
                raise ApiError.not_found(res, name)
            pre = options.get("preconditions") or {}
            if pre.get("uid") and pre["uid"] != old["metadata"]["uid"]:
                raise ApiError.conflict(res, name, (
                    f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: {old['metadata']['uid']}"))
            if pre.get("resourceVersion") and str(pre["resourceVersion"]) != old["metadata"]["resourceVersion"]:
                raise ApiError.conflict(res, name, (
                    f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                    f"ResourceVersion in object meta: {old['metadata']['resourceVersion']}"))
            if dry_run:
                return old, False
            if old["metadata"].get("finalizers"):
                if old["metadata"].get("deletionTimestamp"):
                    return old, False
                new = copy.deepcopy(old)
                new["metadata"]["deletionTimestamp"] = now_rfc3339()
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                # graceful deletion bumps metadata.generation, like the real registry's BeforeDelete
                return self._commit_update(res, old, new, bump_generation=True), False
            return self._commit_delete(res, old), True

    # -- HTTP --------------------------------------------------------------------------------

    @staticmethod
    def _json(body: Any, status: int = 200, headers: dict | None = None) -> web.Response:
        return web.Response(body=json.dumps(body, separators=(",", ":")).encode(), status=status,
                            headers={"Content-Type": "application/json", **(headers or {})})

    def _status_response(self, err: ApiError) -> web.Response:
        return self._json(err.body(), err.code, err.headers)

    @staticmethod
    def _abort(request: web.Request) -> None:
        transport = request.transport
        if transport is None:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        transport.abort()

    def _take_fault(self, method: str, path: str, watch: bool) -> _Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, path, watch):
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None

    def _fault_response(self, fault: _Fault, route: _Route, method: str, watch: bool) -> web.Response:
        headers = {}
        if fault.retry_after is not None:
            headers["Retry-After"] = str(math.ceil(float(fault.retry_after)))  # integer seconds, as urllib3 expects
        if isinstance(fault.body, (bytes, str)):
            raw = fault.body.encode() if isinstance(fault.body, str) else fault.body
            return web.Response(body=raw, status=fault.status, headers=headers)
        if isinstance(fault.body, dict):
            return self._json(fault.body, fault.status, headers)
        code = fault.status
        verb = _verb_of(method, route, watch)
        if code == 403:
            err = ApiError.forbidden(route.res, verb, route.namespace, route.name, self.user, route.subresource)
        elif code == 404 and route.res is not None and route.name:
            err = ApiError.not_found(route.res, route.name)
        elif code == 409 and route.res is not None and route.name:
            err = ApiError.conflict(route.res, route.name)
        elif code == 429:
            err = ApiError(429, "TooManyRequests", fault.message or _GENERIC_STATUS[429][1],
                           {"retryAfterSeconds": math.ceil(float(fault.retry_after or 0))})
        else:
            reason, message = _GENERIC_STATUS.get(code, ("", f"injected HTTP {code}"))
            details = {"causes": [{"message": "injected fault"}]} if code == 500 else None
            err = ApiError(code, reason, fault.message or message, details)
        return self._json(err.body(), code, headers)

    def _authorized(self, request: web.Request) -> bool | None:
        """True: valid token; None: no credentials; False: bad credentials."""
        header = request.headers.get("Authorization")
        if not header:
            return None
        scheme, _, value = header.partition(" ")
        token = value.strip()
        with self._lock:
            known = token in self._extra_tokens
        return scheme.lower() == "bearer" and (known or _secrets.compare_digest(token, self._token))

    def _check_denied(self, verb: str, route: _Route) -> None:
        if route.res is None:
            return
        resource = f"{route.res.plural}/{route.subresource}" if route.subresource else route.res.plural
        with self._lock:
            for d in self._denials:
                if d.times is not None and d.times <= 0:
                    continue
                if d.verb not in ("*", verb) or d.plural not in ("*", resource):
                    continue
                if d.namespace is not None and d.namespace != route.namespace:
                    continue
                if d.times is not None:
                    d.times -= 1
                raise ApiError.forbidden(route.res, verb, route.namespace, route.name, self.user, route.subresource)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        method = request.method.upper()
        path = request.path
        query = {k: v for k, v in request.query.items()}
        watch = query.get("watch", "").lower() in ("true", "1")
        route = _parse_path(path)
        verb = _verb_of(method, route, watch)
        with self._lock:
            self._log.append(LoggedRequest(method, path, query, watch))
            self._counters[verb] += 1
        if self._latency:
            await asyncio.sleep(self._latency)
        fault = self._take_fault(method, path, watch)
        if fault is not None:
            if fault.reset:
                self._abort(request)
                return web.Response(status=500)
            return self._fault_response(fault, route, method, watch)
        auth = self._authorized(request)
        public = route.kind in ("version", "health")
        if auth is False or (auth is None and not public):
            return self._json(status_body(401, "Unauthorized", "Unauthorized"), 401)
        try:
            return await self._route(request, method, route, query, watch, verb)
        except ApiError as err:
            return self._status_response(err)
        except SelectorError as err:
            return self._status_response(ApiError.bad_request(str(err)))

    async def _read_json(self, request: web.Request) -> Any:
        raw = await request.read()
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ApiError.bad_request(f"error decoding body: {exc}") from None

    async def _route(self, request: web.Request, method: str, route: _Route, query: dict, watch: bool,
                     verb: str) -> web.StreamResponse:
        kind = route.kind
        if kind == "health":
            return web.Response(text="ok", content_type="text/plain")
        if kind == "version":
            return self._json(self._version_doc())
        if kind == "api":
            return self._json({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{self.port}"}]})
        if kind == "apis":
            return self._json({"kind": "APIGroupList", "apiVersion": "v1",
                               "groups": [self._group_doc(g) for g in sorted({r.group for r in RESOURCE_TYPES if r.group})]})
        if kind == "group":
            if not any(r.group == route.group for r in RESOURCE_TYPES):
                raise ApiError.not_found_path()
            return self._json(dict(self._group_doc(route.group), kind="APIGroup", apiVersion="v1"))
        if kind == "resources":
            return self._json(self._resource_list_doc(route.group, route.version))
        if kind in ("namespaces", "namespace"):
            return self._namespaces(method, route)
        if kind == "proxy":
            return await self._proxy(request, route)
        if kind == "unknown" or route.res is None:
            if route.kind == "unknown" and not request.path.startswith(("/api/", "/apis/")):
                return web.Response(status=404, text="404 page not found\n", content_type="text/plain")
            raise ApiError.not_found_path()
        res = route.res
        if route.subresource is not None and not (route.subresource == "status" and res.status_subresource):
            raise ApiError.not_found_path()
        self._check_denied(verb, route)
        dry_run = query.get("dryRun") == "All"
        if "dryRun" in query and not dry_run:
            raise ApiError(400, "BadRequest", f'Invalid dry run value: "{query["dryRun"]}"', None)
        field_validation = query.get("fieldValidation")
        if kind == "collection":
            if method == "GET":
                if watch:
                    return await self._watch(request, res, route.namespace, query)
                return self._json(self._list(res, route.namespace, query))
            if method == "POST":
                if route.namespace is None:
                    raise ApiError.method_not_allowed()
                self._require_json(request, res)
                obj, warnings = self._create(res, route.namespace, await self._read_json(request),
                                             dry_run=dry_run, field_validation=field_validation)
                return self._json(obj, 201, self._warning_headers(warnings))
            if method == "DELETE" and route.namespace is not None:
                return self._json(self._delete_collection(res, route.namespace, query, dry_run))
            raise ApiError.method_not_allowed()
        # object
        ns, name = route.namespace, route.name
        if method == "GET":
            with self._lock:
                obj = self._store[res].get((ns, name))
                if obj is None:
                    raise ApiError.not_found(res, name)
                return self._json(obj)
        if method == "PUT":
            self._require_json(request, res)
            obj, warnings = self._update(res, ns, name, await self._read_json(request), route.subresource,
                                         dry_run=dry_run, field_validation=field_validation)
            return self._json(obj, 200, self._warning_headers(warnings))
        if method == "PATCH":
            ctype = request.content_type.lower()
            if ctype not in ("application/merge-patch+json", "application/json-patch+json") and not (
                    ctype == "application/strategic-merge-patch+json" and not res.custom):
                raise ApiError.unsupported_media_type(ctype, res)
            patch = await self._read_json(request)
            if patch is None:
                raise ApiError.bad_request("the body of the request was empty")
            obj, warnings = self._patch_w(res, ns, name, patch, ctype, route.subresource, dry_run=dry_run,
                                          field_validation=field_validation)
            return self._json(obj, 200, self._warning_headers(warnings))
        if method == "DELETE":
            if route.subresource is not None:
                raise ApiError.method_not_allowed()
            options = await self._read_json(request) or {}
            if not isinstance(options, dict):
                raise ApiError.bad_request("DeleteOptions must be an object")
            dry_run = dry_run or options.get("dryRun") == ["All"]
            obj, removed = self._delete(res, ns, name, options, dry_run=dry_run)
            if removed and not res.return_deleted_object:
                return self._json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                   "details": res.details(name, uid=obj["metadata"]["uid"])})
            return self._json(obj)
        raise ApiError.method_not_allowed()

    @staticmethod
    def _warning_headers(warnings: list[str]) -> dict:
        return {"Warning": ", ".join('299 - ' + json.dumps(w) for w in warnings)} if warnings else {}

    @staticmethod
    def _require_json(request: web.Request, res: ResourceType) -> None:
        ctype = request.content_type.lower()
        if ctype not in ("application/json", "application/octet-stream", ""):
            raise ApiError(415, "UnsupportedMediaType",
                           f'the body of the request was in an unknown format - accepted media types include: '
                           f'application/json, application/yaml, application/vnd.kubernetes.protobuf')

    def _list(self, res: ResourceType, namespace: str | None, query: dict) -> dict:
        lreqs = parse_label_selector(query.get("labelSelector"))
        freqs = parse_field_selector(query.get("fieldSelector"), res.plural, custom=res.custom)
        with self._lock:
            items = self._select(res, namespace, lreqs, freqs)
            list_rv = str(self._rv)
        start = 0
        if query.get("continue"):
            try:
                start = int(json.loads(base64.urlsafe_b64decode(query["continue"]))["start"])
            except Exception:
                raise ApiError.bad_request("continue key is not valid: illegal base64 data") from None
        meta: dict[str, Any] = {"resourceVersion": list_rv}
        limit = int(query.get("limit") or 0)
        if limit > 0 and start + limit < len(items):
            meta["continue"] = base64.urlsafe_b64encode(json.dumps({"start": start + limit}).encode()).decode()
            meta["remainingItemCount"] = len(items) - start - limit
            items = items[start:start + limit]
        else:
            items = items[start:]
        if not res.custom:  # core lists carry items without kind/apiVersion
            items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in items]
        return {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": meta, "items": items}

    def _delete_collection(self, res: ResourceType, namespace: str, query: dict, dry_run: bool) -> dict:
        lreqs = parse_label_selector(query.get("labelSelector"))
        freqs = parse_field_selector(query.get("fieldSelector"), res.plural, custom=res.custom)
        out = []
        with self._lock:
            for obj in self._select(res, namespace, lreqs, freqs):
                deleted, _ = self._delete(res, namespace, obj["metadata"]["name"], {}, dry_run=dry_run)
                out.append(deleted)
            rv = str(self._rv)
        return {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": {"resourceVersion": rv},
                "items": out}

    async def _watch(self, request: web.Request, res: ResourceType, namespace: str | None,
                     query: dict) -> web.StreamResponse:
        lreqs = parse_label_selector(query.get("labelSelector"))
        freqs = parse_field_selector(query.get("fieldSelector"), res.plural, custom=res.custom)
        rv_param = query.get("resourceVersion", "")
        timeout = query.get("timeoutSeconds")
        bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1")
        initial: list[tuple[str, dict]] = []
        expired: str | None = None
        if rv_param not in ("", "0") and not rv_param.isdigit():
            raise ApiError.bad_request(f'invalid resource version "{rv_param}"')
        with self._lock:
            if rv_param in ("", "0"):
                start_rv = self._rv
                initial = [("ADDED", o) for o in self._select(res, namespace, lreqs, freqs)]
            else:
                start_rv = int(rv_param)
                if start_rv < self._compacted_rv:
                    expired = f"too old resource version: {start_rv} ({self._compacted_rv + 1})"
            watch = _Watch(self, res, namespace, lreqs, freqs, start_rv, request)
            if expired is None and rv_param not in ("", "0"):
                for ev in self._history:
                    if ev.resource_version > start_rv:
                        watch.progress_rv = ev.resource_version
                        item = watch.translate(ev)
                        if item is not None:
                            initial.append(item)
                watch.start_rv = max(start_rv, self._rv)
                watch.progress_rv = watch.start_rv
            if expired is None:
                self._watches.add(watch)
                self._changed()
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json",
                                                       "Cache-Control": "no-cache, private"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)

        async def send(type_: str, obj: dict) -> None:
            await resp.write(json.dumps({"type": type_, "object": obj}, separators=(",", ":")).encode() + b"\n")

        if expired is not None:
            try:
                await send("ERROR", status_body(410, "Expired", expired))
                await resp.write_eof()
            except ConnectionError:
                pass
            return resp
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(timeout) if timeout else None
        try:
            for type_, obj in initial:
                await send(type_, obj)
            next_bookmark = loop.time() + self.bookmark_interval if (bookmarks and self.bookmark_interval) else None
            while True:
                waits = [t for t in (deadline, next_bookmark) if t is not None]
                wait = max(0.0, min(waits) - loop.time()) if waits else None
                try:
                    type_, obj = await asyncio.wait_for(watch.queue.get(), wait)
                except asyncio.TimeoutError:
                    now = loop.time()
                    if deadline is not None and now >= deadline:
                        break
                    if next_bookmark is not None and now >= next_bookmark:
                        await send("BOOKMARK", {"kind": res.kind, "apiVersion": res.api_version,
                                                "metadata": {"resourceVersion": str(watch.progress_rv)}})
                        next_bookmark = now + self.bookmark_interval
                    continue
                if type_ == "__cut__":
                    self._abort(request)
                    return resp
                if type_ == "__stop__":
                    break
                await send(type_, obj)
            await resp.write_eof()
        except ConnectionError:  # the client went away
            pass
        finally:
            with self._lock:
                self._watches.discard(watch)
                self._changed()
        return resp

    def _namespaces(self, method: str, route: _Route) -> web.Response:
        if method != "GET":
            raise ApiError.method_not_allowed()
        with self._lock:
            names = {"default", "kube-system", "kube-public"}
            for objs in self._store.values():
                names.update(ns for ns, _ in objs)
        def doc(ns: str) -> dict:
            return {"kind": "Namespace", "apiVersion": "v1",
                    "metadata": {"name": ns, "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, ns)), "resourceVersion": "1",
                                 "labels": {"kubernetes.io/metadata.name": ns}},
                    "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}
        if route.kind == "namespace":
            return self._json(doc(route.namespace))  # namespaces exist implicitly
        return self._json({"kind": "NamespaceList", "apiVersion": "v1", "metadata": {"resourceVersion": self.resource_version},
                           "items": [{k: v for k, v in doc(n).items() if k not in ("kind", "apiVersion")} for n in sorted(names)]})

    async def _proxy(self, request: web.Request, route: _Route) -> web.StreamResponse:
        parts = route.name.split(":")
        if len(parts) == 3:
            _, svc, port = parts
        elif len(parts) == 2:
            svc, port = parts
        else:
            svc, port = parts[0], ""
        self._check_denied("get" if request.method == "GET" else "create", _Route(
            "proxy", route.res, route.namespace, svc, "proxy"))
        with self._lock:
            service = self._store[route.res].get((route.namespace, svc))
            target = self._proxies.get((route.namespace, svc, port))
        if service is None:
            raise ApiError.not_found(route.res, svc)
        if target is None:
            raise ApiError(503, "ServiceUnavailable", f'no endpoints available for service "{route.name}"', {})
        import aiohttp

        if self._client_session is None:
            self._client_session = aiohttp.ClientSession()
        url = f"{target}/{route.proxy_rest}"
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "authorization", "content-length", "transfer-encoding", "connection")}
        try:
            async with self._client_session.request(request.method, url, params=request.query,
                                                    data=await request.read(), headers=headers,
                                                    allow_redirects=False) as upstream:
                body = await upstream.read()
                out_headers = {k: v for k, v in upstream.headers.items()
                               if k.lower() in ("content-type", "location", "cache-control")}
                return web.Response(body=body, status=upstream.status, headers=out_headers)
        except aiohttp.ClientError as exc:
            return self._json(status_body(503, "ServiceUnavailable",
                                          f"error trying to reach service: {exc}"), 503)

    # -- discovery docs -------------------------------------------------------------------------

    def _version_doc(self) -> dict:
        major, minor, _ = KUBERNETES_GIT_VERSION.lstrip("v").split(".")
        return {"major": major, "minor": minor, "emulationMajor": major, "emulationMinor": minor,
                "minCompatibilityMajor": major, "minCompatibilityMinor": str(int(minor) - 1),
                "gitVersion": KUBERNETES_GIT_VERSION, "gitCommit": "0" * 40, "gitTreeState": "clean",
                "buildDate": "2026-11-01T00:00:00Z", "goVersion": "go1.25.4", "compiler": "gc",
                "platform": "linux/amd64"}

    @staticmethod
    def _group_doc(group: str) -> dict:
        versions = sorted({r.version for r in RESOURCE_TYPES if r.group == group})
        gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": gvs, "preferredVersion": gvs[0]}

    @staticmethod
    def _resource_list_doc(group: str, version: str) -> dict:
        resources = []
        for r in RESOURCE_TYPES:
            if r.group != group or r.version != version:
                continue
            entry = {"name": r.plural, "singularName": r.singular, "namespaced": True, "kind": r.kind,
                     "verbs": list(r.verbs)}
            if r.short_names:
                entry["shortNames"] = list(r.short_names)
            if r.custom:
                entry["categories"] = ["all"]
            resources.append(entry)
            if r.status_subresource:
                resources.append({"name": f"{r.plural}/status", "singularName": "", "namespaced": True,
                                  "kind": r.kind, "verbs": ["get", "patch", "update"]})
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version, "resources": resources}

