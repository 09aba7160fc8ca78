"""Which resource, object or subresource a request path names, its Kubernetes verb, and the request log."""

from __future__ import annotations

import collections
import re
import threading
from dataclasses import dataclass
from typing import NamedTuple

from ._resources import BY_GVR, RESOURCE_TYPES, ResourceType


@dataclass(frozen=True)
class Route:
    kind: str  # "api", "apis", "group", "resources", "version", "health", "collection", "object",
    #           "namespaces", "namespace", "proxy", "unknown"
    res: ResourceType | None = None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None
    group: str = ""
    version: str = ""
    proxy_rest: str = ""


def parse_path(path: str) -> Route:
    if path in ("/version", "/version/"):
        return Route("version")
    if path.rstrip("/") in ("/healthz", "/readyz", "/livez") or path.startswith(("/healthz/", "/readyz/", "/livez/")):
        return Route("health")
    parts = [p for p in path.split("/") if p != ""]
    if not parts:
        return Route("unknown")
    if parts[0] == "api":
        if len(parts) == 1:
            return Route("api")
        group, version, rest = "", parts[1], parts[2:]
    elif parts[0] == "apis":
        if len(parts) == 1:
            return Route("apis")
        if len(parts) == 2:
            return Route("group", group=parts[1])
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return Route("unknown")
    if not any(r.group == group and r.version == version for r in RESOURCE_TYPES):
        return Route("unknown")
    if not rest:
        return Route("resources", group=group, version=version)
    if rest[0] == "namespaces":
        if len(rest) == 1:
            return Route("namespaces", group=group, version=version) if not group else Route("unknown")
        ns = rest[1]
        if len(rest) == 2:
            return Route("namespace", namespace=ns, group=group, version=version) if not group else Route("unknown")
        res = BY_GVR.get((group, version, rest[2]))
        if res is None:
            return Route("unknown")
        if len(rest) == 3:
            return Route("collection", res=res, namespace=ns, group=group, version=version)
        name = rest[3]
        if len(rest) == 4:
            return Route("object", res=res, namespace=ns, name=name, group=group, version=version)
        if res.plural == "services" and rest[4] == "proxy":
            return Route("proxy", res=res, namespace=ns, name=name, subresource="proxy",
                          proxy_rest="/".join(rest[5:]) + ("/" if path.endswith("/") and len(rest) > 5 else ""),
                          group=group, version=version)
        if len(rest) == 5:
            return Route("object", res=res, namespace=ns, name=name, subresource=rest[4], group=group, version=version)
        return Route("unknown")
    res = BY_GVR.get((group, version, rest[0]))
    if res is not None and len(rest) == 1:
        return Route("collection", res=res, namespace=None, group=group, version=version)
    return Route("unknown")


def verb_of(method: str, route: Route, watch: bool) -> str:
    if route.kind == "proxy":
        return "proxy"
    if route.kind == "collection":
        return {"GET": "watch" if watch else "list", "POST": "create", "DELETE": "deletecollection"}.get(
            method, method.lower())
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
        return verb_of(self.method, parse_path(self.path), self.watch)

    @property
    def resource(self) -> str | None:
        route = parse_path(self.path)
        if route.res is None:
            return None
        return f"{route.res.plural}/{route.subresource}" if route.subresource else route.res.plural


class RequestLog:
    """Every request received, in order, and a count per Kubernetes verb (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._log: list[LoggedRequest] = []
        self._counters: collections.Counter = collections.Counter()

    def record(self, request: LoggedRequest, verb: str) -> None:
        with self._lock:
            self._log.append(request)
            self._counters[verb] += 1

    @property
    def requests(self) -> list[LoggedRequest]:
        with self._lock:
            return list(self._log)

    @property
    def counters(self) -> collections.Counter:
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

    def clear(self) -> None:
        with self._lock:
            self._log.clear()
            self._counters.clear()
