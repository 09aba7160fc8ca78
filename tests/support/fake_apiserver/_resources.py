"""The resource types the fake API server serves, and how a path or an object names one."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any


def now_rfc3339() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    singular: str
    status_subresource: bool = False
    tracks_generation: bool = False
    # Custom resources refuse an update (PUT) without metadata.resourceVersion.
    unconditional_update: bool = True
    # Core registries answer DELETE with the object, custom resources with a Status.
    return_deleted_object: bool = True
    short_names: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def custom(self) -> bool:
        return self.group not in ("",)

    @property
    def qualified(self) -> str:
        """How the real server names the resource in messages: ``rayclusters.ray.io``, ``pods``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind

    def details(self, name: str | None = None, **extra: Any) -> dict:
        d: dict[str, Any] = {}
        if name is not None:
            d["name"] = name
        if self.group:
            d["group"] = self.group
        d["kind"] = self.plural
        d.update(extra)
        return d


def _ray(plural: str, kind: str, short: tuple[str, ...] = ()) -> ResourceType:
    return ResourceType(
        "ray.io", "v1", plural, kind, kind.lower(),
        status_subresource=True, tracks_generation=True,
        unconditional_update=False, return_deleted_object=False, short_names=short,
    )


RESOURCE_TYPES: tuple[ResourceType, ...] = (
    _ray("rayclusters", "RayCluster"),
    _ray("rayservices", "RayService"),
    _ray("rayjobs", "RayJob"),
    ResourceType("", "v1", "pods", "Pod", "pod", status_subresource=True, tracks_generation=True, short_names=("po",)),
    ResourceType("", "v1", "events", "Event", "event", short_names=("ev",)),
    ResourceType("", "v1", "services", "Service", "service", status_subresource=True, short_names=("svc",),
                 verbs=("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")),
    ResourceType("", "v1", "secrets", "Secret", "secret"),
    ResourceType("", "v1", "configmaps", "ConfigMap", "configmap", short_names=("cm",)),
)

BY_GVR = {(r.group, r.version, r.plural): r for r in RESOURCE_TYPES}
_BY_PLURAL = {r.plural: r for r in RESOURCE_TYPES}


def resolve_resource(spec: str | ResourceType) -> ResourceType:
    """``"rayclusters"``, ``"ray.io/v1/rayclusters"``, ``"v1/pods"`` or ``"pods"`` -> ResourceType."""
    if isinstance(spec, ResourceType):
        return spec
    parts = spec.strip("/").split("/")
    if len(parts) == 1 and parts[0] in _BY_PLURAL:
        return _BY_PLURAL[parts[0]]
    if len(parts) == 2 and ("", parts[0], parts[1]) in BY_GVR:
        return BY_GVR[("", parts[0], parts[1])]
    if len(parts) == 3 and (parts[0], parts[1], parts[2]) in BY_GVR:
        return BY_GVR[(parts[0], parts[1], parts[2])]
    raise KeyError(f"unknown resource {spec!r}")


def resource_of(obj: dict) -> ResourceType:
    """The resource type of a whole object, from its ``apiVersion`` and ``kind``."""
    api_version, kind = obj.get("apiVersion", ""), obj.get("kind", "")
    for r in RESOURCE_TYPES:
        if r.kind == kind and (not api_version or r.api_version == api_version):
            return r
    raise KeyError(f"unknown object kind {api_version}/{kind}")
