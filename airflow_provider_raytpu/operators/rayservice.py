"""Deploy, promote, roll back and delete RayServices that serve models on TPU slices."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from airflow_provider_raytpu.backends.apply import SERVICE_OWNER
from airflow_provider_raytpu.backends.base import Precondition
from airflow_provider_raytpu.manifests.names import RAY_SERVICE_NAME_LIMIT, owned_name
from airflow_provider_raytpu.manifests.options import RayClusterOptions
from airflow_provider_raytpu.manifests.rayservice import (
    build_ray_service,
    check_upgrade_strategy,
    parse_version,
    version_history,
)
from airflow_provider_raytpu.manifests.serveconfig import ServeApplication
from airflow_provider_raytpu.tasks.base import (
    ServiceTaskMixin,
    check_literal,
    cluster_options_of,
    fail_fast,
    map_index_of,
    origin_of,
    take_renamed,
)
from airflow_provider_raytpu.tasks.deletion import DeleteOwnedOperator
from airflow_provider_raytpu.tasks.lineage import (
    checkpoint_dataset,
    is_storage_uri,
    service_dataset,
    storage_dataset,
    task_lineage,
)
from airflow_provider_raytpu.tasks.links import ServeApplicationLink
from airflow_provider_raytpu.tasks.promotion import apply_logged, previous_version, roll_back, service_reference
from airflow_provider_raytpu.tasks.slices import SLICE_FIELDS, SliceFields, check_offered, warn_spot
from airflow_provider_raytpu.values import duration_seconds, parse_bool

if TYPE_CHECKING:
    from airflow.sdk import Context


def default_service_name(context: Context, deployment: str) -> str:
    """One RayService per DAG and deploy task (and map index) in a deployment: it outlives runs, which promote
    new versions to it.

    The DAG and task ids, and a hash of both (so ``etl_daily`` and ``etl.daily`` differ), of the
    deployment and, for a mapped task, of its map index (each map index serves its own applications).
    """
    ti = context["ti"]
    map_index = map_index_of(context)
    identity = (ti.dag_id, ti.task_id, deployment) if map_index < 0 else (ti.dag_id, ti.task_id, map_index,
                                                                          deployment)
    return owned_name(f"{ti.dag_id}-{ti.task_id}", identity, "service_name", RAY_SERVICE_NAME_LIMIT)


class DeployRayServiceOperator(ServiceTaskMixin, BaseOperator):
    """Create a RayService serving models on a TPU slice shape, or promote it to a new model version.

    The serving cluster is a RayCluster of ``num_slices`` whole slices, rendered exactly like
    :class:`~airflow_provider_raytpu.operators.raycluster.CreateRayClusterOperator`'s (slice
    fields templated and parsed strictly; literals checked when the DAG is parsed). Ray Serve
    LLM applications get ``accelerator_type`` and ``accelerator_config: {kind: tpu, topology}``
    from the slice, and a preflight refuses, before anything is applied, a replica that cannot
    land on ONE slice (a multi-host LLM without topology or with another topology; a plain
    deployment asking for more chips than a host has without placement-group bundles across hosts).

    The ``version`` (e.g. the checkpoint URI a training task returned) is recorded on the
    RayService and written into each application's ``version_arg``. KubeRay starts a new
    cluster only when ``rayClusterConfig`` changes; so by default the version is also written
    into the cluster config (a pod-template annotation) and KubeRay prepares a fresh slice,
    switching traffic to it once it serves: zero downtime, where an in-place change would
    need room for new replicas on a slice that has none. ``in_place=True`` changes only the
    Serve config. Re-applying the same version is a no-op, so retries are safe.
    ``rollback=True`` promotes the version before the current one in the service's history
    (rolling back twice toggles, like ``kubectl rollout undo``), as
    :class:`RollbackRayServiceOperator` does.

    A RayService outlives runs, so it belongs to the DAG and task that created it: later runs
    of that task promote it; a same-named RayService of another DAG or task is a conflict
    naming its owner. Returns ``{"service_name", "namespace", "raytpu_conn_id", "version",
    "previous_version", "tpu", "serve_url"}``.

    :param applications: the Serve applications: dicts with ``name``, ``import_path`` and
        optionally ``route_prefix``, ``args``, ``deployments``, ``runtime_env``,
        ``version_arg`` (see :class:`~airflow_provider_raytpu.manifests.serveconfig.ServeApplication`).
    :param version: the model version to serve, e.g. ``"{{ ti.xcom_pull('train')['checkpoint_uri'] }}"``.
    :param accelerator: TPU generation, e.g. ``"v6e"``.
    :param topology: slice shape, e.g. ``"4x4"``.
    :param num_slices: number of identical slices in the serving cluster.
    :param chips_per_host: chips per host where the generation offers a choice.
    :param capacity: where the TPUs come from: ``"on-demand"`` (default), ``"spot"``, ``"reservation:<name>"``
        (``"reservation:<project>/<name>"`` shared, ``"reservation:any"``) or ``"flex-start"``
        (``"flex-start:24h"``: a max run duration); see :class:`~airflow_provider_raytpu.capacity.Capacity`.
    :param spot: deprecated: write ``capacity="spot"``.
    :param service_name: the RayService's name (at most 47 characters); default: the DAG and
        task ids and a hash of both and the map index (one RayService per DAG and deploy task, and
        per map index of a mapped one).
    :param namespace: the namespace; default: the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection; default: ``raytpu_default``.
    :param in_place: change only the Serve config (no new cluster).
    :param rollback: promote the previous version from the service's history; ``version`` is then ignored.
    :param upgrade_strategy: KubeRay's ``upgradeStrategy.type``: ``NewCluster`` or ``None`` (with ``in_place``).
    :param serve_options: top-level Serve options (``http_options``, ``proxy_location``, ``logging_config``).
    :param cluster_options: the serving cluster's image, resources, env, ray start flags,
        service account and pod-template fragments, and the RayService's labels and
        annotations: a :class:`~airflow_provider_raytpu.manifests.options.RayClusterOptions`
        or a dict of its fields, every field templated. A field given as a keyword argument
        of its own (``image=...``, the older spelling) still counts, and warns.
    :param cluster_deletion_delay: how long KubeRay keeps the old cluster after a switch (a ``timedelta`` or
        seconds; ``cluster_deletion_delay_seconds`` is its deprecated name).
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
    operator_extra_links = (ServeApplicationLink(),)
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
        capacity: str | None = None,
        service_name: str | None = None,
        namespace: str | None = None,
        raytpu_conn_id: str | None = None,
        in_place: bool | str = False,
        rollback: bool | str = False,
        upgrade_strategy: str = "NewCluster",
        serve_options: Mapping[str, Any] | None = None,
        cluster_options: RayClusterOptions | Mapping[str, Any] | str | None = None,
        cluster_deletion_delay: timedelta | float | None = None,
        **kwargs: Any,
    ) -> None:
        options = cluster_options_of(cluster_options, kwargs)
        delay = take_renamed(kwargs, "cluster_deletion_delay_seconds", "cluster_deletion_delay", cluster_deletion_delay)
        warn_spot(spot)
        SliceFields(accelerator=accelerator, topology=topology, num_slices=num_slices, chips_per_host=chips_per_host,
                    capacity=capacity, spot=spot).check_literal()
        check_literal(options, RayClusterOptions.from_value)
        check_literal((upgrade_strategy, in_place), lambda given: check_upgrade_strategy(
            given[0], parse_bool(given[1], "in_place")))
        super().__init__(**kwargs)
        self.applications = applications
        self.version = version
        self.accelerator = accelerator
        self.topology = topology
        self.num_slices = num_slices
        self.spot = spot
        self.chips_per_host = chips_per_host
        self.capacity = capacity
        self.service_name = service_name
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.in_place = in_place
        self.rollback = rollback
        self.upgrade_strategy = upgrade_strategy
        self.serve_options = serve_options
        self.cluster_options = options
        self.cluster_deletion_delay = None if delay is None else duration_seconds(
            delay, "cluster_deletion_delay", example="timedelta(minutes=5)", allow_zero=True)
        #: The reference of the service as this task applied it (what its lineage reports).
        self.deployed: dict[str, Any] | None = None

    def execute(self, context: Context) -> dict[str, Any]:
        self.deployed = self._deploy(context)
        return self.deployed

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """The checkpoints the promoted version comes from (a storage URI; the training task's ``checkpoint_uri``,
        versioned by the checkpoint), and the service serving it."""
        if not self.deployed:
            return task_lineage([], [])
        version = self.deployed["version"]
        source = []
        if version and is_storage_uri(version):
            checkpoints, checkpoint = checkpoint_dataset(version)
            source.append(storage_dataset(checkpoints, version=checkpoint))
        return task_lineage(source, [service_dataset(self.deployed["namespace"], self.deployed["service_name"],
                                                     version)])

    def _deploy(self, context: Context) -> dict[str, Any]:
        with fail_fast():
            tpu = SliceFields.of(self).tpu()
            check_offered(tpu, self.hook.settings.backend, self.log)
            options = RayClusterOptions.from_value(self.cluster_options)
            in_place = parse_bool(self.in_place, "in_place")
            name = self.resolved_name() if self.service_name else default_service_name(context, self.hook.deployment)
            namespace = self.resolved_namespace()
            backend = self.service_backend
            current = backend.get_service(name, namespace)
            if parse_bool(self.rollback, "rollback"):
                return roll_back(self, context, name, namespace, current, in_place)
            version = parse_version(self.version)
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
                origin=origin_of(context, self.hook.deployment),
                cluster_deletion_delay_seconds=self.cluster_deletion_delay,
            )
            self.log.info("RayService %s/%s: deploying version %r (previous %r) on %s", namespace, name, version,
                          previous_version(version_history(manifest), version), tpu.describe())
            apply_logged(self, context, manifest)
            return service_reference(self, manifest)


