"""How the virtual kubelet (kubelet.py) follows the API server: each loop in a daemon thread that restarts
after an error, each object's handling isolated from the others, and list-then-watch from the list's
resourceVersion (bookmarks followed, a re-list on 410 Gone).

A mixin: the kubelet owns the stop event, the open watches, the error list and the log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


class WatchLoops:
    """The virtual kubelet's ``_guard`` (a loop that restarts), ``_handle`` (one object) and ``_watch``."""

    _stop: threading.Event
    _watches: set
    errors: list[str]
    log: logging.Logger

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            while not self._stop.is_set():
                try:
                    fn()
                except Exception as e:  # keep serving; the apiserver may be restarting
                    if self._stop.is_set():
                        return
                    self.errors.append(f"{fn.__name__}: {type(e).__name__}: {e}")
                    del self.errors[:-50]
                    self.log.exception("%s failed; restarting it", fn.__name__)
                    self._stop.wait(0.5)
            self.log.info("%s stopped", fn.__name__)
        return run

    def _handle(self, on_event, kind: str, obj) -> None:
        """One object's failure must not stop the others (nor the watch)."""
        try:
            on_event(kind, obj)
        except Exception as e:
            if self._stop.is_set():
                return
            what = f"{getattr(obj.metadata, 'namespace', None)}/{obj.metadata.name}"
            self.errors.append(f"{kind} {what}: {type(e).__name__}: {e}")
            del self.errors[:-50]
            self.log.exception("handling %s %s failed", kind, what)

    def _watch(self, list_fn, on_event, synced: threading.Event, **kwargs) -> None:
        """list, then watch from its resourceVersion; re-list on 410 Gone."""
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        listed = list_fn(**kwargs)
        for obj in listed.items:
            self._handle(on_event, "ADDED", obj)
        synced.set()
        rv = listed.metadata.resource_version
        while not self._stop.is_set():
            w = watch.Watch()
            self._watches.add(w)
            try:
                for ev in w.stream(list_fn, resource_version=rv, timeout_seconds=60,
                                   allow_watch_bookmarks=True, **kwargs):
                    if self._stop.is_set():
                        w.stop()
                        return
                    rv = w.resource_version or rv  # bookmarks included
                    if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._handle(on_event, ev["type"], ev["object"])
            except ApiException as e:
                if e.status != 410:
                    raise
                self.log.info("watch expired (410): re-listing")
                listed = list_fn(**kwargs)  # too old: re-list
                for obj in listed.items:
                    self._handle(on_event, "ADDED", obj)
                rv = listed.metadata.resource_version
            finally:
                self._watches.discard(w)
