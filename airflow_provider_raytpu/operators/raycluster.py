"""Create and delete topology-aware RayClusters on TPU slices."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow_provider_raytpu.backends.settings import DEFAULT_CONN_ID
from airflow_provider_raytpu.manifests.names import RAY_CLUSTER_NAME_LIMIT, resource_name
from airflow_provider_raytpu.manifests.options import RayClusterOptions, take_cluster_options
from airflow_provider_raytpu.manifests.raycluster import (
    EXPIRES_AT_ANNOTATION,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    build_ray_cluster,
    parse_expiry,
)
from airflow_provider_raytpu.operators.base import ClusterTaskMixin, fail_fast, origin_of, wait_until_gone
from airflow_provider_raytpu.tpu import TpuSlice, parse_bool

if TYPE_CHECKING:
    from airflow.sdk import Context

SLICE_FIELDS = ("accelerator", "topology", "num_slices", "spot", "chips_per_host")


def default_cluster_name(context: Context) -> str:
    """One cluster per DAG run: the DAG id and a hash of the run id, the same on every retry."""
    ti = context["ti"]
    run = hashlib.sha256(ti.run_id.encode()).hexdigest()[:8]
    return resource_name(f"{ti.dag_id[: RAY_CLUSTER_NAME_LIMIT - 9]}-{run}", "cluster_name")


class CreateRayClusterOperator(ClusterTaskMixin, BaseOperator):
    """Create a RayCluster whose TPU worker group is ``num_slices`` whole slices of one shape.

    Declare the slice shape, never a chip count: hosts per slice, chips per host, the
    GKE node pool selector and Ray's TPU resources all follow from it. Slice fields are
    templated, so a UI trigger's params can choose the shape; they are parsed strictly
    and checked before any API call. A retry adopts the cluster its first try made
    (same spec hash); a different cluster of the same name is an error unless
    ``update_if_exists``. Returns the cluster reference
    ``{"cluster_name", "namespace", "conn_id", "tpu", "dashboard_url"}``.

    :param accelerator: TPU generation, e.g. ``"v6e"``.
    :param topology: slice shape, e.g. ``"4x4"``.
    :param num_slices: number of identical slices.
    :param spot: use spot (preemptible) TPU capacity.
    :param chips_per_host: chips per host where the generation offers a choice.
    :param cluster_name: the RayCluster's name; default: the DAG id and a hash of the run id.
    :param namespace: the namespace; default: the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param cluster_options: image, resources, env, ray start flags, service account, labels,
        annotations and pod-template fragments: a
        :class:`~airflow_provider_raytpu.manifests.options.RayClusterOptions` or a dict of
        its fields, every field templated. Each field can also be given as a keyword
        argument of its own (``image=...``, ``env=...``), but not both ways.
    :param max_lifetime: after this, :class:`DeleteExpiredRayClustersOperator` deletes the cluster.
    :param update_if_exists: update a same-named cluster whose spec differs instead of failing.
    """

    template_fields: Sequence[str] = (
        *SLICE_FIELDS,
        "cluster_name",
        "namespace",
        "raytpu_conn_id",
        "cluster_options",
        "update_if_exists",
    )
    template_fields_renderers = {"cluster_options": "json"}
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        accelerator: str,
        topology: str,
        num_slices: int | str = 1,
        spot: bool | str = False,
        chips_per_host: int | str | None = None,
        cluster_name: str | None = None,
        namespace: str | None = None,
        raytpu_conn_id: str = DEFAULT_CONN_ID,
        cluster_options: RayClusterOptions | Mapping[str, Any] | str | None = None,
        max_lifetime: timedelta = timedelta(hours=24),
        update_if_exists: bool | str = False,
        **kwargs: Any,
    ) -> None:
        options = take_cluster_options(cluster_options, kwargs)
        super().__init__(**kwargs)
        self.accelerator = accelerator
        self.topology = topology
        self.num_slices = num_slices
        self.spot = spot
        self.chips_per_host = chips_per_host
        self.cluster_name = cluster_name
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.cluster_options = options
        self.max_lifetime = max_lifetime
        self.update_if_exists = update_if_exists

    def execute(self, context: Context) -> dict[str, Any]:
        with fail_fast():
            tpu = TpuSlice(self.accelerator, self.topology, self.num_slices, self.spot, self.chips_per_host)
            options = RayClusterOptions.from_value(self.cluster_options)
            update_if_exists = parse_bool(self.update_if_exists, "update_if_exists")
            name = resource_name(self.cluster_name or default_cluster_name(context), "cluster_name")
            namespace = self.resolved_namespace()
            manifest = build_ray_cluster(
                name=name,
                namespace=namespace,
                tpu=tpu,
                options=options,
                origin=origin_of(context),
                expires_at=datetime.now(timezone.utc) + self.max_lifetime,
            )
            self.log.info("RayCluster %s/%s: %s", namespace, name, tpu.describe())
            result = self.backend.apply_cluster(manifest, update_if_exists=update_if_exists)
        self.log.info("RayCluster %s/%s %s", namespace, name, result.action.value)
        return self.cluster_reference(name, namespace, tpu.to_dict())


class DeleteRayClusterOperator(ClusterTaskMixin, BaseOperator):
    """Delete a RayCluster; succeeds when it is already gone. Use it as a teardown task.

    ``delete.as_teardown(setups=create)`` runs it whatever happened upstream, so TPU
    slices are released even when training failed.

    :param cluster_name: the RayCluster's name.
    :param namespace: the namespace; default: the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param wait_for_deletion: wait until the RayCluster object is gone.
    :param deletion_timeout: seconds to wait for that.
    :param poll_interval: seconds between checks while waiting.
    """

    template_fields: Sequence[str] = ("cluster_name", "namespace", "raytpu_conn_id")
    ui_color = "#fde8e8"

    def __init__(
        self,
        *,
        cluster_name: str,
        namespace: str | None = None,
        raytpu_conn_id: str = DEFAULT_CONN_ID,
        wait_for_deletion: bool = False,
        deletion_timeout: float = 600,
        poll_interval: float = 2,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.cluster_name = cluster_name
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.wait_for_deletion = wait_for_deletion
        self.deletion_timeout = deletion_timeout
        self.poll_interval = poll_interval

    def execute(self, context: Context) -> dict[str, Any]:
        with fail_fast():
            name = resource_name(self.cluster_name, "cluster_name")
            namespace = self.resolved_namespace()
            deleted = self.backend.delete_cluster(name, namespace)
            self.log.info("RayCluster %s/%s %s", namespace, name, "deleted" if deleted else "was already gone")
            if self.wait_for_deletion:
                wait_until_gone("RayCluster", name, namespace, self.backend.get_cluster, self.deletion_timeout,
                                self.poll_interval)
        return {"cluster_name": name, "namespace": namespace, "deleted": deleted}


class DeleteExpiredRayClustersOperator(ClusterTaskMixin, BaseOperator):
    """Delete RayClusters this provider made whose expiry has passed.

    The safety net for TPU hours: a DAG that dies before its teardown leaves a cluster
    behind; schedule this hourly and it goes once its ``max_lifetime`` is over.

    :param namespace: where to look; default: the connection's namespace.
    :param all_namespaces: look in every namespace instead.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param dry_run: only report what would be deleted.
    """

    template_fields: Sequence[str] = ("namespace", "raytpu_conn_id")

    def __init__(
        self,
        *,
        namespace: str | None = None,
        all_namespaces: bool = False,
        raytpu_conn_id: str = DEFAULT_CONN_ID,
        dry_run: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.namespace = namespace
        self.all_namespaces = all_namespaces
        self.raytpu_conn_id = raytpu_conn_id
        self.dry_run = dry_run

    def execute(self, context: Context) -> list[str]:
        now = datetime.now(timezone.utc)
        expired = []
        with fail_fast():
            scope = None if self.all_namespaces else self.resolved_namespace()
            for cluster in self.backend.list_clusters(scope, f"{MANAGED_BY_LABEL}={MANAGED_BY}"):
                metadata = cluster["metadata"]
                expiry = (metadata.get("annotations") or {}).get(EXPIRES_AT_ANNOTATION)
                if not expiry or parse_expiry(expiry) > now:
                    continue
                expired.append(f"{metadata['namespace']}/{metadata['name']}")
                self.log.info("RayCluster %s expired at %s%s", expired[-1], expiry, " (dry run)" if self.dry_run else "")
                if not self.dry_run:
                    self.backend.delete_cluster(metadata["name"], metadata["namespace"])
        return expired
