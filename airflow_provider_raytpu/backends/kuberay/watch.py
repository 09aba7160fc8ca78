"""Watch one KubeRay object and follow it through dropped streams, expired versions and proxies that cut watches."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
from kubernetes_asyncio import client as k8s_async
from kubernetes_asyncio import watch as k8s_watch
from kubernetes_asyncio.client.exceptions import ApiException as AsyncApiException

from airflow_provider_raytpu.backends.kuberay.objects import GROUP, VERSION, api_retry, explain_api_error

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.kuberay.clients import KubeClients
    from airflow_provider_raytpu.backends.kuberay.objects import CustomObjects

log = logging.getLogger(__name__)

WATCH_SECONDS = 240
WATCH_FAILURES_BEFORE_POLLING = 3
POLL_BEFORE_WATCHING_AGAIN_SECONDS = 120.0

T = TypeVar("T")


async def watch_object(
    clients: KubeClients,
    objects: CustomObjects,
    name: str,
    namespace: str,
    poll_interval: float,
    read: Callable[[k8s_async.ApiClient, dict[str, Any] | None], Awaitable[T]],
) -> AsyncIterator[T]:
    """Watch one custom object (field selector on its name) and yield ``read(client, object)`` on every change.

    ``object`` is ``None`` when it does not exist or was deleted. Resumes from the last
    resourceVersion after a dropped stream, lists again on 410 Gone, and after repeated
    watch failures (e.g. a proxy that cuts streams) polls every ``poll_interval`` seconds
    for a while before it tries watching again.

    :param clients: the connection's clients (an async one is opened per stream).
    :param objects: the object's kind.
    """
    kind, plural = objects.kind, objects.plural
    failures = 0
    polling_until = 0.0
    resource_version: str | None = None
    while True:
        try:
            async with clients.async_api_client() as api_client:
                api = k8s_async.CustomObjectsApi(api_client)
                if resource_version is None:
                    listed = await api_retry()(api.list_namespaced_custom_object)(
                        GROUP, VERSION, namespace, plural, field_selector=f"metadata.name={name}"
                    )
                    resource_version = listed["metadata"]["resourceVersion"]
                    items = listed.get("items") or []
                    yield await read(api_client, items[0] if items else None)
                if failures >= WATCH_FAILURES_BEFORE_POLLING:
                    log.warning("Watching %s %s failed %d times; polling every %s s for %s s, then watching again",
                                kind, name, failures, poll_interval, POLL_BEFORE_WATCHING_AGAIN_SECONDS)
                    failures, polling_until = 0, time.monotonic() + POLL_BEFORE_WATCHING_AGAIN_SECONDS
                if time.monotonic() < polling_until:
                    await asyncio.sleep(poll_interval)
                    resource_version = None
                    continue
                async with k8s_watch.Watch() as stream:
                    async for event in stream.stream(
                        api.list_namespaced_custom_object, GROUP, VERSION, namespace, plural,
                        field_selector=f"metadata.name={name}", resource_version=resource_version,
                        timeout_seconds=WATCH_SECONDS, allow_watch_bookmarks=True,
                    ):
                        obj = event["raw_object"]
                        resource_version = obj.get("metadata", {}).get("resourceVersion", resource_version)
                        if event["type"] == "BOOKMARK":
                            continue
                        failures = 0
                        yield await read(api_client, None if event["type"] == "DELETED" else obj)
        except AsyncApiException as exc:
            if exc.status == 410:
                log.info("Watch of %s %s expired (410 Gone); listing again", kind, name)
                resource_version = None
                continue
            if exc.status in (401, 403):
                raise explain_api_error(exc, "watch", objects.resource, namespace) from exc
            failures += 1
            log.warning("Watch of %s %s failed (%s); retry %d", kind, name, exc.status, failures)
            await asyncio.sleep(min(2**failures * 0.25, poll_interval))
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            failures += 1
            log.warning("Watch of %s %s dropped (%s); retry %d", kind, name, exc, failures)
            await asyncio.sleep(min(2**failures * 0.25, poll_interval))
