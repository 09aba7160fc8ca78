"""What the cluster's KubeRay can do, read from its RayCluster CRD rather than assumed.

KubeRay adds fields to ``rayclusters.ray.io`` as it grows: ``spec.authOptions`` (token
authentication, v1.5.1), ``spec.upgradeStrategy`` (``Recreate``: a changed spec replaces every
pod, v1.6). The schema the API server serves says which of them this cluster's operator knows,
whatever version the operator calls itself. Reading it needs ``get`` on
``customresourcedefinitions``; without it the features are taken as absent (and said so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kubernetes.client.rest import ApiException

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.kuberay.clients import KubeClients

RAYCLUSTER_CRD = "rayclusters.ray.io"


@dataclass(frozen=True)
class RayClusterCrd:
    """The RayCluster CRD the API server serves.

    :param readable: whether the CRD could be read (``None`` when it does not exist).
    :param versions: the API versions it serves, e.g. ``("v1",)``.
    :param upgrade_strategy: whether ``spec.upgradeStrategy`` exists (KubeRay 1.6 and newer).
    :param auth_options: whether ``spec.authOptions`` exists (KubeRay 1.5.1 and newer).
    :param problem: why it could not be read.
    """

    readable: bool | None
    versions: tuple[str, ...] = ()
    upgrade_strategy: bool = False
    auth_options: bool = False
    problem: str = ""

    def describe(self) -> str:
        """One line for the connection's Test button."""
        if self.readable is None:
            return f"KubeRay CRD {RAYCLUSTER_CRD}: not installed ({self.problem})"
        if not self.readable:
            return f"KubeRay CRD {RAYCLUSTER_CRD}: not readable ({self.problem}); KubeRay 1.5 features assumed"
        fields = [name for name, present in (("upgradeStrategy", self.upgrade_strategy),
                                             ("authOptions", self.auth_options)) if present]
        era = "KubeRay 1.6 or newer" if self.upgrade_strategy else (
            "KubeRay 1.5.1 or newer" if self.auth_options else "KubeRay 1.5 or older")
        return (f"KubeRay CRD {RAYCLUSTER_CRD}: {', '.join(self.versions)}, with "
                f"{', '.join(fields) or 'neither upgradeStrategy nor authOptions'} ({era})")


def spec_properties(crd: dict[str, Any], version: str = "v1") -> dict[str, Any]:
    """The properties of ``spec`` in the CRD's schema of ``version``."""
    for served in crd.get("spec", {}).get("versions") or []:
        if served.get("name") == version:
            schema = (served.get("schema") or {}).get("openAPIV3Schema") or {}
            return ((schema.get("properties") or {}).get("spec") or {}).get("properties") or {}
    return {}


def read_raycluster_crd(clients: KubeClients) -> RayClusterCrd:
    """The RayCluster CRD as this connection's identity can read it."""
    from kubernetes import client as k8s

    try:
        crd = k8s.ApiextensionsV1Api(clients.api_client).read_custom_resource_definition(RAYCLUSTER_CRD)
    except ApiException as exc:
        if exc.status == 404:
            return RayClusterCrd(None, problem="install the KubeRay operator (on GKE, enable the Ray operator add-on)")
        return RayClusterCrd(False, problem=f"{exc.status} {exc.reason}")
    data = clients.api_client.sanitize_for_serialization(crd)
    spec = spec_properties(data)
    versions = tuple(v["name"] for v in data.get("spec", {}).get("versions") or [] if v.get("served"))
    return RayClusterCrd(True, versions, "upgradeStrategy" in spec, "authOptions" in spec)
