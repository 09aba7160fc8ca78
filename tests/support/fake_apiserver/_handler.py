"""The HTTP front of the fake API server: log the request, apply latency and faults, authenticate,
route it to discovery, the registry, a watch stream or the service proxy, and answer errors with
the Status body a real server sends."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading

from aiohttp import web

from . import _discovery as discovery
from ._errors import ApiError, status_body
from ._faults import FaultInjector
from ._http import abort, json_response, read_json, status_response
from ._proxy import ServiceProxy
from ._registry import JSON_PATCH, MERGE_PATCH, Registry
from ._resources import ResourceType
from ._routing import LoggedRequest, RequestLog, Route, parse_path, verb_of
from ._selectors import SelectorError
from ._watches import ChangeFeed

_DEFAULT_NAMESPACES = {"default", "kube-system", "kube-public"}


class ApiHandler:
    """Answers every request of the aiohttp app (``handle`` is its one catch-all route)."""

    def __init__(self, registry: Registry, feed: ChangeFeed, faults: FaultInjector, proxy: ServiceProxy,
                 log: RequestLog) -> None:
        self.registry = registry
        self.feed = feed
        self.faults = faults
        self.proxy = proxy
        self.log = log
        self.token = secrets.token_urlsafe(24)
        self._extra_tokens: set[str] = set()
        self._tokens_lock = threading.Lock()
        self.port = 0

    def accept_token(self, token: str) -> None:
        with self._tokens_lock:
            self._extra_tokens.add(token)

    def _authorized(self, request: web.Request) -> bool | None:
        """True: valid token; None: no credentials; False: bad credentials."""
        header = request.headers.get("Authorization")
        if not header:
            return None
        scheme, _, value = header.partition(" ")
        token = value.strip()
        with self._tokens_lock:
            known = token in self._extra_tokens
        return scheme.lower() == "bearer" and (known or secrets.compare_digest(token, self.token))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        method = request.method.upper()
        path = request.path
        query = {k: v for k, v in request.query.items()}
        watch = query.get("watch", "").lower() in ("true", "1")
        route = parse_path(path)
        verb = verb_of(method, route, watch)
        self.log.record(LoggedRequest(method, path, query, watch), verb)
        if self.faults.latency:
            await asyncio.sleep(self.faults.latency)
        fault = self.faults.take(method, path, watch)
        if fault is not None and fault.stall:  # answered normally, late (a client's timeout may come first)
            await asyncio.sleep(fault.stall)
            fault = None
        if fault is not None and fault.before is not None:  # the world changes, then the request is served
            fault.before()
            fault = None
        if fault is not None and not fault.lose_answer:
            if fault.reset:
                abort(request)
                return web.Response(status=500)
            return self.faults.response(fault, route, method, watch)
        auth = self._authorized(request)
        public = route.kind in ("version", "health")
        if auth is False or (auth is None and not public):
            return json_response(status_body(401, "Unauthorized", "Unauthorized"), 401)
        try:
            answer = await self._route(request, method, route, query, watch, verb)
        except ApiError as err:
            answer = status_response(err)
        except SelectorError as err:
            answer = status_response(ApiError.bad_request(str(err)))
        if fault is not None:  # lose_answer: done, but the client never hears of it
            abort(request)
            return web.Response(status=500)
        return answer

    async def _route(self, request: web.Request, method: str, route: Route, query: dict, watch: bool,
                     verb: str) -> web.StreamResponse:
        kind = route.kind
        if kind == "health":
            return web.Response(text="ok", content_type="text/plain")
        if kind == "version":
            return json_response(discovery.version_doc())
        if kind == "api":
            return json_response(discovery.api_versions_doc(self.port))
        if kind == "apis":
            return json_response(discovery.group_list_doc())
        if kind == "group":
            if not discovery.known_group(route.group):
                raise ApiError.not_found_path()
            return json_response(dict(discovery.group_doc(route.group), kind="APIGroup", apiVersion="v1"))
        if kind == "resources":
            return json_response(discovery.resource_list_doc(route.group, route.version))
        if kind in ("namespaces", "namespace"):
            return self._namespaces(method, route)
        if kind == "proxy":
            return await self.proxy.forward(request, route)
        if kind == "unknown" or route.res is None:
            if route.kind == "unknown" and not request.path.startswith(("/api/", "/apis/")):
                return web.Response(status=404, text="404 page not found\n", content_type="text/plain")
            raise ApiError.not_found_path()
        res = route.res
        if route.subresource is not None and not (route.subresource == "status" and res.status_subresource):
            raise ApiError.not_found_path()
        self.faults.check_denied(verb, route)
        dry_run = query.get("dryRun") == "All"
        if "dryRun" in query and not dry_run:
            raise ApiError(400, "BadRequest", f'Invalid dry run value: "{query["dryRun"]}"', None)
        if kind == "collection":
            return await self._collection(request, method, res, route.namespace, query, watch, dry_run)
        return await self._object(request, method, res, route, query, dry_run)

    async def _collection(self, request: web.Request, method: str, res: ResourceType, namespace: str | None,
                          query: dict, watch: bool, dry_run: bool) -> web.StreamResponse:
        if method == "GET":
            if watch:
                return await self.feed.serve(request, self.registry.store, res, namespace, query)
            return json_response(self.registry.list(res, namespace, query))
        if method == "POST":
            if namespace is None:
                raise ApiError.method_not_allowed()
            _require_json(request)
            obj, warnings = self.registry.create(res, namespace, await read_json(request), dry_run=dry_run,
                                                 field_validation=query.get("fieldValidation"))
            return json_response(obj, 201, _warning_headers(warnings))
        if method == "DELETE" and namespace is not None:
            return json_response(self.registry.delete_collection(res, namespace, query, dry_run))
        raise ApiError.method_not_allowed()

    async def _object(self, request: web.Request, method: str, res: ResourceType, route: Route, query: dict,
                      dry_run: bool) -> web.StreamResponse:
        ns, name = route.namespace or "", route.name or ""
        field_validation = query.get("fieldValidation")
        if method == "GET":
            return json_response(self.registry.get(res, ns, name))
        if method == "PUT":
            _require_json(request)
            obj, warnings = self.registry.update(res, ns, name, await read_json(request), route.subresource,
                                                 dry_run=dry_run, field_validation=field_validation)
            return json_response(obj, 200, _warning_headers(warnings))
        if method == "PATCH":
            ctype = request.content_type.lower()
            if ctype not in (MERGE_PATCH, JSON_PATCH) and not (
                    ctype == "application/strategic-merge-patch+json" and not res.custom):
                raise ApiError.unsupported_media_type(ctype, res)
            patch = await read_json(request)
            if patch is None:
                raise ApiError.bad_request("the body of the request was empty")
            obj, warnings = self.registry.patch(res, ns, name, patch, ctype, route.subresource, dry_run=dry_run,
                                                field_validation=field_validation)
            return json_response(obj, 200, _warning_headers(warnings))
        if method == "DELETE":
            if route.subresource is not None:
                raise ApiError.method_not_allowed()
            options = await read_json(request) or {}
            if not isinstance(options, dict):
                raise ApiError.bad_request("DeleteOptions must be an object")
            dry_run = dry_run or options.get("dryRun") == ["All"]
            obj, removed = self.registry.delete(res, ns, name, options, dry_run=dry_run)
            if removed and not res.return_deleted_object:
                return json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                      "details": res.details(name, uid=obj["metadata"]["uid"])})
            return json_response(obj)
        raise ApiError.method_not_allowed()

    def _namespaces(self, method: str, route: Route) -> web.Response:
        if method != "GET":
            raise ApiError.method_not_allowed()
        if route.kind == "namespace":
            return json_response(discovery.namespace_doc(route.namespace or ""))
        names = _DEFAULT_NAMESPACES | self.registry.store.namespaces()
        return json_response(discovery.namespace_list_doc(names, self.registry.resource_version))


def _warning_headers(warnings: list[str]) -> dict:
    return {"Warning": ", ".join('299 - ' + json.dumps(w) for w in warnings)} if warnings else {}


def _require_json(request: web.Request) -> None:
    ctype = request.content_type.lower()
    if ctype not in ("application/json", "application/octet-stream", ""):
        raise ApiError(415, "UnsupportedMediaType",
                       'the body of the request was in an unknown format - accepted media types include: '
                       'application/json, application/yaml, application/vnd.kubernetes.protobuf')
