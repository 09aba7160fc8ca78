"""What every cluster backend offers: the operators and triggers see only this."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from airflow_provider_raytpu.backends.settings import ConnectionSettings
from airflow_provider_raytpu.backends.transport import HttpTransport
from airflow_provider_raytpu.errors import ConflictError
from airflow_provider_raytpu.manifests.raycluster import (
    DAG_ID_KEY,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    RUN_ID_KEY,
    SPEC_HASH_ANNOTATION,
    TASK_ID_KEY,
)
from airflow_provider_raytpu.status import ClusterStatus, ServiceStatus


class Applied(str, Enum):
    """What applying a manifest did."""

    CREATED = "created"
    ADOPTED = "adopted"
    UPDATED = "updated"


@dataclass(frozen=True)
class ApplyResult:
    """The outcome of :meth:`ClusterBackend.apply_cluster` or :meth:`ServiceBackend.apply_service`.

    :param action: created, adopted (same spec hash) or updated.
    :param cluster: the RayCluster (or RayService) as stored.
    """

    action: Applied
    cluster: dict[str, Any]


def annotations_of(obj: dict[str, Any]) -> dict[str, str]:
    return obj.get("metadata", {}).get("annotations") or {}


def same_spec(existing: dict[str, Any], manifest: dict[str, Any]) -> bool:
    """Whether an existing resource is the one ``manifest`` renders (equal spec-hash annotations)."""
    return annotations_of(existing).get(SPEC_HASH_ANNOTATION) == annotations_of(manifest)[SPEC_HASH_ANNOTATION]


def conflict_error(existing: dict[str, Any], manifest: dict[str, Any]) -> ConflictError:
    """The error for an existing resource of the same name whose spec differs."""
    metadata = existing.get("metadata", {})
    kind = existing.get("kind", "RayCluster")
    notes = annotations_of(existing)
    made_by = (
        f"made by DAG {notes[DAG_ID_KEY]!r}, run {notes.get(RUN_ID_KEY)!r}, task {notes.get(TASK_ID_KEY)!r}"
        if DAG_ID_KEY in notes
        else "not made by this provider"
    )
    return ConflictError(
        f"{kind} {metadata.get('name')!r} in namespace {metadata.get('namespace')!r} already exists with a "
        f"different spec (spec hash {notes.get(SPEC_HASH_ANNOTATION)!r}, this task renders "
        f"{annotations_of(manifest)[SPEC_HASH_ANNOTATION]!r}; {made_by}). Choose another name, delete "
        f"the existing {kind}, or set update_if_exists=True to update it in place."
    )


def same_service(existing: dict[str, Any], manifest: dict[str, Any]) -> bool:
    """Whether an existing RayService is the one ``manifest`` renders: same spec hash and same model version."""
    from airflow_provider_raytpu.manifests.rayservice import service_version

    return same_spec(existing, manifest) and service_version(existing) == service_version(manifest)


def foreign_service_error(existing: dict[str, Any]) -> ConflictError:
    """The error for a RayService of the same name that this provider did not make."""
    metadata = existing.get("metadata", {})
    return ConflictError(
        f"RayService {metadata.get('name')!r} in namespace {metadata.get('namespace')!r} already exists and was not "
        f"made by this provider (no {MANAGED_BY_LABEL}={MANAGED_BY} label), so it is not replaced. Choose another "
        "service_name, or delete the existing RayService."
    )


def service_config_problems(service: dict[str, Any]) -> list[str]:
    """What in a RayService's Serve config cannot be scheduled on one of its slices, one line each."""
    from airflow_provider_raytpu.manifests.raycluster import tpu_slice_of
    from airflow_provider_raytpu.manifests.serve_preflight import serve_config_problems
    from airflow_provider_raytpu.manifests.serveconfig import parse_serve_config

    tpu = tpu_slice_of(service)
    if tpu is None:
        return []
    config = parse_serve_config((service.get("spec") or {}).get("serveConfigV2"))
    return [str(problem) for problem in serve_config_problems(config, tpu)]


def is_managed(obj: dict[str, Any]) -> bool:
    return (obj.get("metadata", {}).get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGED_BY


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
        replaced (a promotion). A same-named RayService this provider did not make is a
        :class:`~airflow_provider_raytpu.errors.ConflictError`.
        """

    @abc.abstractmethod
    def get_service(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The RayService with its status, or ``None`` when it does not exist."""

    @abc.abstractmethod
    def delete_service(self, name: str, namespace: str) -> bool:
        """Delete the RayService and its clusters; ``False`` when it was already gone."""

    @abc.abstractmethod
    def service_status(self, name: str, namespace: str, version: str | None = None) -> ServiceStatus:
        """The service's state for a task waiting until ``version`` (default: the spec's) serves."""

    @abc.abstractmethod
    def watch_service(
        self, name: str, namespace: str, version: str | None = None, poll_interval: float = 10.0
    ) -> AsyncIterator[ServiceStatus]:
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
        """Create the RayCluster, adopt a matching one, or update a different one if allowed."""

    @abc.abstractmethod
    def get_cluster(self, name: str, namespace: str) -> dict[str, Any] | None:
        """The RayCluster, or ``None`` when it does not exist."""

    @abc.abstractmethod
    def delete_cluster(self, name: str, namespace: str) -> bool:
        """Delete the RayCluster; ``False`` when it was already gone."""

    @abc.abstractmethod
    def list_clusters(self, namespace: str | None, label_selector: str) -> list[dict[str, Any]]:
        """RayClusters matching a label selector, in one namespace or all (``None``)."""

    @abc.abstractmethod
    def cluster_status(self, name: str, namespace: str) -> ClusterStatus:
        """The cluster's state, with per-slice detail."""

    @abc.abstractmethod
    def diagnose(self, name: str, namespace: str) -> str:
        """Why the cluster is not ready: which hosts are missing and what holds them."""

    @abc.abstractmethod
    def dashboard(self, name: str, namespace: str) -> HttpTransport:
        """The cluster's Ray dashboard (Jobs and Serve REST APIs), as this backend reaches it."""

    @abc.abstractmethod
    def watch_cluster(self, name: str, namespace: str) -> AsyncIterator[ClusterStatus]:
        """Yield the cluster's status now and on every change, until the caller stops."""

    @abc.abstractmethod
    async def adiagnose(self, name: str, namespace: str) -> str:
        """:meth:`diagnose` without blocking the event loop."""