class RollbackRayServiceOperator(ServiceTaskMixin, BaseOperator):
    """Promote the RayService's previous model version, read from the service alone.

    Needs only the service (its name, or ``service=deploy.output``) and the connection: the
    version before the current one in the service's history goes into each application's
    recorded ``version_arg`` and, unless ``in_place``, into the cluster config (a fresh
    cluster, zero downtime). Rolling back twice toggles. A retry of a rollback that already
    happened keeps it (it does not toggle back). The RayService keeps its owner. Returns what
    :class:`DeployRayServiceOperator` returns.

    :param service: the service reference (``deploy.output``), instead of ``service_name``.
    :param service_name: the RayService's name.
    :param namespace: the namespace; default: the reference's, else the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection; default: the reference's, else ``raytpu_default``.
    :param in_place: change only the Serve config (no new cluster).
    """

    template_fields: Sequence[str] = ("service", "service_name", "namespace", "raytpu_conn_id", "in_place")
    operator_extra_links = (ServeApplicationLink(),)
    ui_color = "#fef7e0"

    def __init__(self, *, service: Any = None, service_name: str | None = None, namespace: str | None = None,
                 raytpu_conn_id: str | None = None, in_place: bool | str = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.service = service
        self.service_name = service_name
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.in_place = in_place

    def execute(self, context: Context) -> dict[str, Any]:
        with fail_fast():
            name = self.resolved_name()
            namespace = self.resolved_namespace()
            current = self.service_backend.get_service(name, namespace)
            return roll_back(self, context, name, namespace, current, parse_bool(self.in_place, "in_place"))


class DeleteRayServiceOperator(ServiceTaskMixin, DeleteOwnedOperator):
    """Delete a RayService and its clusters; succeeds when it is already gone. Usable as a teardown task.

    Without ``service_name`` (and ``service``) it deletes the RayServices this DAG's deploy
    tasks made (a RayService belongs to its DAG and task, not to a run), found by their owner
    labels. A named RayService is deleted only when this DAG's deploy tasks made it; another
    DAG's is left alone with a warning naming its owner, unless ``force``. Returns
    ``{"service_name", "service_names", "namespace", "deleted", "skipped"}``.

    :param service: the service reference (``deploy.output``), instead of ``service_name``.
    :param service_name: the RayService's name; default: found by owner (see above).
    :param namespace: the namespace; default: the reference's, else the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection; default: the reference's, else ``raytpu_default``.
    :param created_by: delete what these deploy task ids made; default: the
        :class:`DeployRayServiceOperator` tasks upstream of this one, else every task of the DAG.
    :param force: delete the named RayService whoever made it.
    :param wait_for_deletion: wait until the RayService object is gone.
    :param deletion_timeout: seconds to wait for that.
    :param poll_interval: seconds between checks while waiting.
    """

    template_fields: Sequence[str] = ("service", "service_name", "namespace", "raytpu_conn_id", "created_by")
    kind = "RayService"
    owner_keys = SERVICE_OWNER
    name_limit = RAY_SERVICE_NAME_LIMIT
    deletes_also = " and its clusters"

    def __init__(self, *, service: Any = None, service_name: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.service = service
        self.service_name = service_name

    def creates(self, task: Any) -> bool:
        return isinstance(task, DeployRayServiceOperator)

    def get_object(self, name: str, namespace: str) -> dict[str, Any] | None:
        return self.service_backend.get_service(name, namespace)

    def delete_object(self, name: str, namespace: str, precondition: Precondition) -> bool:
        return self.service_backend.delete_service(name, namespace, precondition)

    def list_objects(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return self.service_backend.list_services(namespace, label_selector)
