"""What every cluster backend offers: the operators and triggers see only this."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from airflow_provider_raytpu.backends.settings import ConnectionSettings
from airflow_provider_raytpu.errors import ConflictError
from airflow_provider_raytpu.manifests.raycluster import (
    DAG_ID_KEY,
    RUN_ID_KEY,
    SPEC_HASH_ANNOTATION,
    TASK_ID_KEY,
)
from airflow_provider_raytpu.status import ClusterStatus


class Applied(str, Enum):
    """What applying a manifest did."""

    CREATED = "created"
    ADOPTED = "adopted"
    UPDATED = "updated"


@dataclass(frozen=True)
class ApplyResult:
    """The outcome of :meth:`ClusterBackend.apply_cluster`.

    :param action: created, adopted (same spec hash) or updated.
    :param cluster: the RayCluster as stored.
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


class ClusterBackend(abc.ABC):
    """A place where RayClusters live.

    :param settings: the parsed ``raytpu`` connection.
    """

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
    def dashboard_url(self, name: str, namespace: str) -> str:
        """The Ray dashboard's base URL, as this backend reaches it (no credentials in it)."""

    @abc.abstractmethod
    def watch_cluster(self, name: str, namespace: str) -> AsyncIterator[ClusterStatus]:
        """Yield the cluster's status now and on every change, until the caller stops."""

    @abc.abstractmethod
    async def adiagnose(self, name: str, namespace: str) -> str:
        """:meth:`diagnose` without blocking the event loop."""
