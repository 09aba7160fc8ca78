"""Deploy, promote, roll back and delete RayServices that serve models on TPU slices."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow_provider_raytpu.backends.settings import DEFAULT_CONN_ID
from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.names import RAY_SERVICE_NAME_LIMIT, resource_name
from airflow_provider_raytpu.manifests.options import RayClusterOptions, take_cluster_options
from airflow_provider_raytpu.manifests.raycluster import DAG_ID_KEY, RUN_ID_KEY, TASK_ID_KEY
from airflow_provider_raytpu.manifests.rayservice import (
    UPDATE_ANNOTATION,
    build_ray_service,
    parse_version,
    rollback_target,
    service_version,
    version_history,
)
from airflow_provider_raytpu.manifests.serveconfig import ServeApplication
from airflow_provider_raytpu.operators.base import ServiceTaskMixin, fail_fast, origin_of, wait_until_gone
from airflow_provider_raytpu.operators.raycluster import SLICE_FIELDS
from airflow_provider_raytpu.tpu import TpuSlice, parse_bool

if TYPE_CHECKING:
    from airflow.sdk import Context


def default_service_name(context: Context) -> str:
    """One RayService per DAG: it outlives runs, which promote new versions to it."""
    return resource_name(context["ti"].dag_id, "service_name", RAY_SERVICE_NAME_LIMIT)


def previous_version(history: Sequence[str], version: str) -> str | None:
    """The newest version in the history other than ``version``."""
    return next((v for v in reversed(history) if v != version), None)


class DeployRayServiceOperator(ServiceTaskMixin, BaseOperator):
    """Create a RayService serving models on a TPU slice shape, or promote it to a new model version.

    The serving cluster is a RayCluster of ``num_slices`` whole slices, rendered exactly like
    :class:`~airflow_provider_raytpu.operators.raycluster.CreateRayClusterOperator`'s (slice
    fields templated and parsed strictly). Ray Serve LLM applications get
    ``accelerator_type`` and ``accelerator_config: {kind: tpu, topology}`` from the slice, and
    a preflight refuses, before anything is applied, a replica that cannot land on ONE slice
    (a multi-host LLM without topology or with another topology; a plain deployment asking
    for more chips than a host has without placement-group bundles across hosts).

    The ``version`` (e.g. the checkpoint URI a training task returned) is recorded on the
    RayService and written into each application's ``version_arg``. KubeRay starts a new
    cluster only when ``rayClusterConfig`` changes; so by default the version is also written
    into the cluster config (a pod-template annotation) and KubeRay prepares a fresh slice,
    switching traffic to it once it serves: zero downtime, where an in-place change would
    need room for new replicas on a slice that has none. ``in_place=True`` changes only the
    Serve config. Re-applying the same version is a no-op, so retries are safe.
    ``rollback=True`` promotes the version before the current one in the service's history
    (rolling back twice toggles, like ``kubectl rollout undo``). Returns
    ``{"service_name", "namespace", "conn_id", "version", "previous_version", "tpu", "serve_url"}``.

    :param applications: the Serve applications: dicts with ``name``, ``import_path`` and
        optionally ``route_prefix``, ``args``, ``deployments``, ``runtime_env``,
        ``version_arg`` (see :class:`~airflow_provider_raytpu.manifests.serveconfig.ServeApplication`).
    :param version: the model version to serve, e.g. ``"{{ ti.xcom_pull('train')['checkpoint_uri'] }}"``.
    :param accelerator: TPU generation, e.g. ``"v6e"``.
    :param topology: slice shape, e.g. ``"4x4"``.
    :param num_slices: number of identical slices in the serving cluster.
    :param spot: use spot (preemptible) TPU capacity.
    :param chips_per_host: chips per host where the generation offers a choice.
    :param service_name: the RayService's name (at most 47 characters); default: the DAG id.
    :param namespace: the namespace; default: the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param in_place: change only the Serve config (no new cluster).
    :param rollback: promote the previous version from the service's history; ``version`` is then ignored.
    :param upgrade_strategy: KubeRay's ``upgradeStrategy.type``: ``NewCluster`` or ``None`` (with ``in_place``).
    :param serve_options: top-level Serve options (``http_options``, ``proxy_location``, ``logging_config``).
    :param cluster_options: the serving cluster's image, resources, env, ray start flags,
        service account and pod-template fragments, and the RayService's labels and
        annotations: a :class:`~airflow_provider_raytpu.manifests.options.RayClusterOptions`
        or a dict of its fields, every field templated. Each field can also be given as a
        keyword argument of its own (``image=...``, ``env=...``), but not both ways.
    :param cluster_deletion_delay_seconds: how long KubeRay keeps the old cluster after a switch.
    """

    template_fields: Sequence[str] = (
        *SLICE_FIELDS,
        "applications",
        "version",
        "service_name",
        "namespace",
        "raytpu_conn_id",
        "in_place",
        "rollback",
        "serve_options",
        "cluster_options",
    )
    template_fields_renderers = {"applications": "json", "serve_options": "json", "cluster_options": "json"}
    ui_color = "#e8f0fe"

    def __init__(
        self,
        *,
        applications: Sequence[ServeApplication | Mapping[str, Any]],
        accelerator: str,
        topology: str,
        version: str | None = None,
        num_slices: int | str = 1,
        spot: bool | str = False,
        chips_per_host: int | str | None = None,
        service_name: str | None = None,
        namespace: str | None = None,
        raytpu_conn_id: str = DEFAULT_CONN_ID,
        in_place: bool | str = False,
        rollback: bool | str = False,
        upgrade_strategy: str = "NewCluster",
        serve_options: Mapping[str, Any] | None = None,
        cluster_options: RayClusterOptions | Mapping[str, Any] | str | None = None,
        cluster_deletion_delay_seconds: int | None = None,
        **kwargs: Any,
    ) -> None:
        options = take_cluster_options(cluster_options, kwargs)
        super().__init__(**kwargs)
        self.applications = applications
        self.version = version
        self.accelerator = accelerator
        self.topology = topology
        self.num_slices = num_slices
        self.spot = spot
        self.chips_per_host = chips_per_host
        self.service_name = service_name
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.in_place = in_place
        self.rollback = rollback
        self.upgrade_strategy = upgrade_strategy
        self.serve_options = serve_options
        self.cluster_options = options
        self.cluster_deletion_delay_seconds = cluster_deletion_delay_seconds

    def _version_to_deploy(self, context: Context, current: dict[str, Any] | None, rollback: bool,
                           where: str) -> str:
        if not rollback:
            return parse_version(self.version)
        if current is None:
            raise InvalidInputError("rollback", True, f"RayService {where} does not exist",
                                    "Deploy a version first; rollback promotes the one before the current")
        notes = current["metadata"].get("annotations") or {}
        origin = origin_of(context)
        if (notes.get(DAG_ID_KEY), notes.get(RUN_ID_KEY), notes.get(TASK_ID_KEY)) == (
            origin.dag_id, origin.run_id, origin.task_id
        ):
            # An earlier try of this task already rolled back: keep its result (a retry must not toggle).
            return service_version(current) or rollback_target(current)
        return rollback_target(current)

    def execute(self, context: Context) -> dict[str, Any]:
        with fail_fast():
            tpu = TpuSlice(self.accelerator, self.topology, self.num_slices, self.spot, self.chips_per_host)
            options = RayClusterOptions.from_value(self.cluster_options)
            in_place = parse_bool(self.in_place, "in_place")
            rollback = parse_bool(self.rollback, "rollback")
            name = resource_name(self.service_name or default_service_name(context), "service_name",
                                 RAY_SERVICE_NAME_LIMIT)
            namespace = self.resolved_namespace()
            backend = self.service_backend
            current = backend.get_service(name, namespace)
            version = self._version_to_deploy(context, current, rollback, f"{namespace}/{name}")
            manifest = build_ray_service(
                name=name,
                namespace=namespace,
                tpu=tpu,
                applications=self.applications,
                version=version,
                current=current,
                in_place=in_place,
                upgrade_strategy=self.upgrade_strategy,
                serve_options=self.serve_options,
                options=options,
                origin=origin_of(context),
                cluster_deletion_delay_seconds=self.cluster_deletion_delay_seconds,
            )
            previous = previous_version(version_history(manifest), version)
            self.log.info(
                "RayService %s/%s: %s version %r (previous %r) on %s", namespace, name,
                "rolling back to" if rollback else "deploying", version, previous, tpu.describe(),
            )
            result = backend.apply_service(manifest)
            serve_url = backend.serve_endpoint(name, namespace).url
        how = manifest["metadata"]["annotations"][UPDATE_ANNOTATION]
        self.log.info("RayService %s/%s %s (%s)", namespace, name, result.action.value,
                      "nothing changed" if result.action.value == "adopted" else f"update: {how}")
        return {
            "service_name": name,
            "namespace": namespace,
            "conn_id": self.raytpu_conn_id,
            "version": version,
            "previous_version": previous,
            "tpu": tpu.to_dict(),
            "serve_url": serve_url,
        }


class RollbackRayServiceOperator(DeployRayServiceOperator):
    """Promote the RayService's previous model version (read from its version history).

    Takes the same applications and slice as :class:`DeployRayServiceOperator`; the
    version written into each application's ``version_arg`` is the previous one. A retry
    of a rollback that already happened keeps it (it does not toggle back).
    """

    ui_color = "#fef7e0"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.pop("rollback", None)
        super().__init__(rollback=True, **kwargs)


class DeleteRayServiceOperator(ServiceTaskMixin, BaseOperator):
    """Delete a RayService and its clusters; succeeds when it is already gone. Usable as a teardown task.

    :param service_name: the RayService's name.
    :param namespace: the namespace; default: the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection.
    :param wait_for_deletion: wait until the RayService object is gone.
    :param deletion_timeout: seconds to wait for that.
    :param poll_interval: seconds between checks while waiting.
    """

    template_fields: Sequence[str] = ("service_name", "namespace", "raytpu_conn_id")
    ui_color = "#fde8e8"

    def __init__(
        self,
        *,
        service_name: str,
        namespace: str | None = None,
        raytpu_conn_id: str = DEFAULT_CONN_ID,
        wait_for_deletion: bool = False,
        deletion_timeout: float = 600,
        poll_interval: float = 2,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.service_name = service_name
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.wait_for_deletion = wait_for_deletion
        self.deletion_timeout = deletion_timeout
        self.poll_interval = poll_interval

    def execute(self, context: Context) -> dict[str, Any]:
        with fail_fast():
            name = resource_name(self.service_name, "service_name", RAY_SERVICE_NAME_LIMIT)
            namespace = self.resolved_namespace()
            backend = self.service_backend
            deleted = backend.delete_service(name, namespace)
            self.log.info("RayService %s/%s %s", namespace, name, "deleted" if deleted else "was already gone")
            if self.wait_for_deletion:
                wait_until_gone("RayService", name, namespace, backend.get_service, self.deletion_timeout,
                                self.poll_interval)
        return {"service_name": name, "namespace": namespace, "deleted": deleted}
