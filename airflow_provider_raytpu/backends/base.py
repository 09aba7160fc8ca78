"""What every cluster backend offers: the operators and triggers see only this."""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from airflow_provider_raytpu.connection import ConnectionSettings
from airflow_provider_raytpu.dashboard.transport import HttpTransport
from airflow_provider_raytpu.status import ClusterStatus, ServiceStatus


class Applied(str, Enum):
    """What applying a manifest did."""

    CREATED = "created"
    ADOPTED = "adopted"
    UPDATED = "updated"
    RECREATED = "recreated"


@dataclass(frozen=True)
class ApplyResult:
    """The outcome of :meth:`ClusterBackend.apply_cluster` or :meth:`ServiceBackend.apply_service`
    (both go through :func:`~airflow_provider_raytpu.backends.apply.apply_object`).

    :param action: created, adopted (same spec hash), updated (replaced) or recreated (deleted, then created).
    :param cluster: the RayCluster (or RayService) as stored.
    """

    action: Applied
    cluster: dict[str, Any]


@dataclass(frozen=True)
class Precondition:
    """What a delete may act on: the object whose owner was checked, never a same-named one made since.

    Kubernetes' ``DeleteOptions.preconditions``: the API server deletes only the object with this uid
    (and, when given, this resourceVersion) and answers 409 Conflict otherwise; the local backend checks
    the same under its cluster lock.

    :param uid: the checked object's ``metadata.uid``.
    :param resource_version: its ``metadata.resourceVersion``, where the decision read more than its owner
        (an expiry that a retry may renew): any change since means deciding again.
    """

    uid: str
    resource_version: str | None = None

    @classmethod
    def of(cls, obj: dict[str, Any], *, exact: bool = False) -> Precondition:
        """The precondition for acting on ``obj`` as read; ``exact``: on this very version of it."""
        metadata = obj["metadata"]
        return cls(metadata["uid"], str(metadata["resourceVersion"]) if exact else None)

    def unmet(self, stored: dict[str, Any]) -> str | None:
        """Why ``stored`` is not the checked object (``None`` when it is)."""
        metadata = stored.get("metadata") or {}
        if metadata.get("uid") != self.uid:
            return f"uid {metadata.get('uid')}, checked {self.uid}"
        if self.resource_version is not None and str(metadata.get("resourceVersion")) != self.resource_version:
            return f"resourceVersion {metadata.get('resourceVersion')}, checked {self.resource_version}"
        return None


class ChangedSinceChecked(Exception):
    """A delete's :class:`Precondition` failed: the object was replaced or changed after its owner was checked,
    so it was not deleted. Never retried into a delete of the new object: whoever acts decides again.

    :param kind: ``RayCluster`` or ``RayService``.
    :param name: its name.
    :param namespace: its namespace.
    :param detail: what differs (the API server's message).
    :param not_done: what was not done, e.g. ``not deleted``.
    """

    def __init__(self, kind: str, name: str, namespace: str, detail: str, not_done: str = "not deleted") -> None:
        self.kind, self.name, self.namespace = kind, name, namespace
        super().__init__(f"{kind} {namespace}/{name} changed since it was checked: {not_done} ({detail})")


class ServiceBackend(abc.ABC):
    """A place where RayServices live: a TPU RayCluster config plus a Ray Serve config.

    Status is read into :class:`~airflow_provider_raytpu.status.ServiceStatus` by
    :func:`~airflow_provider_raytpu.status.read_ray_service` on every backend, so
    RUNNING / DEPLOYING / UPGRADING / FAILED mean the same everywhere.
    """

    @abc.abstractmethod
    def apply_service(self, manifest: dict[str, Any]) -> ApplyResult:
        """Create the RayService, or bring an existing one to ``manifest``.

        Identical (same spec hash and model version): adopted, nothing is written, so a
        retried deploy is a no-op. Different: the spec and this provider's annotations are
        replaced (a promotion). A same-named RayService this provider did not make, or
        another DAG or task made (a RayService belongs to the DAG and task that created it),
        is a :class:`~airflow_provider_raytpu.errors.ConflictError`.
        """

    @abc.abstractmethod
    def get_service(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The RayService with its status, or ``None`` when it does not exist."""

    @abc.abstractmethod
    def delete_service(self, name: str, namespace: str, precondition: Precondition | None = None) -> bool:
        """Delete the RayService and its clusters; ``False`` when it was already gone.

        :param precondition: delete only the object whose owner was checked (every task passes one;
            ``None`` deletes whatever has the name).
        :raises ChangedSinceChecked: the stored object is not the checked one; nothing was deleted.
        """

    @abc.abstractmethod
    def list_services(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """RayServices in a namespace matching a label selector."""

    @abc.abstractmethod
    def service_status(self, name: str, namespace: str, version: str | None = None) -> ServiceStatus:
        """The service's state for a task waiting until ``version`` (default: the spec's) serves."""

    @abc.abstractmethod
    def watch_service(
        self, name: str, namespace: str, version: str | None = None, poll_interval: float = 10.0
    ) -> AsyncGenerator[ServiceStatus, None]:
        """Yield the service's status now and on every change, until the caller stops."""

    @abc.abstractmethod
    async def aservice_status(self, name: str, namespace: str, version: str | None = None) -> ServiceStatus:
        """:meth:`service_status` without blocking the event loop."""

    @abc.abstractmethod
    def diagnose_service(self, name: str, namespace: str, version: str | None = None,
                         waited: float | None = None) -> str:
        """Why the service does not serve the version: applications and deployments not running and
        their replicas, the serving cluster's slices, and Serve config problems (a missing topology).

        :param waited: how long the stuck application has been deploying, for the first line.
        """

    @abc.abstractmethod
    async def adiagnose_service(self, name: str, namespace: str, version: str | None = None,
                                waited: float | None = None) -> str:
        """:meth:`diagnose_service` without blocking the event loop."""

    @abc.abstractmethod
    def serve_endpoint(self, name: str, namespace: str) -> HttpTransport:
        """The service's Serve HTTP proxy, as this backend reaches it."""

    @abc.abstractmethod
    def dashboard(self, name: str, namespace: str) -> HttpTransport:
        """The Ray dashboard of the service's active cluster, as this backend reaches it."""


