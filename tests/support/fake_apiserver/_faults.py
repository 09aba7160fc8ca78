"""Fault injection: canned HTTP errors, connection resets, latency and RBAC-style denials."""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ._errors import ApiError
from ._http import json_response
from ._routing import Route, verb_of

GENERIC_STATUS = {
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


@dataclass
class Fault:
    method: str | None
    regex: re.Pattern
    status: int | None
    times: int | None
    retry_after: float | int | None = None
    body: Any = None
    message: str | None = None
    reset: bool = False
    watch: bool | None = None
    lose_answer: bool = False
    stall: float = 0.0
    before: Callable[[], object] | None = None

    def matches(self, method: str, path: str, watch: bool) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.method not in (None, "*") and self.method.upper() != method:
            return False
        if self.watch is not None and self.watch != watch:
            return False
        return self.regex.search(path) is not None


@dataclass
class Denial:
    verb: str
    plural: str
    namespace: str | None
    times: int | None


class FaultInjector:
    """The faults and denials armed by a test, consumed by the requests they match, in order.

    :param user: the user name in Forbidden messages.
    """

    def __init__(self, user: str) -> None:
        self.user = user
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._denials: list[Denial] = []
        self.latency = 0.0

    def inject(self, method: str | None, path_regex: str, status: int, *, times: int | None = 1,
               retry_after: float | int | None = None, body: Any = None, message: str | None = None,
               watch: bool | None = None) -> None:
        if status == 429 and retry_after is None:
            retry_after = 1
        with self._lock:
            self._faults.append(Fault(method, re.compile(path_regex), status, times, retry_after, body,
                                      message, watch=watch))

    def reset_connection(self, method: str | None, path_regex: str, times: int | None = 1, *,
                         watch: bool | None = None) -> None:
        with self._lock:
            self._faults.append(Fault(method, re.compile(path_regex), None, times, reset=True, watch=watch))

    def lose_answers(self, method: str | None, path_regex: str, times: int | None = 1) -> None:
        with self._lock:
            self._faults.append(Fault(method, re.compile(path_regex), None, times, lose_answer=True))

    def stall(self, method: str | None, path_regex: str, seconds: float, times: int | None = 1) -> None:
        with self._lock:
            self._faults.append(Fault(method, re.compile(path_regex), None, times, stall=seconds))

    def before(self, method: str | None, path_regex: str, action: Callable[[], object], times: int | None = 1) -> None:
        with self._lock:
            self._faults.append(Fault(method, re.compile(path_regex), None, times, before=action))

    def deny(self, verb: str, resource: str, namespace: str | None = None, *, times: int | None = None) -> None:
        with self._lock:
            self._denials.append(Denial(verb, resource, namespace, times))

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self._denials.clear()
            self.latency = 0.0

    def take(self, method: str, path: str, watch: bool) -> Fault | None:
        """The first armed fault matching this request (used up by one), or None."""
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, path, watch):
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None

    def response(self, fault: Fault, route: Route, method: str, watch: bool) -> web.Response:
        """The answer of an injected HTTP error: the Status body a real server sends for that code."""
        headers = {}
        if fault.retry_after is not None:
            headers["Retry-After"] = str(math.ceil(float(fault.retry_after)))  # integer seconds, as urllib3 expects
        if isinstance(fault.body, (bytes, str)):
            raw = fault.body.encode() if isinstance(fault.body, str) else fault.body
            return web.Response(body=raw, status=fault.status, headers=headers)
        if isinstance(fault.body, dict):
            return json_response(fault.body, fault.status or 500, headers)
        code = fault.status or 500
        verb = verb_of(method, route, watch)
        if code == 403:
            err = ApiError.forbidden(route.res, verb, route.namespace, route.name, self.user, route.subresource)
        elif code == 404 and route.res is not None and route.name:
            err = ApiError.not_found(route.res, route.name)
        elif code == 409 and route.res is not None and route.name:
            err = ApiError.conflict(route.res, route.name)
        elif code == 429:
            err = ApiError(429, "TooManyRequests", fault.message or GENERIC_STATUS[429][1],
                           {"retryAfterSeconds": math.ceil(float(fault.retry_after or 0))})
        else:
            reason, message = GENERIC_STATUS.get(code, ("", f"injected HTTP {code}"))
            details = {"causes": [{"message": "injected fault"}]} if code == 500 else None
            err = ApiError(code, reason, fault.message or message, details)
        return json_response(err.body(), code, headers)

    def check_denied(self, verb: str, route: Route) -> None:
        """Raise 403 Forbidden if an armed denial matches ``verb`` on the route's resource."""
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
