"""Discovery documents (``/version``, ``/api``, ``/apis``, resource lists) and namespace objects."""

from __future__ import annotations

import uuid

from ._resources import RESOURCE_TYPES

KUBERNETES_GIT_VERSION = "v1.37.2"


def version_doc() -> dict:
    major, minor, _ = KUBERNETES_GIT_VERSION.lstrip("v").split(".")
    return {"major": major, "minor": minor, "emulationMajor": major, "emulationMinor": minor,
            "minCompatibilityMajor": major, "minCompatibilityMinor": str(int(minor) - 1),
            "gitVersion": KUBERNETES_GIT_VERSION, "gitCommit": "0" * 40, "gitTreeState": "clean",
            "buildDate": "2026-11-01T00:00:00Z", "goVersion": "go1.25.4", "compiler": "gc",
            "platform": "linux/amd64"}


def api_versions_doc(port: int) -> dict:
    return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
        {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{port}"}]}


def group_doc(group: str) -> dict:
    versions = sorted({r.version for r in RESOURCE_TYPES if r.group == group})
    gvs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"name": group, "versions": gvs, "preferredVersion": gvs[0]}


def group_list_doc() -> dict:
    return {"kind": "APIGroupList", "apiVersion": "v1",
            "groups": [group_doc(g) for g in sorted({r.group for r in RESOURCE_TYPES if r.group})]}


def known_group(group: str) -> bool:
    return any(r.group == group for r in RESOURCE_TYPES)


def resource_list_doc(group: str, version: str) -> dict:
    resources = []
    for r in RESOURCE_TYPES:
        if r.group != group or r.version != version:
            continue
        entry = {"name": r.plural, "singularName": r.singular, "namespaced": True, "kind": r.kind,
                 "verbs": list(r.verbs)}
        if r.short_names:
            entry["shortNames"] = list(r.short_names)
        if r.custom:
            entry["categories"] = ["all"]
        resources.append(entry)
        if r.status_subresource:
            resources.append({"name": f"{r.plural}/status", "singularName": "", "namespaced": True,
                              "kind": r.kind, "verbs": ["get", "patch", "update"]})
    return {"kind": "APIResourceList", "apiVersion": "v1",
            "groupVersion": f"{group}/{version}" if group else version, "resources": resources}


def namespace_doc(ns: str) -> dict:
    """A Namespace object: namespaces exist implicitly, as soon as something names them."""
    return {"kind": "Namespace", "apiVersion": "v1",
            "metadata": {"name": ns, "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, ns)), "resourceVersion": "1",
                         "labels": {"kubernetes.io/metadata.name": ns}},
            "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}


def namespace_list_doc(names: set[str], resource_version: str) -> dict:
    return {"kind": "NamespaceList", "apiVersion": "v1", "metadata": {"resourceVersion": resource_version},
            "items": [{k: v for k, v in namespace_doc(n).items() if k not in ("kind", "apiVersion")}
                      for n in sorted(names)]}
