"""Object storage: objects by (resource, namespace, name) and one global resourceVersion counter.

Every write is a commit: it takes the next resourceVersion (like a fresh etcd, the first write
gets 2), keeps ``generation`` in step with the spec, and is published to the change feed with
the lock held, so watchers and subscribers see commits in order.
"""

from __future__ import annotations

import copy
import threading

from ._resources import RESOURCE_TYPES, ResourceType
from ._selectors import fields_match, labels_match
from ._watches import ChangeEvent, ChangeFeed


class ObjectStore:
    """The stored objects; callers hold :attr:`lock` around reads and commits that must be atomic."""

    def __init__(self, feed: ChangeFeed) -> None:
        self.feed = feed
        self.lock: threading.RLock = feed.lock
        self.rv = 1
        self._objects: dict[ResourceType, dict[tuple[str, str], dict]] = {r: {} for r in RESOURCE_TYPES}

    def get(self, res: ResourceType, namespace: str, name: str) -> dict | None:
        return self._objects[res].get((namespace, name))

    def select(self, res: ResourceType, namespace: str | None, lreqs, freqs) -> list[dict]:
        out = []
        for (ns, _name), obj in sorted(self._objects[res].items()):
            if namespace is not None and ns != namespace:
                continue
            if labels_match(lreqs, obj) and fields_match(freqs, obj):
                out.append(obj)
        return out

    def namespaces(self) -> set[str]:
        with self.lock:
            return {ns for objs in self._objects.values() for ns, _ in objs}

    # -- commits (lock held) ---------------------------------------------------------------------

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _emit(self, type_: str, res: ResourceType, obj: dict, old: dict | None) -> None:
        meta = obj["metadata"]
        self.feed.publish(ChangeEvent(type_, res, meta.get("namespace", ""), meta["name"], obj, old,
                                      int(meta["resourceVersion"])))

    def commit_create(self, res: ResourceType, obj: dict) -> dict:
        meta = obj["metadata"]
        meta["resourceVersion"] = self._next_rv()
        self._objects[res][(meta["namespace"], meta["name"])] = obj
        self._emit("ADDED", res, obj, None)
        return obj

    def commit_update(self, res: ResourceType, old: dict, new: dict, *, bump_generation: bool = False) -> dict:
        """Store ``new`` over ``old`` (both complete objects); no-op if nothing changed; a
        terminating object whose finalizers are gone is deleted instead."""
        meta = new["metadata"]
        meta["resourceVersion"] = old["metadata"]["resourceVersion"]
        if res.tracks_generation:
            meta["generation"] = old["metadata"].get("generation", 1)
            if bump_generation or spec_changed(old, new):
                meta["generation"] += 1
        ometa = old["metadata"]
        # registry.Store.shouldDeleteDuringUpdate: the last finalizer of a terminating object went
        if (ometa.get("finalizers") and not meta.get("finalizers") and ometa.get("deletionTimestamp")
                and not ometa.get("deletionGracePeriodSeconds")):
            meta.pop("finalizers", None)
            return self.commit_delete(res, new)
        if new == old:
            return old
        meta["resourceVersion"] = self._next_rv()
        self._objects[res][(meta["namespace"], meta["name"])] = new
        self._emit("MODIFIED", res, new, old)
        return new

    def commit_delete(self, res: ResourceType, obj: dict) -> dict:
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        self._objects[res].pop(key, None)
        final = copy.copy(obj)
        final["metadata"] = dict(meta, resourceVersion=self._next_rv())
        self._emit("DELETED", res, final, obj)
        return final


def spec_changed(old: dict, new: dict) -> bool:
    strip = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
    return strip(old) != strip(new)


def carry_system_meta(old: dict, new: dict, *, keep_deletion: bool = True) -> None:
    """An update keeps what the server owns in ``metadata``: name, namespace, uid, creation and
    (unless ``keep_deletion`` is False) deletion timestamps."""
    ometa, nmeta = old["metadata"], new["metadata"]
    nmeta["name"], nmeta["namespace"] = ometa["name"], ometa["namespace"]
    for key in ("uid", "creationTimestamp"):
        nmeta[key] = ometa[key]
    if keep_deletion:
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            if key in ometa:
                nmeta[key] = ometa[key]
            else:
                nmeta.pop(key, None)
    nmeta.pop("selfLink", None)
