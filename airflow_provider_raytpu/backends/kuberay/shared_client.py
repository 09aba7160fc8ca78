"""One async Kubernetes client per connection for every trigger on an event loop (the triggerer's).

The client comes from the connection's own Airflow hook (``AsyncKubernetesHook`` or
``GKEKubernetesAsyncHook``: kubeconfig, in-cluster, exec plugins, GKE tokens), so no credential
handling is written here; only when it is asked for is decided here:

- reading the connection, loading its kubeconfig (which writes temporary files) and building
  the client's SSL context run in a worker thread, never on the event loop;
- bearer tokens are reloaded through the hook every :data:`CREDENTIALS_MAX_AGE_SECONDS`
  (exec plugins run again, GKE tokens are fetched before they expire; a static token is
  simply read again), from kubernetes_asyncio's ``refresh_api_key_hook``, so watches and
  connections stay open;
- the client itself is replaced after :data:`CLIENT_MAX_AGE_SECONDS` or when the API server
  rejects its credentials (401): the replacement reads the connection again. Requests in
  flight finish on the old client, which is closed when its last one ends;
- long-lived streams (a job's log tail through the service proxy) get connections of their own
  (:meth:`SharedApiClient.stream`), outside the client's pool: kubernetes_asyncio caps that at
  ``connection_pool_maxsize`` (100) connections, and a hundred open tails would hold them all
  while every other request waited.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from airflow_provider_raytpu.version import __version__

if TYPE_CHECKING:
    import aiohttp
    from kubernetes_asyncio import client as k8s_async

log = logging.getLogger(__name__)

#: How the provider's requests name themselves to the API server (its audit log, ``apiserver_request_total``).
USER_AGENT = f"airflow-provider-raytpu/{__version__}"
CLIENT_MAX_AGE_SECONDS = 3600.0
CREDENTIALS_MAX_AGE_SECONDS = 300.0

T = TypeVar("T")


def _load_configuration(hook: Any) -> tuple[Any, dict[str, str]]:
    """Run in a worker thread: the hook's client configuration and default headers, as its ``get_conn`` makes them."""

    async def load() -> tuple[Any, dict[str, str]]:
        async with hook.get_conn() as api_client:
            return copy.deepcopy(api_client.configuration), dict(api_client.default_headers)

    return asyncio.run(load())


def _build_client(loop: asyncio.AbstractEventLoop, configuration: Any) -> k8s_async.ApiClient:
    """Run in a worker thread: the client, bound to ``loop`` (its constructor builds the SSL context,
    up to tens of milliseconds with the system CA store, and aiohttp binds to the running loop)."""
    from airflow_provider_raytpu.compat import timeout_async_api_client

    asyncio.events._set_running_loop(loop)  # aiohttp takes the loop it binds to from here; nothing runs on it
    try:
        return timeout_async_api_client(configuration)
    finally:
        asyncio.events._set_running_loop(None)


def _build_streams(loop: asyncio.AbstractEventLoop, configuration: Any) -> aiohttp.ClientSession:
    """Run in a worker thread: a session for long-lived streams with the client's TLS settings and no limit
    on its connections (each stream is one connection for its whole life)."""
    from kubernetes_asyncio.client.rest import RESTClientObject

    asyncio.events._set_running_loop(loop)  # as in _build_client
    try:
        session: aiohttp.ClientSession = RESTClientObject(configuration, maxsize=0).pool_manager
        return session
    finally:
        asyncio.events._set_running_loop(None)


def _adopt_credentials(configuration: Any, loaded: Any, headers: dict[str, str]) -> None:
    """Put the bearer token a hook loaded into ``configuration`` (GKE's hook sends it as a default header)."""
    authorization = headers.get("Authorization") or headers.get("authorization") or ""
    if authorization.startswith("Bearer "):
        configuration.api_key = {**loaded.api_key, "BearerToken": authorization[len("Bearer "):]}
        configuration.api_key_prefix = {**loaded.api_key_prefix, "BearerToken": "Bearer"}
    else:
        configuration.api_key = dict(loaded.api_key)
        configuration.api_key_prefix = dict(loaded.api_key_prefix)


class _Generation:
    """One client, the hook it came from, and who is using it."""

    def __init__(self, hook: Any, client: k8s_async.ApiClient) -> None:
        self.hook = hook
        self.client = client
        self.born = time.monotonic()
        self.credentials_at = self.born
        self.users = 0
        self.retired = False
        self.closed = False
        self.refresh_lock = asyncio.Lock()
        self._streams: aiohttp.ClientSession | None = None
        self._streams_lock = asyncio.Lock()

    async def streams(self) -> aiohttp.ClientSession:
        """The session for this client's long-lived streams (made on first use)."""
        async with self._streams_lock:
            if self._streams is None:
                self._streams = await asyncio.to_thread(_build_streams, asyncio.get_running_loop(),
                                                        self.client.configuration)
            return self._streams

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            await self.client.close()
            if self._streams is not None:
                await self._streams.close()


