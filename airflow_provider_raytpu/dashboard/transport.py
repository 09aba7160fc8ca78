"""One HTTP endpoint of a Ray cluster as a backend reaches it: the dashboard, or a RayService's Serve proxy.

Every backend hands out an :class:`HttpTransport` (``ClusterBackend.dashboard``,
``ServiceBackend.serve_endpoint``); the Ray Jobs hook, the Serve status reads and the
RayService sensor's smoke request all go through it and never learn which backend, or which
way to the endpoint (an explicit URL, in-cluster DNS, this machine, the Kubernetes API
server's service proxy), is behind it. Constructing a transport does no I/O.

Async requests share one HTTP session per endpoint for every trigger of an event loop (the
Kubernetes API server's own client, for the service proxy); sync requests make their own.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import importlib
import json as jsonlib
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    import aiohttp
    import requests


#: HTTP statuses of an endpoint that is there but cannot answer now (a proxy, a restarting head).
TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})
#: Seconds a synchronous Jobs API request may take (Ray's ``JobSubmissionClient`` sets none: a
#: half-open connection would hang ``submit``, ``status`` and ``stop`` for ever).
REQUEST_TIMEOUT_SECONDS = 60.0
#: Seconds an upload of a ``py_modules`` / ``working_dir`` package may take.
UPLOAD_TIMEOUT_SECONDS = 600.0
#: The bodies of the 401 and 403 of Ray's token authentication (Ray 2.60
#: ``_private/authentication/http_token_authentication.py``), told apart from a proxy's own.
RAY_REFUSALS = ("Unauthorized: Missing authentication token", "Forbidden: Invalid authentication token")
#: Seconds an endpoint's shared session stays open after its last user (followers poll every few seconds).
SESSION_LINGER_SECONDS = 30.0


class DashboardUnavailableError(RuntimeError):
    """The Ray dashboard (or the API server proxying it) answered a transient error status.

    A ``RuntimeError``, as Ray's ``JobSubmissionClient`` raises for an error answer
    (:class:`~airflow_provider_raytpu.dashboard.jobs.JobsApi` speaks for it here).

    :param status: the HTTP status.
    :param text: the start of the answer's body.
    """

    def __init__(self, status: int, text: str) -> None:
        self.status = status
        super().__init__(f"answered {status}: {text}")


@dataclass(frozen=True)
class HttpAnswer:
    """What an endpoint answered.

    :param status: the HTTP status code.
    :param body: the body as received.
    """

    status: int
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> Any:
        """The body as JSON."""
        return jsonlib.loads(self.body)

    def text(self, limit: int | None = None) -> str:
        """The body as text, its last ``limit`` characters at most."""
        text = self.body.decode(errors="replace")
        return text if limit is None else text[-limit:]

    @property
    def ray_refused(self) -> bool:
        """Whether Ray's token authentication refused the request (no token, or another one)."""
        return self.status in (401, 403) and any(refusal in self.text(300) for refusal in RAY_REFUSALS)


class HttpTransport(abc.ABC):
    """One HTTP endpoint of a Ray cluster (its dashboard, or a RayService's Serve proxy) as this backend reaches it.

    ``request`` and ``arequest`` answer every status code (they raise only when nothing
    answered: ``OSError`` and the like).
    """

    @property
    def ray_auth_errors(self) -> bool:
        """Whether a 401/403 comes from Ray's own token authentication (and is explained as such)."""
        return True

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The base URL, no credentials in it (for the API-server proxy, the proxy URL)."""

    @property
    def browser_url(self) -> str | None:
        """The URL a browser can open, or ``None`` when only this transport's credentials reach it."""
        return self.url

    @abc.abstractmethod
    def request(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                headers: Mapping[str, str] | None = None, timeout: float | None = 30.0) -> HttpAnswer:
        """Send one request to ``path`` (below :attr:`url`).

        :param json: a body sent as JSON.
        :param data: a body sent as is.
        :param timeout: seconds to wait for the answer; ``None``: no limit.
        """

    @abc.abstractmethod
    async def arequest(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                       headers: Mapping[str, str] | None = None, timeout: float | None = 30.0) -> HttpAnswer:
        """:meth:`request` without blocking the event loop."""

    @abc.abstractmethod
    def websocket(self, path: str, headers: Mapping[str, str] | None = None,
                  ) -> contextlib.AbstractAsyncContextManager[aiohttp.ClientWebSocketResponse]:
        """A WebSocket to ``path`` (e.g. Ray's job log tail); raises aiohttp's ``WSServerHandshakeError``
        when the endpoint (or a proxy on the way) answers without upgrading.

        :param headers: headers of the opening request."""


