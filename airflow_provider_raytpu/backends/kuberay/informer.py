"""One list+watch per (connection, namespace, kind), shared by every trigger that waits on an object of that kind.

An :class:`Informer` keeps the latest version of every object of its kind in its namespace
(slimmed: :func:`~airflow_provider_raytpu.backends.kuberay.watch.slim`, and kept as JSON text: a
thousand objects as a thousand strings rather than a few hundred thousand Python objects, which
would make the interpreter's full garbage collections, which stop the triggerer's loop, longer
and more frequent). Subscribers get a parsed copy per change and keep none. It starts with the
first subscriber and stops when the last one leaves. It lists once, then watches from the
list's resourceVersion with bookmarks and a long ``timeoutSeconds``; it resumes from the last
version it saw after a cut stream, lists again on 410 Gone, waits a jittered backoff after
failures, and after repeated failures (an API server or proxy that cuts every watch) lists
every ``poll_interval`` seconds for a while before it tries watching again.

A :class:`Subscription` hands one waiter its object: now, and after every change (``None``
when it does not exist). An object the informer has not seen is looked up with one GET before
it is reported missing, so a cluster created just before its sensor deferred is never taken
for gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, cast

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from airflow_provider_raytpu.backends.kuberay.objects import GROUP, VERSION, api_retry, explain_api_error
from airflow_provider_raytpu.backends.kuberay.watch import collection_path, get_json, list_pages, slim, watch_events
from airflow_provider_raytpu.loop_shared import loop_shared

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.kuberay.objects import CustomObjects
    from airflow_provider_raytpu.backends.kuberay.shared_client import SharedApiClient

log = logging.getLogger(__name__)

#: ``timeoutSeconds`` of one watch request; the API server ends the stream then and it is opened again.
WATCH_SECONDS = 3600
WATCH_FAILURES_BEFORE_POLLING = 3
POLL_BEFORE_WATCHING_AGAIN_SECONDS = 120.0
#: The longest wait between attempts after failures (each wait is drawn at random up to its bound).
BACKOFF_CAP_SECONDS = 30.0
#: Subscribers told of a change before other tasks get the loop.
NOTIFY_PER_TURN = 100


class Subscription:
    """One waiter's view of one object: its latest version, handed out once per change.

    :param name: the object's name.
    :param poll_interval: how often the waiter wants it read when watching is not possible.
    """

    def __init__(self, name: str, poll_interval: float) -> None:
        self.name = name
        self.poll_interval = poll_interval
        self._pending: dict[str, Any] | None = None
        self._offered = False
        self._error: BaseException | None = None
        self._changed = asyncio.Event()

    def offer(self, obj: dict[str, Any] | None) -> None:
        self._pending, self._offered = obj, True
        self._changed.set()

    def offer_first(self, obj: dict[str, Any] | None) -> None:
        """The initial state, unless an event already said something newer."""
        if not self._offered:
            self.offer(obj)

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._changed.set()

    async def next(self) -> dict[str, Any] | None:
        """The object after its next change (at once for the first call); ``None``: it does not exist."""
        await self._changed.wait()
        self._changed.clear()
        if self._error is not None:
            raise self._error
        obj, self._pending = self._pending, None
        return obj

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> dict[str, Any] | None:
        return await self.next()


class Informer:
    """The objects of one kind in one namespace, kept current for every subscriber.

    :param shared: the connection's shared async client.
    :param objects: the kind (its plural and names for messages).
    :param namespace: the namespace watched.
    """

    def __init__(self, shared: SharedApiClient, objects: CustomObjects, namespace: str) -> None:
        self.shared = shared
        self.objects = objects
        self.namespace = namespace
        self.path = collection_path(namespace, objects.plural, GROUP, VERSION)
        self.store: dict[str, str] = {}
        self.resource_version: str | None = None
        self.lists = 0
        self.watches = 0
        self._subscribers: dict[str, set[Subscription]] = {}
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._streamed = False

    @property
    def where(self) -> str:
        return f"{self.objects.kind}s in {self.namespace}"

    @contextlib.asynccontextmanager
    async def subscribe(self, name: str, poll_interval: float) -> AsyncIterator[Subscription]:
        """Follow one object for as long as the caller stays in the block."""
        subscription = Subscription(name, poll_interval)
        self._subscribers.setdefault(name, set()).add(subscription)
        if self._task is None:
            self._synced.clear()
            self._task = asyncio.create_task(self._run(), name=f"raytpu-informer-{self.where}")
        try:
            await self._first(subscription)
            yield subscription
        finally:
            await self._leave(subscription)

    async def _first(self, subscription: Subscription) -> None:
        await self._synced.wait()
        if subscription._offered:
            return
        text = self.store.get(subscription.name)
        subscription.offer_first(json.loads(text) if text is not None else await self._get(subscription.name))

    async def _get(self, name: str) -> dict[str, Any] | None:
        try:
            return slim(await api_retry()(self.shared.call)(lambda client: get_json(client, f"{self.path}/{name}")))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise explain_api_error(exc, "get", self.objects.resource, self.namespace) from exc

    async def _leave(self, subscription: Subscription) -> None:
        subscribers = self._subscribers.get(subscription.name, set())
        subscribers.discard(subscription)
        if not subscribers:
            self._subscribers.pop(subscription.name, None)
        if not self._subscribers and self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if self._task is None:  # no new subscriber started it again meanwhile
                self.store.clear()
                self.resource_version = None

    # -- list and watch -----------------------------------------------------------------------

    async def _run(self) -> None:
        failures = rejected = 0
        polling_until = 0.0
        while True:
            self._streamed = False
            try:
                if self.resource_version is None or time.monotonic() < polling_until:
                    await self._list()
                if time.monotonic() < polling_until:
                    await asyncio.sleep(min((s.poll_interval for subs in self._subscribers.values() for s in subs),
                                            default=10.0))
                    continue
                await self._watch()
                failures = rejected = 0
                continue
            except ApiException as exc:
                if exc.status == 410:
                    log.info("Watch of %s expired (410 Gone); listing again", self.where)
                    self.resource_version = None
                    continue
                rejected = rejected + 1 if exc.status == 401 else 0
                if exc.status == 403 or rejected > 1:
                    self._fail_all(explain_api_error(exc, "watch", self.objects.resource, self.namespace))
                    return
                if rejected:  # the client was replaced: try once more at once
                    continue
                failures = 1 if self._streamed else failures + 1
                log.warning("Watch of %s failed (%s); retry %d", self.where, exc.status, failures)
            except (TimeoutError, aiohttp.ClientError, ConnectionError, ValueError) as exc:
                failures = 1 if self._streamed else failures + 1
                log.warning("Watch of %s dropped (%s); retry %d", self.where, str(exc) or type(exc).__name__, failures)
            except Exception as exc:  # handed to every waiter, which ends with it
                self._fail_all(exc)
                return
            if failures >= WATCH_FAILURES_BEFORE_POLLING:
                log.warning("Watching %s failed %d times; listing every poll interval for %s s, then watching again",
                            self.where, failures, POLL_BEFORE_WATCHING_AGAIN_SECONDS)
                failures, polling_until = 0, time.monotonic() + POLL_BEFORE_WATCHING_AGAIN_SECONDS
                continue
            await asyncio.sleep(random.uniform(0, min(BACKOFF_CAP_SECONDS, 0.25 * 2**failures)))

    async def _list(self) -> None:
        def digest(items: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any] | None]]:
            digested = []
            for obj in items:
                name = obj["metadata"]["name"]
                digested.append((name, json.dumps(slim(obj)), obj if name in self._subscribers else None))
            return digested

        fresh: dict[str, str] = {}
        async for page, page_version in list_pages(self.shared, self.path, digest=digest):
            resource_version = page_version  # the last page's is the list's
            changed: list[tuple[str, dict[str, Any] | None]] = []
            for name, text, obj in page:
                fresh[name] = text
                if obj is not None and self.store.get(name) != text:
                    changed.append((name, obj))
            del page
            await self._notify(changed)
        gone = [name for name in self.store if name not in fresh]
        self.store, self.resource_version = fresh, resource_version
        self.lists += 1
        self._synced.set()
        await self._notify([(name, None) for name in gone])

    async def _watch(self) -> None:
        async with self.shared.lease() as client:
            self.watches += 1
            try:
                async for kind, obj in watch_events(client, self.path, self.resource_version or "", WATCH_SECONDS):
                    await self._apply(kind, obj)
            except ApiException as exc:
                if exc.status == 401:
                    self.shared.retire(client)
                raise

    async def _apply(self, kind: str, obj: Any) -> None:
        metadata: dict[str, Any] = obj.get("metadata") or {}
        if kind == "ERROR":
            raise ApiException(status=int(obj.get("code") or 500), reason=obj.get("message") or "watch error")
        self.resource_version = metadata.get("resourceVersion") or self.resource_version
        self._streamed = True
        if kind == "BOOKMARK":
            return
        name = cast(str, metadata.get("name"))  # JSON: the object of every non-BOOKMARK event has a name
        if kind == "DELETED":
            self.store.pop(name, None)
            await self._notify([(name, None)])
        else:
            self.store[name] = json.dumps(slim(obj))
            await self._notify([(name, obj)])

    async def _notify(self, changes: list[tuple[str, dict[str, Any] | None]]) -> None:
        told = 0
        for name, obj in changes:
            for subscription in list(self._subscribers.get(name, ())):
                subscription.offer(obj)
                told += 1
                if told % NOTIFY_PER_TURN == 0:
                    await asyncio.sleep(0)

    def _fail_all(self, error: BaseException) -> None:
        self._synced.set()
        for subscribers in self._subscribers.values():
            for subscription in subscribers:
                subscription.fail(error)
        self._task = None
        self.store.clear()
        self.resource_version = None


async def informer(shared: SharedApiClient, objects: CustomObjects, namespace: str) -> Informer:
    """The running event loop's informer for ``objects`` in ``namespace`` on this connection."""

    async def make() -> Informer:
        return Informer(shared, objects, namespace)

    return await loop_shared().get(("informer", objects.clients.settings.conn_id, namespace, objects.plural), make)
