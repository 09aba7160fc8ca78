"""The state part of :class:`tests.support.fake_apiserver.server.FakeKubeApiServer`'s public API: change callbacks and
waits, history compaction, objects read and written by tests (thread-safe, through the same event path
as API writes), and service proxy targets.

A mixin: the server owns the registry, the change feed and the service proxy it uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._proxy import ServiceProxy
from ._registry import Registry
from ._resources import ResourceType
from ._watches import ChangeEvent, ChangeFeed


class StateApi:
    """What a test reads, writes and waits for; delegates to ``_registry``, ``_feed`` and ``_proxy``."""

    _registry: Registry
    _feed: ChangeFeed
    _proxy: ServiceProxy

    def on_change(self, callback: Callable[[ChangeEvent], None]) -> Callable[[], None]:
        """Call ``callback(event)`` on the server loop after every committed change, in order.
        Returns a function that unsubscribes."""
        return self._feed.on_change(callback)

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Block until ``predicate()`` is truthy (re-checked after every commit and every watch
        opened/closed, at the latest every 0.5 s; never spins).
        The predicate runs without the server lock, so it may use an API client. Returns its value;
        raises TimeoutError."""
        return self._feed.wait_for(predicate, timeout)

    def compact(self) -> None:
        """Drop the whole event history: any watch resuming from an older resourceVersion gets 410."""
        self._registry.compact()

    # -- state helpers (thread-safe, go through the same event path as API writes) ------------

    @property
    def resource_version(self) -> str:
        return self._registry.resource_version

    def get_object(self, resource: str | ResourceType, namespace: str, name: str) -> dict | None:
        return self._registry.get_object(resource, namespace, name)

    def list_objects(self, resource: str | ResourceType, namespace: str | None = None, *,
                     label_selector: str | dict | None = None, field_selector: str | None = None) -> list[dict]:
        return self._registry.list_objects(resource, namespace, label_selector=label_selector,
                                           field_selector=field_selector)

    def put_object(self, obj: dict) -> dict:
        """Create or replace ``obj`` as given, status included (no API validation); emits ADDED or
        MODIFIED. uid/creationTimestamp of an existing object are kept; generation is bumped on a
        spec change."""
        return self._registry.put_object(obj)

    def create_object(self, obj: dict, *, namespace: str | None = None) -> dict:
        """Create like ``POST`` does (validation, generateName, status reset); raises ApiError."""
        return self._registry.create_object(obj, namespace=namespace)

    def patch_object(self, resource: str | ResourceType, namespace: str, name: str, patch: dict, *,
                     subresource: str | None = None) -> dict:
        """Merge-patch like ``PATCH`` does (status ignored on the main resource); raises ApiError."""
        return self._registry.patch_object(resource, namespace, name, patch, subresource=subresource)

    def set_status(self, resource: str | ResourceType, namespace: str, name: str, status: dict | None) -> dict:
        """Replace ``.status`` through the status subresource path (watchers see MODIFIED)."""
        return self._registry.set_status(resource, namespace, name, status)

    def delete_object(self, resource: str | ResourceType, namespace: str, name: str, *,
                      force: bool = False) -> dict | None:
        """Delete like ``DELETE`` does (finalizers respected) or, with ``force``, remove at once.
        Returns the deleted/terminating object, or None if there was none."""
        return self._registry.delete_object(resource, namespace, name, force=force)

    def register_service_proxy(self, namespace: str, service: str, port: str | int, target_url: str) -> None:
        """Serve ``/api/v1/namespaces/<ns>/services/<service>:<port>/proxy/...`` by forwarding to
        ``target_url`` (e.g. a local Ray dashboard); ``service="*"``: every Service of the namespace
        without a registration of its own. Without a registration the proxy answers 503
        ``no endpoints available for service``, like a service without ready endpoints."""
        self._proxy.register(namespace, service, port, target_url)
