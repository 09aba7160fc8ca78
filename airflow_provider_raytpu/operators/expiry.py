"""How long a RayCluster may live: ``max_lifetime``, bounded by a flex-start slice's run, renewed on adoption."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow_provider_raytpu.manifests.raycluster import EXPIRES_AT_ANNOTATION
from airflow_provider_raytpu.progress import TaskLog
from airflow_provider_raytpu.tpu import TpuSlice
from airflow_provider_raytpu.values import parse_duration

if TYPE_CHECKING:
    from airflow_provider_raytpu.backends.base import ClusterBackend


def parse_lifetime(value: Any) -> timedelta:
    """``max_lifetime`` as a ``timedelta``: given as one, or as seconds; more than zero.

    :raises InvalidInputError: not a duration, or not positive.
    """
    return parse_duration(value, "max_lifetime", example="timedelta(hours=24)",
                          why_positive=": the cluster would be expired when it is made")


def lifetime_on(tpu: TpuSlice, max_lifetime: timedelta) -> timedelta:
    """``max_lifetime``, but no longer than a flex-start slice's max run duration: GKE reclaims its VMs then."""
    run = tpu.capacity.max_run_seconds
    return min(max_lifetime, timedelta(seconds=run)) if run else max_lifetime


def renew_expiry(backend: ClusterBackend, log: TaskLog, stored: dict[str, Any], manifest: dict[str, Any]) -> None:
    """A create that adopts its cluster (a retry, a Clear the next day) renews the cluster's expiry from now:
    the sweep of expired clusters must not delete it mid-run."""
    metadata = stored.get("metadata") or {}
    name, namespace = metadata["name"], metadata["namespace"]
    renewed = manifest["metadata"]["annotations"][EXPIRES_AT_ANNOTATION]
    recorded = (metadata.get("annotations") or {}).get(EXPIRES_AT_ANNOTATION)
    if recorded == renewed:
        return
    backend.annotate_cluster(name, namespace, {EXPIRES_AT_ANNOTATION: renewed})
    log.info("RayCluster %s/%s adopted: its expiry is renewed from %s to %s", namespace, name, recorded, renewed)
