"""Watch fan-out: the change history, open watch streams, ``on_change`` subscribers and ``wait_for``.

Every committed change is published here with the registry's lock held, kept in a bounded
history (for resuming from a resourceVersion; older ones get 410 Expired), and dispatched on
the server's event loop, in commit order, to every open watch and every subscriber.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ._errors import ApiError, status_body
from ._http import abort
from ._resources import ResourceType
from ._selectors import fields_match, labels_match, parse_field_selector, parse_label_selector

if TYPE_CHECKING:
    from ._store import ObjectStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChangeEvent:
    """A committed change, as seen by watches and ``on_change`` callbacks."""

    type: str  # ADDED, MODIFIED, DELETED
    resource: ResourceType
    namespace: str
    name: str
    object: dict
    old_object: dict | None
    resource_version: int

    @property
    def plural(self) -> str:
        return self.resource.plural


class Watch:
    """One open watch stream (state lives on the server loop)."""

    def __init__(self, res: ResourceType, namespace: str | None, label_reqs, field_reqs, start_rv: int):
        self.res = res
        self.namespace = namespace
        self.label_reqs = label_reqs
        self.field_reqs = field_reqs
        self.start_rv = start_rv
        self.progress_rv = start_rv
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cut = False

    def _selected(self, obj: dict | None) -> bool:
        if obj is None:
            return False
        if self.namespace is not None and obj.get("metadata", {}).get("namespace") != self.namespace:
            return False
        return labels_match(self.label_reqs, obj) and fields_match(self.field_reqs, obj)

    def translate(self, ev: ChangeEvent) -> tuple[str, dict] | None:
        """What this watcher sees of ``ev``: selector changes turn MODIFIED into ADDED or DELETED."""
        if ev.resource is not self.res:
            return None
        now = self._selected(ev.object)
        if ev.type == "ADDED":
            return ("ADDED", ev.object) if now else None
        if ev.type == "DELETED":
            return ("DELETED", ev.object) if now else None
        before = self._selected(ev.old_object)
        if now and before:
            return ("MODIFIED", ev.object)
        if now:
            return ("ADDED", ev.object)
        if before:
            return ("DELETED", ev.object)
        return None

    def offer(self, ev: ChangeEvent) -> None:
        if ev.resource_version <= self.start_rv:
            return
        self.progress_rv = ev.resource_version
        item = self.translate(ev)
        if item is not None:
            self.queue.put_nowait(item)

    def stop(self, cut: bool) -> None:
        self.cut = cut
        self.queue.put_nowait(("__cut__" if cut else "__stop__", None))


class ChangeFeed:
    """History, watchers and subscribers of committed changes.

    :param lock: the registry's lock; :meth:`publish` and the watch registration run under it.
    :param history_limit: how many change events are kept for watch resume.
    :param bookmark_interval: seconds between BOOKMARK events on watches that asked for them.
    """

    def __init__(self, lock: threading.RLock, history_limit: int, bookmark_interval: float | None) -> None:
        self.lock = lock
        self._cond = threading.Condition(lock)
        self.history_limit = history_limit
        self.bookmark_interval = bookmark_interval
        self.loop: asyncio.AbstractEventLoop | None = None
        self._commits = 0
        self._history: collections.deque[ChangeEvent] = collections.deque()
        self._compacted_rv = 0
        self._callbacks: list[Callable[[ChangeEvent], None]] = []
        self._watches: set[Watch] = set()

    # -- publishing (lock held) ------------------------------------------------------------------

    def publish(self, ev: ChangeEvent) -> None:
        self._history.append(ev)
        while len(self._history) > self.history_limit:
            dropped = self._history.popleft()
            self._compacted_rv = max(self._compacted_rv, dropped.resource_version)
        self._changed()
        loop = self.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._dispatch, ev)
            except RuntimeError:  # loop closing
                pass

    def compact(self, resource_version: int) -> None:
        """Drop the whole history: any watch resuming from an older resourceVersion gets 410."""
        with self.lock:
            self._history.clear()
            self._compacted_rv = resource_version

    def _changed(self) -> None:
        """Wake :meth:`wait_for` callers (call with the lock held)."""
        self._commits += 1
        self._cond.notify_all()

    def _dispatch(self, ev: ChangeEvent) -> None:
        with self.lock:
            watches, callbacks = list(self._watches), list(self._callbacks)
        for w in watches:
            w.offer(ev)
        for cb in callbacks:
            try:
                cb(ev)
            except Exception:  # a broken subscriber must not break the server
                log.exception("fakekube on_change callback failed")

    # -- subscribers -----------------------------------------------------------------------------

    def on_change(self, callback: Callable[[ChangeEvent], None]) -> Callable[[], None]:
        with self.lock:
            self._callbacks.append(callback)

        def unsubscribe() -> None:
            with self.lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return unsubscribe

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 5.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                seen = self._commits
            value = predicate()
            if value:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"condition not met within {timeout} s")
            with self._cond:
                if self._commits == seen:
                    self._cond.wait(min(remaining, 0.5))

    # -- watch streams ---------------------------------------------------------------------------

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    def cut_all(self) -> int:
        """Abruptly close every open watch stream mid-stream; returns how many. Any thread."""
        with self.lock:
            watches = list(self._watches)
        if self.loop is not None:
            for w in watches:
                self.loop.call_soon_threadsafe(w.stop, True)
        return len(watches)

    def end_all(self) -> None:
        """End every open watch stream cleanly (on the server loop, at shutdown)."""
        with self.lock:
            watches = list(self._watches)
        for w in watches:
            w.stop(False)

    def _open(self, store: ObjectStore, res: ResourceType, namespace: str | None, lreqs, freqs,
              rv_param: str) -> tuple[Watch, list[tuple[str, dict]], str | None]:
        """Register a watch from ``rv_param``: (watch, events to send first, 410 message or None)."""
        initial: list[tuple[str, dict]] = []
        expired: str | None = None
        with self.lock:
            if rv_param in ("", "0"):
                start_rv = store.rv
                initial = [("ADDED", o) for o in store.select(res, namespace, lreqs, freqs)]
            else:
                start_rv = int(rv_param)
                if start_rv < self._compacted_rv:
                    expired = f"too old resource version: {start_rv} ({self._compacted_rv + 1})"
            watch = Watch(res, namespace, lreqs, freqs, start_rv)
            if expired is None and rv_param not in ("", "0"):
                for ev in self._history:
                    if ev.resource_version > start_rv:
                        watch.progress_rv = ev.resource_version
                        item = watch.translate(ev)
                        if item is not None:
                            initial.append(item)
                watch.start_rv = max(start_rv, store.rv)
                watch.progress_rv = watch.start_rv
            if expired is None:
                self._watches.add(watch)
                self._changed()
        return watch, initial, expired

    async def serve(self, request: web.Request, store: ObjectStore, res: ResourceType, namespace: str | None,
                    query: dict) -> web.StreamResponse:
        """Answer a ``?watch=true`` request: a chunked stream of newline-delimited JSON events."""
        lreqs = parse_label_selector(query.get("labelSelector"))
        freqs = parse_field_selector(query.get("fieldSelector"), res.plural, custom=res.custom)
        rv_param = query.get("resourceVersion", "")
        timeout = query.get("timeoutSeconds")
        bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1")
        if rv_param not in ("", "0") and not rv_param.isdigit():
            raise ApiError.bad_request(f'invalid resource version "{rv_param}"')
        watch, initial, expired = self._open(store, res, namespace, lreqs, freqs, rv_param)
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json",
                                                       "Cache-Control": "no-cache, private"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)

        async def send(type_: str, obj: dict) -> None:
            await resp.write(json.dumps({"type": type_, "object": obj}, separators=(",", ":")).encode() + b"\n")

        if expired is not None:
            try:
                await send("ERROR", status_body(410, "Expired", expired))
                await resp.write_eof()
            except ConnectionError:
                pass
            return resp
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(timeout) if timeout else None
        try:
            for type_, obj in initial:
                await send(type_, obj)
            next_bookmark = loop.time() + self.bookmark_interval if (bookmarks and self.bookmark_interval) else None
            while True:
                waits = [t for t in (deadline, next_bookmark) if t is not None]
                wait = max(0.0, min(waits) - loop.time()) if waits else None
                try:
                    type_, obj = await asyncio.wait_for(watch.queue.get(), wait)
                except TimeoutError:
                    now = loop.time()
                    if deadline is not None and now >= deadline:
                        break
                    if next_bookmark is not None and now >= next_bookmark:
                        await send("BOOKMARK", {"kind": res.kind, "apiVersion": res.api_version,
                                                "metadata": {"resourceVersion": str(watch.progress_rv)}})
                        next_bookmark = now + self.bookmark_interval
                    continue
                if type_ == "__cut__":
                    abort(request)
                    return resp
                if type_ == "__stop__":
                    break
                await send(type_, obj)
            await resp.write_eof()
        except ConnectionError:  # the client went away
            pass
        finally:
            with self.lock:
                self._watches.discard(watch)
                self._changed()
        return resp