class SharedApiClient:
    """The async Kubernetes client of one connection, shared by every caller on one event loop.

    :param make_hook: makes the connection's async hook (called in a worker thread, once per client).
    :param source: what the hook is made from (the connection's settings), to tell when it changed.
    """

    def __init__(self, make_hook: Callable[[], Any], source: Any = None) -> None:
        self._make_hook = make_hook
        self.source = source
        self._generation: _Generation | None = None
        self._open: set[_Generation] = set()
        self._lock = asyncio.Lock()
        self._closed = False
        #: How many clients were made so far (the first, then one per replacement).
        self.clients_made = 0

    def replace_hook(self, make_hook: Callable[[], Any], source: Any = None) -> None:
        """Use ``make_hook`` from the next client on (the connection changed); the current one is retired."""
        self._make_hook = make_hook
        self.source = source
        if self._generation is not None:
            self._generation.retired = True

    @contextlib.asynccontextmanager
    async def _held(self) -> AsyncIterator[_Generation]:
        generation = await self._current()
        generation.users += 1
        try:
            yield generation
        finally:
            generation.users -= 1
            if generation.retired and generation.users == 0:
                await self._close(generation)

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[k8s_async.ApiClient]:
        """The current client, kept open until the caller is done with it."""
        async with self._held() as generation:
            yield generation.client

    @contextlib.asynccontextmanager
    async def stream(self) -> AsyncIterator[tuple[k8s_async.ApiClient, aiohttp.ClientSession]]:
        """The current client and its session for long-lived streams (a connection each, outside the
        client's pool), both kept open until the caller is done with them."""
        async with self._held() as generation:
            yield generation.client, await generation.streams()

    async def call(self, request: Callable[[k8s_async.ApiClient], Awaitable[T]]) -> T:
        """``request(client)``; after a 401 once more on a new client (which reads the connection again)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        for attempt in (1, 2):
            async with self.lease() as client:
                try:
                    return await request(client)
                except ApiException as exc:
                    if exc.status != 401 or attempt == 2:
                        raise
                    self.retire(client)
        raise AssertionError("unreachable")

    def retire(self, client: k8s_async.ApiClient) -> None:
        """The API server rejected ``client``'s credentials: the next lease gets a new client."""
        generation = self._generation
        if generation is not None and generation.client is client and not generation.retired:
            log.info("The Kubernetes API server rejected the connection's credentials; making a new client")
            generation.retired = True

    async def _current(self) -> _Generation:
        generation = self._generation
        if generation is not None and not generation.retired \
                and time.monotonic() - generation.born < CLIENT_MAX_AGE_SECONDS:
            return generation
        async with self._lock:
            generation = self._generation
            if generation is not None and not generation.retired \
                    and time.monotonic() - generation.born < CLIENT_MAX_AGE_SECONDS:
                return generation
            if self._closed:
                raise RuntimeError("the shared Kubernetes client is closed")
            fresh = await self._new_generation()
            self._generation = fresh
            if generation is not None:
                generation.retired = True
                if generation.users == 0:
                    await self._close(generation)
            return fresh

    async def _new_generation(self) -> _Generation:
        hook = await asyncio.to_thread(self._make_hook)
        loaded, headers = await asyncio.to_thread(_load_configuration, hook)
        configuration = copy.deepcopy(loaded)
        _adopt_credentials(configuration, loaded, headers)
        client = await asyncio.to_thread(_build_client, asyncio.get_running_loop(), configuration)
        client.default_headers.update({k: v for k, v in headers.items() if k.lower() != "authorization"})
        client.user_agent = USER_AGENT
        generation = _Generation(hook, client)
        if "BearerToken" in configuration.api_key:
            configuration.refresh_api_key_hook = self._refresher(generation)
        self.clients_made += 1
        self._open.add(generation)
        return generation

    async def _close(self, generation: _Generation) -> None:
        self._open.discard(generation)
        await generation.aclose()

    @staticmethod
    def _refresher(generation: _Generation) -> Callable[[Any], Awaitable[None]]:
        async def refresh(configuration: Any) -> None:
            if time.monotonic() - generation.credentials_at < CREDENTIALS_MAX_AGE_SECONDS:
                return
            async with generation.refresh_lock:
                if time.monotonic() - generation.credentials_at < CREDENTIALS_MAX_AGE_SECONDS:
                    return
                loaded, headers = await asyncio.to_thread(_load_configuration, generation.hook)
                _adopt_credentials(configuration, loaded, headers)
                generation.credentials_at = time.monotonic()

        return refresh

    async def auth_headers(self, client: k8s_async.ApiClient) -> dict[str, str]:
        """The headers that authenticate ``client``'s requests (for a request it does not make itself)."""
        headers = dict(client.default_headers)
        for setting in (await client.configuration.auth_settings()).values():
            if setting.get("in") == "header" and setting.get("value"):
                headers[setting["key"]] = setting["value"]
        return headers

    async def aclose(self) -> None:
        """Close the client (the event loop is ending)."""
        self._closed = True
        for generation in list(self._open):
            await self._close(generation)
