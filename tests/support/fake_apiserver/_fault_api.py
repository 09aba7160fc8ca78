"""The fault-injection part of :class:`tests.support.fake_apiserver.server.FakeKubeApiServer`'s public API: HTTP errors,
connection resets, lost answers, latency, RBAC-style denials, cut or ended watches, dropped connections.

A mixin: the server owns the ``FaultInjector``, the change feed and the aiohttp runner it uses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ._faults import FaultInjector
from ._watches import ChangeFeed


class FaultApi:
    """What a test breaks on purpose; delegates to ``_faults`` (``_faults.py``) and ``_feed`` (``_watches.py``)."""

    _faults: FaultInjector
    _feed: ChangeFeed
    _runner: web.AppRunner | None
    loop: asyncio.AbstractEventLoop

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
        self._faults.inject(method, path_regex, status, times=times, retry_after=retry_after, body=body,
                            message=message, watch=watch)

    def reset_connection(self, method: str | None, path_regex: str, times: int | None = 1, *,
                         watch: bool | None = None) -> None:
        """Close the TCP connection (RST) of the next ``times`` matching requests without a response.

        Note: urllib3 (the sync client) retries idempotent methods (GET, PUT, DELETE) up to 3 times
        on a reset, so a single reset of a GET is invisible to it."""
        self._faults.reset_connection(method, path_regex, times, watch=watch)

    def lose_answers(self, method: str | None, path_regex: str, times: int | None = 1) -> None:
        """Carry out the next ``times`` matching requests (``None``: all), then close the connection (RST)
        without the answer: a create that landed although its client saw it fail."""
        self._faults.lose_answers(method, path_regex, times)

    def stall(self, method: str | None, path_regex: str, seconds: float, times: int | None = 1) -> None:
        """Answer the next ``times`` matching requests normally, but only after ``seconds`` (a client
        whose request timeout is shorter sees a timeout)."""
        self._faults.stall(method, path_regex, seconds, times)

    def before(self, method: str | None, path_regex: str, action: Callable[[], object],
               times: int | None = 1) -> None:
        """Run ``action`` (on the server's loop, so no request is served meanwhile) just before the next
        ``times`` matching requests are served: e.g. replace an object between a client's check and its act."""
        self._faults.before(method, path_regex, action, times)

    def clear_faults(self) -> None:
        """Disarm every fault, denial and latency."""
        self._faults.clear()

    def latency(self, seconds: float) -> None:
        """Delay every request by ``seconds`` before it is answered (0 disables)."""
        self._faults.latency = float(seconds)

    def deny(self, verb: str, resource: str, namespace: str | None = None, *, times: int | None = None) -> None:
        """RBAC-style denial: matching requests get 403 Forbidden with the real server's message.
        ``verb``: get/list/watch/create/update/patch/delete/deletecollection or "*"; ``resource``:
        a plural, optionally with a subresource ("rayclusters/status")."""
        self._faults.deny(verb, resource, namespace, times=times)

    def cut_watches(self) -> int:
        """Abruptly close every open watch stream mid-stream (no terminating chunk); returns how many."""
        return self._feed.cut_all()

    @property
    def open_watches(self) -> int:
        return self._feed.open_watches

    def end_watches(self) -> None:
        """End every open watch stream cleanly, as the server does when a watch's ``timeoutSeconds`` is up."""
        self.loop.call_soon_threadsafe(self._feed.end_all)

    def drop_connections(self) -> int:
        """What clients see of an API server restart (its state kept, as in etcd): every watch stream is
        cut and every client connection closed at once. Returns how many connections were closed."""
        self.cut_watches()

        async def drop() -> int:
            server = self._runner.server if self._runner is not None else None
            transports = list(server._connections.values()) if server is not None else []
            for transport in transports:
                transport.abort()
            return len(transports)

        return asyncio.run_coroutine_threadsafe(drop(), self.loop).result(10)