class DirectTransport(HttpTransport):
    """An endpoint reached at its URL: an explicit URL, in-cluster DNS, or the local backend's head.

    :param url: the base URL; credentials in it (``https://user:token@host``) are used for requests and
        never shown (:attr:`url` leaves them out: it goes into XComs and links).
    """

    def __init__(self, url: str) -> None:
        self._url = url

    @property
    def url(self) -> str:
        return without_credentials(self._url)

    def _join(self, path: str) -> str:
        return self._url.rstrip("/") + "/" + path.lstrip("/")

    @contextlib.contextmanager
    def session(self) -> Iterator[requests.Session]:
        """The ``requests`` session a sync request uses (one per request here)."""
        import requests

        with requests.Session() as session:
            yield session

    @contextlib.asynccontextmanager
    async def asession(self) -> AsyncIterator[aiohttp.ClientSession]:
        """The ``aiohttp`` session of this endpoint, shared on the event loop while anyone uses it."""
        async with shared_session(self._url) as session:
            yield session

    def request(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                headers: Mapping[str, str] | None = None, timeout: float | None = 30.0) -> HttpAnswer:
        with self.session() as session:
            answer = session.request(method, self._join(path), json=json, data=data, headers=dict(headers or {}),
                                     timeout=timeout)
            return HttpAnswer(answer.status_code, answer.content)

    async def arequest(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                       headers: Mapping[str, str] | None = None, timeout: float | None = 30.0) -> HttpAnswer:
        async with self.asession() as session:
            async with session.request(method, self._join(path), json=json, data=data, headers=dict(headers or {}),
                                       timeout=_aiohttp().ClientTimeout(total=timeout)) as answer:
                return HttpAnswer(answer.status, await answer.read())

    @contextlib.asynccontextmanager
    async def websocket(self, path: str, headers: Mapping[str, str] | None = None,
                        ) -> AsyncIterator[aiohttp.ClientWebSocketResponse]:
        async with self.asession() as session:
            async with session.ws_connect(self._join(path), headers=dict(headers or {}), max_msg_size=0) as ws:
                yield ws


def without_credentials(url: str) -> str:
    """``url`` without the user and password of its authority (``https://user:token@host/x`` ->
    ``https://host/x``), for what is shown: XComs, links, log lines."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def _aiohttp() -> Any:
    import aiohttp

    return aiohttp


@contextlib.asynccontextmanager
async def shared_session(url: str) -> AsyncIterator[aiohttp.ClientSession]:
    """The running event loop's ``aiohttp`` session for the endpoint at ``url``, held for the block
    (aiohttp is imported, and its default SSL contexts built, in a worker thread the first time);
    closed :data:`SESSION_LINGER_SECONDS` after its last user left, so a triggerer that followed
    thousands of clusters keeps no session for any of them."""
    from airflow_provider_raytpu.loop_shared import loop_shared

    async def make() -> aiohttp.ClientSession:
        await asyncio.to_thread(importlib.import_module, "aiohttp")
        import aiohttp

        return aiohttp.ClientSession()

    async def close(session: aiohttp.ClientSession) -> None:
        await session.close()

    async with loop_shared().lease(("http-session", url), make, close, linger=SESSION_LINGER_SECONDS) as session:
        yield session
