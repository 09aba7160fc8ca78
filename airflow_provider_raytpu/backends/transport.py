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
import logging
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from urllib.parse import urlsplit, urlunsplit
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp
    import requests
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:  # what Ray's own client says about a 401/403 of its token authentication
        from ray._private.authentication.http_token_authentication import format_authentication_http_error
    except ImportError:  # a Ray without token authentication
        format_authentication_http_error = None


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

    A ``RuntimeError``, as Ray's ``JobSubmissionClient`` raises for an error answer.

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

    #: Whether a 401/403 comes from Ray's own token authentication (and is explained as such).
    ray_auth_errors = True

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

    def job_client(self) -> JobSubmissionClient:
        """Ray's ``JobSubmissionClient`` (it also uploads ``py_modules`` and ``working_dir``), talking through this transport."""
        return _transport_job_client_class()(self)


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
    from airflow_provider_raytpu.backends.loop_shared import loop_shared

    async def make() -> aiohttp.ClientSession:
        aiohttp = await asyncio.to_thread(importlib.import_module, "aiohttp")
        return aiohttp.ClientSession()

    async def close(session: aiohttp.ClientSession) -> None:
        await session.close()

    async with loop_shared().lease(("http-session", url), make, close, linger=SESSION_LINGER_SECONDS) as session:
        yield session


def route_ray_logs() -> None:
    """Let the ``ray`` logger's records reach this process's own logging, at their own level.

    Importing Ray gives its logger a handler of its own that writes to stderr and stops
    propagation; an Airflow task log shows every stderr line as an error, so a healthy job
    submission (``INFO dashboard_sdk.py -- Uploading package ...``) looked like a failure.
    Ray's handlers are removed and the records propagate to Airflow's handlers instead.
    """
    ray_logger = logging.getLogger("ray")
    ray_logger.handlers = [h for h in ray_logger.handlers if not type(h).__module__.startswith("ray.")]
    ray_logger.propagate = True


@cache
def _transport_job_client_class() -> type[JobSubmissionClient]:
    """A ``JobSubmissionClient`` whose every request (the version check in its constructor too)
    goes through an :class:`HttpTransport`; made once, on first use (it imports Ray, whose logs it
    then routes into this process's logging: :func:`route_ray_logs`)."""
    import requests
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    route_ray_logs()

    try:  # what Ray's own client says about a 401/403 of its token authentication
        from ray._private.authentication.http_token_authentication import format_authentication_http_error
    except ImportError:  # a Ray without token authentication
        format_authentication_http_error = None

    class TransportJobSubmissionClient(JobSubmissionClient):  # type: ignore[misc]
        def __init__(self, transport: HttpTransport) -> None:
            self._transport = transport
            super().__init__(address=transport.url)

        def _do_request(self, method: str, endpoint: str, *, data: bytes | None = None,
                        json_data: dict[str, Any] | None = None, **kwargs: Any) -> requests.Response:
            headers = {"Accept": "application/json", **(self._headers or {})}
            if data is not None:
                headers["Content-Type"] = "application/octet-stream"
            timeout = kwargs.get("timeout") or (UPLOAD_TIMEOUT_SECONDS if data is not None else REQUEST_TIMEOUT_SECONDS)
            answer = self._transport.request(method, endpoint, json=json_data, data=data, headers=headers,
                                             timeout=timeout)
            if answer.status in TRANSIENT_STATUSES:
                raise DashboardUnavailableError(answer.status, answer.text(300))
            if (self._transport.ray_auth_errors or answer.ray_refused) and format_authentication_http_error:
                if explained := format_authentication_http_error(answer.status, answer.text()):
                    raise AuthenticationError(f"{explained} (on Kubernetes, the raytpu connection's ray_token_auth "
                                              "sends each cluster's token from the Secret KubeRay made for it)")
            response = requests.Response()
            response.status_code, response._content = answer.status, answer.body
            response.url = self._transport.url.rstrip("/") + endpoint
            return response

    return TransportJobSubmissionClient
