"""Raw JSON from the Kubernetes API through the shared async client: lists by page, GETs and watch streams.

kubernetes_asyncio's ``watch.Watch()`` builds a second ``ApiClient`` (with its own SSL context
and connection pool) only to deserialise events into models; an informer needs the raw
objects, so the stream is read here line by line from the shared client's own response:
one JSON event per line, as the API server sends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.client.rest import RESTResponse

from airflow_provider_raytpu.backends.kuberay.objects import api_retry

if TYPE_CHECKING:
    from kubernetes_asyncio import client as k8s_async

    from airflow_provider_raytpu.backends.kuberay.shared_client import SharedApiClient

#: Objects per list request (a page of a few hundred objects parses in milliseconds on the loop).
LIST_PAGE = 250
#: Events handled from a stream's buffer before other tasks get the loop.
EVENTS_PER_TURN = 50
#: A watch stream silent this long (no event, no bookmark) is taken for dead and opened again.
WATCH_READ_TIMEOUT = 300.0
#: Seconds one GET of an object or a page of a list may take.
GET_TIMEOUT_SECONDS = 60.0

Query = Sequence[tuple[str, str]]
T = TypeVar("T")


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for one synchronous burst of parsing.

    A page of a few hundred objects is tens of thousands of containers, acyclic and freed by
    reference counting once digested; a collection in the middle of the burst would only move
    them to the oldest generation, and enough of them there set off a full collection, which
    stops the triggerer's loop for as long as it takes to walk the whole heap (Airflow's
    included: 150-250 ms here).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def collection_path(namespace: str, plural: str, group: str = "", version: str = "v1") -> str:
    """``/api/v1/namespaces/<ns>/<plural>`` or ``/apis/<group>/<version>/namespaces/<ns>/<plural>``."""
    root = f"/apis/{group}/{version}" if group else f"/api/{version}"
    return f"{root}/namespaces/{namespace}/{plural}"


async def _open(client: k8s_async.ApiClient, path: str, query: Query,
                timeout: float | aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
    response: aiohttp.ClientResponse = await client.call_api(
        path, "GET", query_params=list(query), header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True,
        _request_timeout=timeout,
    )
    if not 200 <= response.status < 300:
        try:
            body = await response.read()
        finally:
            response.release()
        # The stub says ClientResponse; ApiException reads RESTResponse's .data and .getheaders() (as rest.py passes).
        raise ApiException(http_resp=RESTResponse(response, body))  # type: ignore[arg-type]
    return response


async def get_json(client: k8s_async.ApiClient, path: str, query: Query = (), timeout: float | None = None,
                   parse: Callable[[bytes], Any] = json.loads) -> Any:
    """One GET answered with JSON, parsed with the garbage collector paused (a non-2xx answer
    raises ``ApiException``, as the generated clients do); ``timeout`` defaults to :data:`GET_TIMEOUT_SECONDS`."""
    response = await _open(client, path, query, GET_TIMEOUT_SECONDS if timeout is None else timeout)
    try:
        body = await response.read()
    finally:
        response.release()
    with collector_paused():
        return parse(body)


@overload
def list_pages(shared: SharedApiClient, path: str,
               query: Query = ()) -> AsyncIterator[tuple[list[dict[str, Any]], str | None]]: ...


@overload
def list_pages(shared: SharedApiClient, path: str, query: Query = (), *,
               digest: Callable[[list[dict[str, Any]]], T]) -> AsyncIterator[tuple[T, str | None]]: ...


@overload
def list_pages(shared: SharedApiClient, path: str, query: Query,
               digest: Callable[[list[dict[str, Any]]], T]) -> AsyncIterator[tuple[T, str | None]]: ...


async def list_pages(shared: SharedApiClient, path: str, query: Query = (),
                     digest: Callable[[list[dict[str, Any]]], object] = list,
                     ) -> AsyncIterator[tuple[object, str | None]]:
    """The objects of a collection, :data:`LIST_PAGE` at a time, each page passed through ``digest``
    right after parsing (the parsed page is not kept); the last page comes with the list's
    resourceVersion. Transient failures are retried, as for every other read."""
    token: str | None = None

    def parse(body: bytes) -> tuple[object, dict[str, Any]]:
        answer = json.loads(body)
        return digest(answer.get("items") or []), answer.get("metadata") or {}

    while True:
        page = [*query, ("limit", str(LIST_PAGE)), *((("continue", token),) if token else ())]
        digested, metadata = await api_retry()(shared.call)(
            lambda client, page=page: get_json(client, path, page, parse=parse)
        )
        token = metadata.get("continue")
        yield digested, None if token else str(metadata.get("resourceVersion") or "")
        if not token:
            return
        await asyncio.sleep(0)


async def watch_events(client: k8s_async.ApiClient, path: str, resource_version: str,
                       timeout_seconds: int) -> AsyncIterator[tuple[str, Mapping[str, Any]]]:
    """``(type, object)`` of each event of one watch request from ``resource_version``, with bookmarks,
    until the API server ends the stream (after ``timeout_seconds``).

    Raises ``ApiException`` when the request is refused (410: the version is too old), and
    aiohttp's errors when the stream breaks. An ``ERROR`` event is yielded as it comes.
    """
    query = [("watch", "true"), ("resourceVersion", resource_version), ("allowWatchBookmarks", "true"),
             ("timeoutSeconds", str(timeout_seconds))]
    response = await _open(client, path, query,
                           aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=WATCH_READ_TIMEOUT))
    try:
        handled = 0
        async for line in response.content:
            if not line.strip():
                continue
            event = json.loads(line)
            yield event.get("type", ""), event.get("object") or {}
            handled += 1
            if handled % EVENTS_PER_TURN == 0:
                await asyncio.sleep(0)
    finally:
        response.close()


def slim(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as an informer keeps it: ``managedFields`` and pod template specs dropped (status
    readers use the objects' metadata, spec counts and status, and pod templates' metadata only)."""
    (obj.get("metadata") or {}).pop("managedFields", None)
    spec = obj.get("spec") or {}
    for cluster_spec in (spec, spec.get("rayClusterConfig") or {}):
        groups = [cluster_spec.get("headGroupSpec") or {}, *(cluster_spec.get("workerGroupSpecs") or [])]
        for group in groups:
            (group.get("template") or {}).pop("spec", None)
    return obj