class ClusterBackend(abc.ABC):
    """A place where RayClusters (and the RayServices built on them) live.

    Its RayServices are :attr:`services`, an object the backend holds.

    :param settings: the parsed ``raytpu`` connection.
    """

    services: ServiceBackend

    def __init__(self, settings: ConnectionSettings) -> None:
        self.settings = settings

    @property
    def namespace(self) -> str:
        return self.settings.namespace

    @abc.abstractmethod
    def check(self) -> str:
        """Reach the backend and say what was found; raises when it cannot be used."""

    @abc.abstractmethod
    def apply_cluster(self, manifest: dict[str, Any], *, update_if_exists: bool = False) -> ApplyResult:
        """Create the RayCluster, adopt our own matching one, or recreate our own different one if allowed.

        Our own (the same owner annotations: DAG, run, task) with the same spec hash: adopted,
        nothing is written. Our own with another spec and ``update_if_exists``: deleted, waited
        for until gone, and created again (a RayCluster's pods do not follow a spec change). A
        same-named RayCluster this provider did not make, or another owner made, or our own
        different one without ``update_if_exists``, is a
        :class:`~airflow_provider_raytpu.errors.ConflictError`.
        """

    @abc.abstractmethod
    def get_cluster(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The RayCluster, or ``None`` when it does not exist."""

    @abc.abstractmethod
    def delete_cluster(self, name: str, namespace: str, precondition: Precondition | None = None) -> bool:
        """Delete the RayCluster; ``False`` when it was already gone.

        :param precondition: delete only the object whose owner was checked (every task passes one;
            ``None`` deletes whatever has the name).
        :raises ChangedSinceChecked: the stored object is not the checked one; nothing was deleted.
        """

    @abc.abstractmethod
    def annotate_cluster(self, name: str, namespace: str, annotations: dict[str, str]) -> None:
        """Set annotations on the RayCluster (e.g. a renewed expiry); its spec and other metadata stay."""

    def cluster_pods(self, name: str, namespace: str) -> list[dict[str, Any]]:
        """The RayCluster's pods, terminating ones included; none on a backend without pods (the local
        backend's delete returns once the cluster's processes are gone)."""
        return []

    @abc.abstractmethod
    def list_clusters(self, namespace: str | None, label_selector: str) -> list[dict[str, Any]]:
        """RayClusters matching a label selector, in one namespace or all (``None``)."""

    @abc.abstractmethod
    def cluster_status(self, name: str, namespace: str, *, confirm_with_ray: bool = False) -> ClusterStatus:
        """The cluster's state, with per-slice detail.

        :param confirm_with_ray: a READY stays READY only when Ray lists every TPU host with its chips,
            its slice's name and one slice head per slice (:mod:`~airflow_provider_raytpu.dashboard.nodes`).
        """

    @abc.abstractmethod
    def diagnose_cluster(self, name: str, namespace: str, *, confirm_with_ray: bool = False) -> str:
        """Why the cluster is not ready: which hosts are missing and what holds them (with
        ``confirm_with_ray``, also what Ray does not list)."""

    @abc.abstractmethod
    def dashboard(self, name: str, namespace: str) -> HttpTransport:
        """The cluster's Ray dashboard (Jobs and Serve REST APIs), as this backend reaches it."""

    @abc.abstractmethod
    def watch_cluster(self, name: str, namespace: str, poll_interval: float = 10.0, *,
                      confirm_with_ray: bool = False) -> AsyncGenerator[ClusterStatus, None]:
        """Yield the cluster's status now and on every change, until the caller stops (a status that is
        READY by its pods but not yet by Ray is read again every ``poll_interval`` seconds)."""

    @abc.abstractmethod
    async def adiagnose_cluster(self, name: str, namespace: str, *, confirm_with_ray: bool = False) -> str:
        """:meth:`diagnose_cluster` without blocking the event loop."""

    def close(self) -> None:
        """Release the clients this backend opened (a task calls it when it ends); none by default."""
        return None

